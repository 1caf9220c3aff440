"""The MLX engine's batch: mlx-lm's models and KV caches, duet's own step around them.

Prompts are prefilled together, a chunk a step (right-padded to the longest chunk and rolled
to the left after, as mlx-lm's batch caches expect); a prompt whose tokens but its last are in
its KV moves to the decoding rows, and the next decode step feeds that last token with the
others' and draws its first token with theirs. A decode step queues the forward, the rows'
processing and draws (sampling.py: a few array operations for the whole batch) and then reads
back the step before it, so the host's work overlaps the device's.

A single row keeps mlx-lm's plain per-sequence caches (a batch cache's masks and padding cost
a lone stream a third of its speed on MLX's CUDA backend); a second row merges them into
batch caches, and a batch down to one row goes back to plain ones."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from ..base import TokenLogprobs
from .sampling import BatchRows, Row, Scored, top_logprobs


# A group of rows keeps plain caches while it is one row and batch caches from two on: the
# helpers below go by the rows' count.


def _batched(caches: list, n: int) -> list:
    """n rows' caches (one a layer) as batch caches."""
    return [type(c).merge([c]) for c in caches] if n == 1 else caches


def _extended(mine: list, n: int, theirs: list, m: int) -> list:
    """n rows' caches followed by m rows' (batch caches, mine extended in place)."""
    mine, theirs = _batched(mine, n), _batched(theirs, m)
    for a, b in zip(mine, theirs):
        a.extend(b)
    return mine


def _split(caches: list, keep: list[int], n: int, fresh) -> list:
    """The rows `keep` of n rows' caches (new cache objects: the others stay where they are);
    fresh() makes a row's plain caches."""
    if n == 1:
        return caches
    out = [copy.copy(c) for c in caches]
    for c in out:
        c.filter(keep)
    return _extracted(out, 0, fresh) if len(keep) == 1 else out


def _row_caches(caches: list, i: int, n: int, fresh) -> list:
    """Row i of n rows' caches as plain ones (a lone row's, the prompt cache's)."""
    return caches if n == 1 else _extracted(caches, i, fresh)


def _extracted(caches: list, i: int, fresh) -> list:
    """Row i of batch caches as plain ones."""
    if caches[0].empty():  # nothing fed yet: extract() has nothing to cut
        return fresh()
    return [c.extract(i) for c in caches]


# A prompt's positions are scored this many at a time, the last piece padded: MLX's CUDA
# backend compiles a kernel for each new shape (a 1,023-position first score took 8.6 s on an
# H100, the same warm 13 ms), and prompt lengths vary by request.
SCORE_PIECE = 256


def _scored_positions(logits: mx.array, after: list[int], k: int) -> list[TokenLogprobs]:
    """Positions' logits [n, V] scored at the tokens after them (log-softmax, k likeliest), a
    SCORE_PIECE of positions at a time."""
    out = []
    for a in range(0, len(after), SCORE_PIECE):
        piece = logits[a:a + SCORE_PIECE].astype(mx.float32)
        n = piece.shape[0]
        if n < SCORE_PIECE:
            piece = mx.pad(piece, [(0, SCORE_PIECE - n), (0, 0)])
        lp = piece - mx.logsumexp(piece, axis=-1, keepdims=True)
        out += top_logprobs(lp, after[a:a + n] + [0] * (SCORE_PIECE - n), k)[:n]
    return out


@dataclass
class Prefilling:
    """A row whose prompt is being fed: the tokens not fed yet (the last always stays for the
    decode step) and those its KV holds."""

    row: Row
    unfed: list[int]
    fed: list[int]
    # k for a prompt whose own tokens are scored as they are fed (echo), else None.
    score_k: int | None = None


@dataclass
class Step:
    """A decode step queued: its rows in order, their tokens and scores still on the device."""

    seq_ids: list[int]
    tokens: mx.array
    scored: Scored | None
    read: list[int] | None = None  # the tokens, once read back
    landed: dict[int, int] = field(default_factory=dict)  # of rows still in the batch


@dataclass
class Left:
    """A row that left, with the KV it held (plain caches) and the tokens they hold."""

    seq_id: int
    caches: list
    tokens: list[int]


