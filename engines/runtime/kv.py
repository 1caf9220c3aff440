"""The KV pool's bookkeeping: storage cut into blocks of `block_size` tokens, handed to
sequences as they grow and taken back when they leave. The storage itself belongs to the
engine (torch tensors, mlx-lm's caches); this is the one account of who holds what.

Blocks, not one slot per sequence: a long conversation and many short ones draw on the same
pool, admission is by tokens actually needed, and a later prefix cache can share a block
between sequences by counting its holders."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..base import EngineError


class KVPoolTooSmall(EngineError):
    """A request that could not fit even in the empty pool."""

    def __init__(self, tokens: int, capacity: int):
        super().__init__(
            f"this request needs KV cache for {tokens} tokens (prompt plus max_tokens), more "
            f"than the whole KV cache holds ({capacity} tokens; raise --kv-cache-memory or ask "
            "for fewer tokens)"
        )
        self.tokens = tokens
        self.capacity = capacity

    def __reduce__(self):  # pickled across the engine process's pipe
        return type(self), (self.tokens, self.capacity)


class BlockPool:
    """Blocks handed out and taken back, each with a count of its holders. With the prefix
    cache on, a full block whose KV is computed is registered under the hash of its tokens and
    every token before it (a chain: the block's own tokens and its parent's hash); when its
    last holder lets go it stays cached, evictable, in least-recently-used order, and a later
    sequence whose tokens start the same way takes it instead of computing it again.

    A sequence holds a block's parents whenever it holds the block, and lets go of its blocks
    last first, so a cached block is always older in that order than its parents and goes
    first: the chain from the root stays whole."""

    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        # Popped from the end: the lowest ids go first, which keeps early use compact.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._holders = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none: LRU
        self._by_hash: dict[int, int] = {}
        # block -> (its hash, its parent's hash, its tokens): a lookup checks the tokens, so
        # only a collision of the whole chain's 64-bit hash could serve the wrong KV.
        self._cached: dict[int, tuple[int, int, tuple[int, ...]]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence may take: never used, or cached and held by none."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._cached)

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_size * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def check_fits(self, tokens: int) -> None:
        if self.blocks_for(tokens) > self.num_blocks:
            raise KVPoolTooSmall(tokens, self.capacity_tokens)

    def grow(self, blocks: list[int], tokens: int) -> bool:
        """Extend `blocks` (a sequence's, in order) to cover `tokens`, evicting the least
        recently used cached blocks when no other is free; False, changing nothing, when the
        pool has too few free blocks."""
        need = self.blocks_for(tokens) - len(blocks)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        for _ in range(need):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._holders[block] = 1
            blocks.append(block)
        return True

    def release(self, blocks: list[int]) -> None:
        """A sequence lets go of its blocks: a cached one with no holder left becomes
        evictable, the others free."""
        freed = []
        for block in reversed(blocks):  # the last first: see the class's docstring
            self._holders[block] -= 1
            if self._holders[block] == 0:
                if block in self._cached:
                    self._evictable[block] = None
                else:
                    freed.append(block)
        self._free.extend(freed)
        blocks.clear()

    def register(self, block: int, key: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Block `block`, full of `tokens` with their KV computed, is cached under key (chain(
        parent, tokens)); a block already cached under that key keeps it."""
        if key not in self._by_hash and block not in self._cached:
            self._by_hash[key] = block
            self._cached[block] = (key, parent, tokens)

    def take_cached(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
        """The longest run of cached blocks that starts `tokens`, covering at most limit
        tokens: (the blocks, now held by the caller; their keys)."""
        blocks: list[int] = []
        keys: list[int] = []
        parent = ROOT
        size = self.block_size
        for start in range(0, limit - size + 1, size):
            chunk = tuple(tokens[start:start + size])
            key = chain(parent, chunk)
            block = self._by_hash.get(key)
            if block is None or self._cached[block][1:] != (parent, chunk):
                break
            if self._holders[block] == 0:
                del self._evictable[block]
            self._holders[block] += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def drop_cache(self) -> None:
        """Forget every cached block (their KV may be wrong: a step failed): the evictable
        ones are free again, the held ones will be when let go."""
        for block in list(self._cached):
            self._forget(block)
        self._free.extend(self._evictable)
        self._evictable.clear()

    def _forget(self, block: int) -> None:
        key = self._cached.pop(block)[0]
        del self._by_hash[key]


ROOT = 0  # the parent key of a sequence's first block


def chain(parent: int, tokens: tuple[int, ...]) -> int:
    """A block's key: its tokens' and every earlier token's (through the parent's key)."""
    return hash((parent, tokens))
