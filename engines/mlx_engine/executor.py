"""The MLX engine's step executor: duet's own batch (batch.py) around mlx-lm's model and KV
caches, which prefills new prompts in chunks between decode steps and advances every decoding
row one token a step, its processing and draws done for the whole batch at once.

It takes each prompt whole (its traits say it answers late) and answers a sequence's first token a
step or more after it joined; the runtime keeps a token of KV room ahead for it. The prompts
being prefilled share max_prefill_tokens a step. Stop strings, end ids and max_tokens are the
runtime's: the batch is told none of them.

With a prompt cache (prompt_cache.py), a sequence that leaves gives its KV to it, and a prompt
that starts as a kept one did joins with that prefix's KV and prefills only the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ..runtime.plan import ExecutorTraits, ScheduledSeq, StepOutput, StepPlan
from .batch import Batch
from .prompt_cache import PromptCache
from .sampling import Row

log = logging.getLogger("duet.engines.mlx")


class MLXExecutor:
    # mlx-cuda's step is bound by the host (its Python and kernel launches): the runtime's own
    # per-token work (detokenizing, stop strings, events) runs on a thread beside it.
    # A prompt whose own tokens are asked for (echo) is scored chunk by chunk as it prefills,
    # inside the batch's steps.
    traits = ExecutorTraits(answers_late=True, output_thread=True, scores_prompts=True)
    # Prompts that arrive while the generator runs are gathered (until a step brings none, for
    # at most gather_s) and inserted together: each insert is a prefill of its own and a merge
    # into the running batch, and on an H200 16 prompts joining one a step ran at 0.53x the
    # speed of the same 16 joining at once (scripts/profile_mlx_batch.py --waves). Clients that
    # connect together reach the server over a few ms; a few ms of extra TTFT for a joiner buys
    # one join for them all.
    gather_s = 0.02
    # An idle generator holds a first prompt until none came for quiet_s: the head of a burst
    # inserted alone is prefilled and decoded alone while the rest wait for its step, then
    # joins them in a merge of its own (engine alone on an H100, a burst's head a step early:
    # 0.85x / 0.72x of BatchGenerator at 16 / 32 rows against 1.06x / 0.82x all at once, same
    # run). Clients send a burst within a few ms, but the server hands the prompts over one by
    # one, 0.3-0.5 ms each, with pauses of up to 3 ms (an H200, 32 clients: 10-20 ms from the
    # first to the last): with 2 ms, 3 bursts of 24 split in two, each split costing the whole
    # batch a join; with 5 ms none did.
    quiet_s = 0.005

    def __init__(self, model, *, vocab: int, max_batch: int, max_prefill_tokens: int,
                 prompt_cache: PromptCache | None = None):
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        self._model = model
        self._batch = Batch(model, vocab, max_prefill_tokens)
        self._held: list[ScheduledSeq] = []  # prompts waiting to join together
        self._held_since = 0.0
        self._last_new = 0.0
        self._widest_gap = 0.0  # between two arrivals of the prompts held (a debug log's)
        self._group = max_batch
        self._cache = prompt_cache
        self._cached: dict[int, int] = {}  # seq id -> prompt tokens joined with cached KV
        # On Apple silicon, the weights and KV stay wired in memory while the executor runs
        # (mlx-lm's generators do the same); None elsewhere.
        self._wired = maybe_set_recommended_wired_limit()

    @property
    def min_chunk(self) -> int:
        return self._batch.min_chunk

    @min_chunk.setter
    def min_chunk(self, tokens: int) -> None:
        self._batch.min_chunk = tokens

    def launch(self, plan: StepPlan) -> StepOutput:
        """The whole step: MLX's own lazy evaluation already overlaps the host and the device."""
        self.release(plan.released)
        known = set(self._batch.seq_ids)
        new = [row for row in plan.prefill if row.seq_id not in known]
        now = time.perf_counter()
        if new:
            if not self._held:
                self._held_since = now
                self._widest_gap = 0.0
            else:
                self._widest_gap = max(self._widest_gap, now - self._last_new)
            self._held += new
            self._last_new = now
        if self._held and self._joins(bool(new), now):
            self._add(self._held)
            self._held = []
        cached, self._cached = self._cached, {}
        if not len(self._batch):
            if self._held:  # an idle batch waiting out the quiet window: no busy loop
                time.sleep(min(self.quiet_s / 4, 0.0005))
            return StepOutput({}, cached_tokens=cached, kept_tokens=self._kept())
        tokens, scored, prompt_scores = self._batch.step()
        return StepOutput(tokens, scored, prompt_scores, cached_tokens=cached,
                          kept_tokens=self._kept())

    @staticmethod
    def collect(output: StepOutput) -> StepOutput:
        return output

    def _kept(self) -> int | None:
        if self._cache is None:
            return None
        self._cache.fit()  # the running sequences grew: kept prefixes give way
        return self._cache.tokens

    def _joins(self, newcomers: bool, now: float) -> bool:
        """Whether the gathered prompts join now. A running batch takes them at the first step
        that brought no newcomer (the burst is over); an idle one, whose steps come
        microseconds apart, once quiet_s passed without one. Either way at a full batch, or
        once the oldest has waited gather_s."""
        if len(self._held) >= self._group or now - self._held_since >= self.gather_s:
            return True
        if len(self._batch):
            return not newcomers
        return now - self._last_new >= self.quiet_s

    def _add(self, rows: list[ScheduledSeq]) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        log.debug("%d prompt(s) join a batch of %d after %.1f ms held (widest gap between "
                  "arrivals %.1f ms)", len(rows), len(self._batch),
                  (time.perf_counter() - self._held_since) * 1e3, self._widest_gap * 1e3)
        for row in rows:
            scored = row.sampling.prompt_logprobs
            # A scored prompt feeds every token (a cached prefix's would go unscored).
            layers, n = ((None, 0) if self._cache is None or scored is not None
                         else self._cache.take(row.tokens))
            if n:
                self._cached[row.seq_id] = n
            self._batch.add(Row.of(row.seq_id, row.sampling, row.draws, row.history),
                            row.tokens, layers if layers is not None
                            else make_prompt_cache(self._model), n, scored)

    def release(self, seq_ids: Sequence[int]) -> None:
        if not seq_ids:
            return
        gone = set(seq_ids)
        if self._held:
            self._held = [row for row in self._held if row.seq_id not in gone]
        for left in self._batch.remove(gone, keep_kv=self._cache is not None):
            self._cache.put(left.tokens, left.caches)

    def close(self) -> None:
        if self._wired is not None:
            import mlx.core as mx

            mx.synchronize()
            mx.set_wired_limit(self._wired)
            self._wired = None