@dataclass
class Batch:
    model: object
    vocab: int
    prefill_tokens: int  # a step's prefill budget, shared by the rows being prefilled
    min_chunk: int = 32  # a prompt's fewest tokens a step, however many share the budget
    # Rows being prefilled, and their caches (plain for one row, batch caches for more).
    prefilling: list[Prefilling] = field(default_factory=list)
    prefill_caches: list | None = None
    # Rows decoding, in the order of their caches and of `rows`.
    rows: BatchRows | None = None
    caches: list | None = None
    fed: list[list[int]] = field(default_factory=list)  # the tokens each row's KV holds
    inputs: mx.array | None = None  # [B]: what the next step feeds, maybe not computed yet
    pending: Step | None = None  # the last step queued, not read back yet
    steps: int = 0

    def __post_init__(self):
        self.rows = BatchRows(self.vocab)

    def __len__(self) -> int:
        return len(self.rows) + len(self.prefilling)

    def _fresh(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    @property
    def seq_ids(self) -> list[int]:
        return self.rows.seq_ids + [p.row.seq_id for p in self.prefilling]

    def add(self, row: Row, prompt: Sequence[int], caches: list, cached: int = 0,
            score_k: int | None = None) -> None:
        """A prompt joins: `caches` (plain, one a layer) hold its first `cached` tokens. With
        score_k, each prompt token fed is scored (its log-softmax and the k likeliest) by the
        logits before it, as the prompt prefills."""
        joining = Prefilling(row, list(prompt[cached:]), list(prompt[:cached]), score_k)
        n = len(self.prefilling)
        self.prefill_caches = _extended(self.prefill_caches, n, caches, 1) if n else caches
        self.prefilling.append(joining)

    def remove(self, seq_ids: set[int], keep_kv: bool) -> list[Left]:
        """Drop these rows (decoding or prefilling); with keep_kv, what their caches held (a
        copy of each row's KV: none is made for nobody)."""
        left = []
        n = len(self.prefilling)
        gone = [i for i, p in enumerate(self.prefilling) if p.row.seq_id in seq_ids]
        if gone:
            for i in gone if keep_kv else ():
                p = self.prefilling[i]
                caches = _row_caches(self.prefill_caches, i, n, self._fresh)
                left.append(Left(p.row.seq_id, caches, p.fed))
            keep = [i for i in range(n) if i not in gone]
            self.prefilling = [self.prefilling[i] for i in keep]
            self.prefill_caches = (_split(self.prefill_caches, keep, n, self._fresh)
                                   if keep else None)
        n = len(self.rows)
        gone = [i for i, s in enumerate(self.rows.seq_ids) if s in seq_ids]
        if gone:
            for i in gone if keep_kv else ():
                caches = _row_caches(self.caches, i, n, self._fresh)
                left.append(Left(self.rows.rows[i].seq_id, caches, self.fed[i]))
            keep = [i for i in range(n) if i not in gone]
            self.rows.filter(keep)
            self.fed = [self.fed[i] for i in keep]
            if keep:
                self.caches = _split(self.caches, keep, n, self._fresh)
                self.inputs = self.inputs[mx.array(keep, dtype=mx.int32)]
            else:
                self.caches = self.inputs = None
        return left

    def step(self) -> tuple[dict[int, int], dict[int, TokenLogprobs],
                            dict[int, tuple[int, list[TokenLogprobs]]]]:
        """Rows done prefilling join the decoding ones; a decode step is queued and the one
        before it read back; then a prefill chunk. The tokens (and scores) read, and the
        prompt tokens scored by the chunk: seq id -> (the first one's position, scores)."""
        self._join_prefilled()
        tokens, scored = self._decode() if len(self.rows) else ({}, {})
        return tokens, scored, (self._prefill_chunk() if self.prefilling else {})

    def _join_prefilled(self) -> None:
        done = [i for i, p in enumerate(self.prefilling) if len(p.unfed) == 1]
        if not done:
            return
        n = len(self.prefilling)
        caches = (_split(self.prefill_caches, done, n, self._fresh) if len(done) < n
                  else self.prefill_caches)
        rest = [i for i in range(n) if i not in done]
        joining = [self.prefilling[i] for i in done]
        self.prefill_caches = _split(self.prefill_caches, rest, n, self._fresh) if rest else None
        self.prefilling = [self.prefilling[i] for i in rest]
        self.caches = (caches if self.caches is None
                       else _extended(self.caches, len(self.rows), caches, len(joining)))
        self.rows.extend(BatchRows(self.vocab, [p.row for p in joining]))
        self.fed += [p.fed + p.unfed for p in joining]  # the next step feeds the last token
        last = mx.array([p.unfed[0] for p in joining], dtype=mx.uint32)
        self.inputs = last if self.inputs is None else mx.concatenate([self.inputs, last])

    def _decode(self) -> tuple[dict[int, int], dict[int, TokenLogprobs]]:
        rows = self.rows
        logits = self.model(self.inputs[:, None], cache=self.caches)[:, -1, :]
        before = self.pending
        if rows.waits_for_tokens:  # the masks need the last tokens: the forward runs meanwhile
            mx.async_eval(logits)
            self._read(before)
        if rows.plain:
            tokens, scored = mx.argmax(logits, axis=-1), None
        else:
            logits = rows.process(logits)
            tokens = rows.sample(logits)
            scored = rows.score(logits, tokens)
        rows.took(tokens)
        self.inputs = tokens.astype(mx.uint32)
        self.pending = Step(rows.seq_ids, tokens, scored)
        mx.async_eval(tokens, *(scored.arrays() if scored else ()))
        self.steps += 1
        if self.steps % 512 == 0:
            mx.clear_cache()  # as mlx-lm's generator: buffers of every size the KV grew through
        if before is None:
            return {}, {}
        self._read(before)
        scored = before.scored.read() if before.scored else {}
        return before.landed, {s: lp for s, lp in scored.items() if s in before.landed}

    def _read(self, step: Step | None) -> None:
        """Read a step's tokens back (once): the rows still here take them into their KV's
        account and their grammars."""
        if step is None or step.read is not None:
            return
        step.read = step.tokens.tolist()
        index = {s: i for i, s in enumerate(self.rows.seq_ids)}
        landed = {}
        for seq_id, token in zip(step.seq_ids, step.read):
            i = index.get(seq_id)
            if i is not None:  # a row that left meanwhile is no one's concern
                self.fed[i].append(token)
                landed[seq_id] = token
        step.landed = landed
        self.rows.read(landed)

    def _prefill_chunk(self) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """Every prefilling row's next chunk (all its tokens but the last at most), as one
        forward of rows right-padded to the longest chunk; the scores of the prompt tokens
        after each scored row's chunk (each position's logits score the next token)."""
        rows = self.prefilling
        share = max(self.min_chunk, self.prefill_tokens // len(rows))
        chunks = [p.unfed[:min(share, len(p.unfed) - 1)] for p in rows]
        width = max(map(len, chunks))
        padding = [width - len(c) for c in chunks]
        if any(padding):
            for c in self.prefill_caches:
                c.prepare(lengths=[len(c_) for c_ in chunks], right_padding=padding)
        tokens = mx.array([c + [0] * pad for c, pad in zip(chunks, padding)])
        logits = self.model(tokens, cache=self.prefill_caches)
        if any(padding):
            for c in self.prefill_caches:
                c.finalize()
        scored = {}
        for i, (p, chunk) in enumerate(zip(rows, chunks)):
            if p.score_k is not None:
                # The chunk's positions score the tokens after them: the rest of the chunk
                # and the first token not fed yet (the prompt's last at the end).
                after = chunk[1:] + p.unfed[len(chunk):len(chunk) + 1]
                scored[p.row.seq_id] = (len(p.fed) + 1, logits[i, :len(chunk)], after,
                                        p.score_k)
        mx.eval([c.state for c in self.prefill_caches])
        for p, chunk in zip(rows, chunks):
            p.fed += chunk
            del p.unfed[:len(chunk)]
        return {seq_id: (first, _scored_positions(rows_, after, k))
                for seq_id, (first, rows_, after, k) in scored.items()}
