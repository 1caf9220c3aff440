"""The MLX engine's prefix cache: the KV of sequences that left the batch (mlx-lm's
per-sequence caches, taken from its BatchGenerator as they leave), kept least-recently-used
first, so a prompt that starts the same way (a chat's next turn, a shared system prompt) joins
with that prefix's KV and prefills only the rest.

mlx-lm allocates its caches as sequences grow, so the KV pool is the runtime's account of them,
not storage: the entries kept here count against the same budget, and give way (the least
recently used first) whenever the running sequences' share of it and theirs would exceed it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..runtime.kv import BlockPool


@dataclass
class _Entry:
    tokens: np.ndarray  # the tokens whose KV the cache holds, in order
    layers: list  # one mlx-lm KVCache a layer
    nbytes: int


class PromptCache:
    min_tokens = 16  # a shorter shared prefix is prefilled again: not worth a copy
    max_entries = 64  # the longest-prefix search looks at each

    def __init__(self, pool: BlockPool):
        self._pool = pool
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.tokens = 0  # tokens of KV kept, in all

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], layers: list) -> None:
        """Keep a sequence's caches (one a layer) holding `tokens`. Only plain KV caches whose
        length is the tokens' (a sliding window's or a state space layer's cannot be cut to a
        prefix); the copies start on the device at once, so the batch they came from is not
        held."""
        from mlx_lm.models.cache import KVCache

        if len(tokens) < self.min_tokens or not all(
                type(c) is KVCache and c.offset == len(tokens) for c in layers):
            return
        n = len(tokens)
        layers = [_cut(c, n) for c in layers]  # a cache's buffer grows in steps past its length
        mx.async_eval([a for c in layers for a in (c.keys, c.values)])
        entry = _Entry(np.asarray(tokens, dtype=np.int64), layers,
                       sum(c.nbytes for c in layers))
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        self.tokens += len(entry.tokens)
        while len(self._entries) > self.max_entries:
            self._evict()
        self.fit()

    def take(self, prompt: Sequence[int]) -> tuple[list | None, int]:
        """Caches holding the longest cached prefix of `prompt` (all but its last token at
        most, whose logits the prefill must give), new ones the caller may extend, and that
        prefix's length; (None, 0) when none is long enough."""
        if not self._entries or len(prompt) <= self.min_tokens:
            return None, 0
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(ids) - 1)
            differ = np.flatnonzero(entry.tokens[:n] != ids[:n])
            shared = int(differ[0]) if differ.size else n
            if shared > best_len:
                best, best_len = key, shared
        if best is None or best_len < self.min_tokens:
            return None, 0
        self._entries.move_to_end(best)
        return [_cut(c, best_len) for c in self._entries[best].layers], best_len

    def fit(self) -> None:
        """Evict the least recently used while the running sequences' KV and the entries'
        would exceed the KV budget."""
        while self._entries and self._pool.used_bytes + self.nbytes > self._pool.capacity_bytes:
            self._evict()

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.tokens -= len(entry.tokens)


def _cut(cache, n: int):
    """A new KVCache of cache's first n positions (a new object: the generator extends the
    one it is given in place)."""
    from mlx_lm.models.cache import KVCache

    new = KVCache()
    new.keys, new.values = cache.keys[..., :n, :], cache.values[..., :n, :]
    new.offset = n
    return new
