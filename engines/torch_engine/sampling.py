"""Token sampling that stays on the device: no host round trip to pick a token."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..base import TokenLogprobs
from ..noise import UNIFORM_BITS
from ..runtime.plan import ScheduledSeq
from .transfer import ToHost, to_device

ARGMAX_CHUNK = 1024


def argmax_in_chunks(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax of a vector [V] (the first of equal maxima), in two stages: the maximum of
    each chunk in parallel, then the best chunk. Compiled, this is two small kernels; ATen's
    one-row argmax runs in a single thread block (29 us for a 128k vocabulary on an H200, 3%
    of a llama-3.2-1b step)."""
    v = logits.shape[-1]
    chunks = -(-v // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, where = padded.view(chunks, ARGMAX_CHUNK).max(dim=-1)
    # gather, not where[chunk]: indexing by a tensor's value would stop the compiler's trace.
    index = where + torch.arange(chunks, device=logits.device) * ARGMAX_CHUNK
    return index.gather(0, torch.argmax(best).view(1))


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit values. Its
    multipliers are below 2**31, so no product leaves int64's range on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _row_keys(seeds: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return _mix32(lo ^ _mix32(hi ^ _mix32(draws & _M32)))


def _bits(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of each (row key, column) pair, broadcast."""
    return _mix32(_mix32(columns) ^ keys)


def unit(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits as a float32 uniform in (0, 1): never 0, never 1 (noise.py says why)."""
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def _uniforms(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The uniform number of each (row key, column) pair, broadcast."""
    return unit(_bits(keys, columns))


def row_uniforms(seeds: torch.Tensor, draws: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), [B, width]: row b's are a function of (seeds[b], draws[b])
    alone. A counter-based generator, so a row's draw does not depend on which rows share
    the batch, nor on how many draws other requests made (a torch.Generator's would)."""
    columns = torch.arange(width, device=seeds.device, dtype=torch.long)
    return _uniforms(_row_keys(seeds, draws)[:, None], columns[None, :])


def probabilities(logits: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
    """Each row's probabilities [B, V] at its temperature, the tokens under min_p times the
    likeliest's at 0. floats [B, 3]: temperature, log min_p (or -inf), top_p."""
    x = logits.float() / floats[:, 0:1]
    x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floats[:, 1:2], float("-inf"))
    return torch.softmax(x, dim=-1)


# The eager sampler ranks each row's likeliest CANDIDATES first, and sorts a whole row only
# when its top_p border lies beyond them (a flat distribution).
CANDIDATES = 1024


def _borders(ranks: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
             total: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's least kept probability [B, 1] under its top_k and top_p, from its R likeliest
    probabilities, sorted (ranks [B, R]); total [B, 1]: a row's whole mass, where the ranks
    may not hold all of it. And whether the row's borders lie within the ranks [B, 1]."""
    r = ranks.shape[-1]
    k = ints[:, 2:3]  # V where a row has no top_k: more than R, so it keeps all
    kth = torch.where(k <= r, ranks.gather(1, k.clamp(max=r) - 1), 0.0)
    ranks = ranks.masked_fill(ranks < kth, 0.0)
    # Keep a rank while those above it hold less than top_p of the mass top_k kept; the
    # likeliest always stays.
    mass = ranks.cumsum(dim=-1)
    kept_mass = mass[:, -1:] if total is None else torch.where(k <= r, mass[:, -1:], total)
    top_p = floats[:, 2:3]
    target = top_p * kept_mass
    kept = ((mass - ranks) < target).sum(dim=-1, keepdim=True)
    least = torch.where(top_p < 1.0, torch.maximum(kth, ranks.gather(1, kept - 1)), kth)
    return least, (top_p >= 1.0) | (mass[:, -1:] >= target)


def nucleus(probs: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
            ranked: int) -> torch.Tensor:
    """probs [B, V] with the tokens outside each row's top_k and top_p at 0: a token stays
    while it is among the top_k likeliest, and the tokens likelier than it hold less than
    top_p of what top_k kept (the fewest whose mass reaches top_p); tokens tied with the last
    one kept stay. ints [B, 3]: seed, draws so far, top_k (V where a row has none). ranked:
    how many of each row's likeliest tokens must be ranked (the largest top_k, or V where a
    row has top_p). No host reads: a CUDA graph captures it."""
    # The likeliest first; a sort of the whole row beats topk's for every token.
    ranks = (torch.sort(probs, dim=-1, descending=True).values if ranked >= probs.shape[-1]
             else torch.topk(probs, ranked, dim=-1).values)
    return probs.masked_fill(probs < _borders(ranks, floats, ints, None)[0], 0.0)


def nucleus_by(borders: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
    """nucleus() with each row's border from borders(probs, floats, ints) [B, 1] (a kernel
    that finds it without ranking the row: nucleus_kernel.borders)."""
    def searched(probs: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                 ranked: int) -> torch.Tensor:
        return probs.masked_fill(probs < borders(probs, floats, ints), 0.0)
    return searched


def nucleus_eager(probs: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                  ranked: int) -> torch.Tensor:
    """nucleus(), ranking each row's CANDIDATES likeliest first and sorting whole only the
    rows whose top_p border lies beyond them (a host read: for the eager sampler of the CPU
    and MPS, where a sort of the vocabulary is most of a draw)."""
    v = probs.shape[-1]
    if ranked < v or v <= CANDIDATES:
        return nucleus(probs, floats, ints, ranked)
    least, found = _borders(torch.topk(probs, CANDIDATES, dim=-1).values, floats, ints,
                            probs.sum(dim=-1, keepdim=True))
    if not bool(found.all()):
        rows = torch.nonzero(~found[:, 0])[:, 0]
        whole, _ = _borders(torch.sort(probs[rows], dim=-1, descending=True).values,
                            floats[rows], ints[rows], None)
        least = least.index_copy(0, rows, whole)
    return probs.masked_fill(probs < least, 0.0)


def race(probs: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V], drawn with each row's own noise (its seed and draw
    count, ints[:, 0:2]). Exponential race (Gumbel-max in disguise): argmax of p / E with
    E ~ Exp(1) draws each token with probability p, and needs no multinomial (no sync, no
    cumulative search)."""
    noise = -torch.log(row_uniforms(ints[:, 0], ints[:, 1], probs.shape[-1]))
    return torch.argmax(probs / noise, dim=-1)


def race_among(probs: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """race() where most of probs are 0 (the nucleus kept few tokens): the noise is made for
    the tokens still in alone, the same numbers race() makes for them, so the same draw."""
    rows, columns = torch.nonzero(probs, as_tuple=True)
    keys = _row_keys(ints[:, 0], ints[:, 1])
    scores = torch.zeros_like(probs)
    scores[rows, columns] = probs[rows, columns] / -torch.log(_uniforms(keys[rows], columns))
    return torch.argmax(scores, dim=-1)


class Sampler:
    """A draw: probabilities(), the nucleus where a row has top_k or top_p, the race.
    Compiled (by Inductor where the decode step is: CUDA), probabilities() and race() are a
    few fused kernels; eagerly, the seeded noise alone is a dozen full passes over [B, V]
    (0.75 ms a step for 64 rows of a 49k vocabulary on an H100, 0.15 ms compiled). The
    nucleus is not compiled: Inductor (torch 2.11) fails to generate its cumulative sum over
    a row of symbolic length; on CUDA the graphs find each row's border with a Triton search
    instead of a sort (nucleus_kernel, given as borders). Compiled, a batch of one row would
    get graphs of its own (Dynamo specializes a size of 1): cuda_graphs' GraphSampler never
    draws fewer than two. The eager sampler of the CPU and MPS ranks few tokens where it can
    (nucleus_eager) and makes noise for the tokens the nucleus kept alone (race_among): both
    read the device."""

    def __init__(self, backend: str | None = None, captured: bool = False, borders=None):
        """backend: torch.compile's, or None for eager ops. captured: for a CUDA graph, so
        without host reads (nucleus() and race() for every row, whatever the backend).
        borders: where given, what finds each row's nucleus border (nucleus_by)."""
        self._probabilities, self._race = (
            (probabilities, race) if backend is None else
            (torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
             for fn in (probabilities, race)))
        no_reads = captured or backend
        self._race_ranked = self._race if no_reads else race_among
        self._nucleus = (nucleus_by(borders) if borders is not None
                         else nucleus if no_reads else nucleus_eager)

    def __call__(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                 ranked: int) -> torch.Tensor:
        """One token per row of logits [B, V]; floats, ints and ranked as nucleus() has them."""
        probs = self._probabilities(logits.float(), floats)
        if not ranked:
            return self._race(probs, ints)
        return self._race_ranked(self._nucleus(probs, floats, ints, ranked), ints)


class Draws(Protocol):
    """A Sampler, or one replayed as CUDA graphs (cuda_graphs.GraphSampler)."""

    def __call__(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                 ranked: int) -> torch.Tensor: ...


def sample_rows(logits: torch.Tensor, rows: Sequence[ScheduledSeq],
                sampler: Draws | None = None) -> torch.Tensor:
    """One token per row of logits [B, V], each row by its own settings (Sampler); greedy rows
    take the argmax. Stays on the device (no host round trip to pick a token)."""
    sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
    if not sampled:
        return torch.argmax(logits, dim=-1)
    device, v = logits.device, logits.shape[-1]
    settings = [rows[i].sampling for i in sampled]
    floats = to_device([[s.temperature, math.log(s.min_p) if s.min_p > 0.0 else -math.inf,
                         s.top_p] for s in settings], torch.float32, device)
    ks = [s.top_k if 0 < s.top_k < v else v for s in settings]
    # Seeds are folded into uint64 by the protocol; int64 holds the same bits.
    ints = to_device([[s.seed - (1 << 64) if s.seed >= 1 << 63 else s.seed, rows[i].draws, k]
                      for i, s, k in zip(sampled, settings, ks)], torch.long, device)
    # A row with top_p must rank every token; one with top_k alone its k likeliest.
    ranked = max((k for k, s in zip(ks, settings) if k < v or s.top_p < 1.0), default=0)
    sampler = sampler or Sampler()
    if len(sampled) == len(rows):
        return sampler(logits, floats, ints, ranked)
    pick = to_device(sampled, torch.long, device)
    greedy = torch.argmax(logits, dim=-1)
    return greedy.index_copy(0, pick, sampler(logits.index_select(0, pick), floats, ints, ranked))


class ScoredRows:
    """The log-probabilities of a step's rows that asked for them, on their way to the host
    (ToHost): reading them when the step is collected waits for this step alone, not for the
    next one that a pipelined executor has queued since. One float32 table [N, 1 + 2k] (each
    row's chosen token's score, its k likeliest scores, their token ids, exact in float32
    below 2**24) makes one copy and one read a step, not three."""

    def __init__(self, seq_ids: list[int], table: torch.Tensor, ks: list[int]):
        self.seq_ids, self.ks = seq_ids, ks
        self._copy = ToHost(table)

    def read(self) -> dict[int, TokenLogprobs]:
        (table,) = self._copy.read()
        rows, k = table.tolist(), (table.shape[1] - 1) // 2
        return {
            seq_id: TokenLogprobs(row[0], tuple(zip(map(int, row[1 + k: 1 + k + n]),
                                                    row[1: 1 + n])))
            for seq_id, n, row in zip(self.seq_ids, self.ks, rows)
        }


def scores_table(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """ScoredRows' table for logits [N, V] at tokens [N]: each row's log-softmax at its token,
    its k likeliest scores, their ids. Device ops alone, no host read: a CUDA graph holds it
    (cuda_graphs.GraphScorer)."""
    scores = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # one pass, not two
    chosen = scores.gather(1, tokens.view(-1, 1))
    top = torch.topk(scores, k, dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


class Scores(Protocol):
    """scores_table(), or the same replayed as CUDA graphs (cuda_graphs.GraphScorer), which
    may give more than k alternatives (a row reads its own first ones)."""

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor: ...


def _scored(logits: torch.Tensor, tokens: torch.Tensor, keys: list, ks: list[int],
            scorer: Scores = scores_table) -> ScoredRows:
    """Row i of logits [N, V] scored at tokens[i]: the log-softmax there and the ks[i]
    likeliest tokens', kept under keys[i]."""
    return ScoredRows(keys, scorer(logits, tokens, max(1, max(ks))), ks)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   rows: Sequence[ScheduledSeq], scorer: Scores = scores_table) -> ScoredRows:
    """For each row whose sampling asks for log-probabilities: the log-softmax of its logits
    (after the row's processing, before temperature and the other filters) at the token it got,
    and its k most likely tokens."""
    asked = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    if len(asked) < len(rows):  # else every row, as they are: no copy nor gathers
        pick = to_device(asked, torch.long, logits.device)
        logits, tokens = logits.index_select(0, pick), tokens.index_select(0, pick)
    return _scored(logits, tokens, [rows[i].seq_id for i in asked],
                   [rows[i].sampling.logprobs for i in asked], scorer)


def score_tokens(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Each of logits [T, V]'s rows scored at tokens[t] (the model's log-softmax) with its k
    likeliest tokens: a prompt's own tokens, read back at once (a prefill is not pipelined)."""
    positions = list(range(len(tokens)))
    scored = _scored(logits, torch.tensor(tokens, device=logits.device), positions,
                     [k] * len(tokens))
    return list(scored.read().values())
