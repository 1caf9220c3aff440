"""The MLX engine's step executor: mlx-lm's BatchGenerator, which keeps every sequence's
batched KV cache, prefills new prompts in chunks between decode steps, and advances the whole
batch one token per next().

It takes each prompt whole (its traits say it answers late) and answers a sequence's first token a
step or more after it joined; the runtime keeps a token of KV room ahead for it. The generator
prefills every prompt it holds by prefill_step_size tokens a step: that size is set each step
to max_prefill_tokens shared by the prompts being prefilled, so a step prefills about that many
in all however many prompts joined. Stop strings, end ids and max_tokens are the runtime's:
the generator is told none of them.

With a prompt cache (prompt_cache.py), a sequence that leaves gives its KV to it, and a prompt
that starts as a kept one did joins with that prefix's KV and prefills only the rest.

A prompt that finds the generator idle runs alone outside it (lone.py) until another joins."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ..runtime.plan import ExecutorTraits, ScheduledSeq, StepOutput, StepPlan
from .lone import LoneStream
from .prompt_cache import PromptCache
from .sampling import make_processor, make_sampler, rows_logprobs

log = logging.getLogger("duet.engines.mlx")


class MLXExecutor:
    # mlx-cuda's step is bound by the host (its Python and kernel launches): the runtime's own
    # per-token work (detokenizing, stop strings, events) runs on a thread beside it.
    traits = ExecutorTraits(answers_late=True, output_thread=True)
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
    min_chunk = 32  # a prompt's fewest tokens a step, however many share the budget
    lone = True  # a prompt joining an idle generator decodes alone (lone.py)

    def __init__(self, model, *, max_batch: int, max_prefill_tokens: int, context_length: int,
                 prompt_cache: PromptCache | None = None):
        from mlx_lm.generate import BatchGenerator

        self._model = model
        self._lone: LoneStream | None = None
        self._gen = BatchGenerator(
            model, max_tokens=context_length, completion_batch_size=max_batch,
            prefill_batch_size=max_batch, prefill_step_size=max_prefill_tokens,
        )
        self._context = context_length
        self._budget = max_prefill_tokens
        self._prefilling: set[int] = set()  # inserted, first token not answered yet
        self._uid: dict[int, int] = {}  # seq id -> the generator's uid
        self._seq: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}  # seq id -> k, for rows that asked for them
        self._held: list[ScheduledSeq] = []  # prompts waiting to join together
        self._held_since = 0.0
        self._last_new = 0.0
        self._widest_gap = 0.0  # between two arrivals of the prompts held (a debug log's)
        self._group = max_batch
        self._cache = prompt_cache
        self._cached: dict[int, int] = {}  # seq id -> prompt tokens joined with cached KV

    def launch(self, plan: StepPlan) -> StepOutput:
        """The whole step: MLX's own lazy evaluation already overlaps the host and the device."""
        self.release(plan.released)
        new = [row for row in plan.prefill
               if row.seq_id not in self._uid and not self._is_lone(row.seq_id)]
        now = time.perf_counter()
        if new:
            if not self._held:
                self._held_since = now
                self._widest_gap = 0.0
            else:
                self._widest_gap = max(self._widest_gap, now - self._last_new)
            self._held += new
            self._last_new = now
        handed = {}
        if self._held and self._joins(bool(new), now):
            if self.lone and not self._uid and self._lone is None and len(self._held) == 1:
                self._start_lone(self._held[0])
            else:
                handed = self._end_lone()
                self._insert(self._held)
            self._held = []
        cached, self._cached = self._cached, {}
        if self._lone is not None:
            return self._lone_step(cached)
        if handed:
            # The generator's next() could answer the handed sequence's next token at once: a
            # step answers one token a sequence, so the generator steps from the next one.
            return StepOutput({seq_id: token for seq_id, (token, _) in handed.items()},
                              {seq_id: lp for seq_id, (_, lp) in handed.items()
                               if lp is not None},
                              cached_tokens=cached, kept_tokens=self._kept())
        kept = self._kept()
        if not self._uid:
            if self._held:  # an idle generator waiting out the quiet window: no busy loop
                time.sleep(min(self.quiet_s / 4, 0.0005))
            return StepOutput({}, cached_tokens=cached, kept_tokens=kept)
        if self._prefilling:
            self._gen.prefill_step_size = max(self.min_chunk,
                                              self._budget // len(self._prefilling))
        _, generated = self._gen.next()
        tokens = {}
        asked = []  # (seq_id, its log-softmax row, its token, its k)
        for r in generated:
            seq_id = self._seq.get(r.uid)
            if seq_id is not None:
                tokens[seq_id] = int(r.token)
                k = self._logprobs.get(seq_id)
                if k is not None:
                    asked.append((seq_id, r.logprobs, tokens[seq_id], k))
                self._prefilling.discard(seq_id)
                if r.finish_reason is not None:  # the generator dropped it already
                    self._forget(seq_id)
        scored = dict(zip((a[0] for a in asked), rows_logprobs([a[1:] for a in asked])))
        return StepOutput(tokens, scored, cached_tokens=cached, kept_tokens=kept)

    @staticmethod
    def collect(output: StepOutput) -> StepOutput:
        return output

    def _is_lone(self, seq_id: int) -> bool:
        return self._lone is not None and self._lone.seq_id == seq_id

    def _start_lone(self, row: ScheduledSeq) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        layers, n = (None, 0) if self._cache is None else self._cache.take(row.tokens)
        if n:
            self._cached[row.seq_id] = n
        self._lone = LoneStream(
            seq_id=row.seq_id, model=self._model,
            cache=layers if layers is not None else make_prompt_cache(self._model),
            unfed=list(row.tokens[n:]), fed=list(row.tokens[:n]),
            sampler=make_sampler(row.sampling, row.draws),
            processors=([] if row.sampling.processing is None
                        else [make_processor(row.sampling.processing, len(row.history[0]))]),
            logprobs=row.sampling.logprobs, prefill_chunk=self._budget,
        )
        self._prefilling.add(row.seq_id)

    def _lone_step(self, cached: dict[int, int]) -> StepOutput:
        lone = self._lone
        got = lone.step()
        if got is None:
            return StepOutput({}, cached_tokens=cached, kept_tokens=self._kept())
        self._prefilling.discard(lone.seq_id)
        token, scored = got
        return StepOutput({lone.seq_id: token},
                          {lone.seq_id: scored} if scored is not None else {},
                          cached_tokens=cached, kept_tokens=self._kept())

    def _kept(self) -> int | None:
        if self._cache is None:
            return None
        self._cache.fit()  # the running sequences grew: kept prefixes give way
        return self._cache.tokens

    def _end_lone(self) -> dict:
        """Hand the lone sequence (if any) to the generator; the token it had picked but not
        answered yet, by seq id."""
        lone, self._lone = self._lone, None
        if lone is None:
            return {}
        picked, state = lone.hand_over()
        (uid,) = self._gen.insert(
            [state.prompt], caches=[state.cache], all_tokens=[state.fed],
            max_tokens=[self._context],
            samplers=[lone.sampler], logits_processors=[lone.processors])
        self._uid[lone.seq_id], self._seq[uid] = uid, lone.seq_id
        if lone.logprobs is not None:
            self._logprobs[lone.seq_id] = lone.logprobs
        if picked is None:
            return {}
        self._prefilling.add(lone.seq_id)  # its next token comes as a prompt's first
        return {lone.seq_id: picked}

    def _forget(self, seq_id: int) -> int:
        """Drop a sequence's bookkeeping; its generator uid."""
        uid = self._uid.pop(seq_id)
        del self._seq[uid]
        self._logprobs.pop(seq_id, None)
        return uid

    def _joins(self, newcomers: bool, now: float) -> bool:
        """Whether the gathered prompts join now. A running generator takes them at the first
        step that brought no newcomer (the burst is over); an idle one, whose steps come
        microseconds apart, once quiet_s passed without one. Either way at a full batch, or
        once the oldest has waited gather_s."""
        if len(self._held) >= self._group or now - self._held_since >= self.gather_s:
            return True
        if self._uid or self._lone is not None:
            return not newcomers
        return now - self._last_new >= self.quiet_s

    def _insert(self, rows: list[ScheduledSeq]) -> None:
        log.debug("%d prompt(s) join a batch of %d after %.1f ms held (widest gap between "
                  "arrivals %.1f ms)", len(rows), len(self._uid),
                  (time.perf_counter() - self._held_since) * 1e3, self._widest_gap * 1e3)
        prompts, caches, known = [], [], []
        for row in rows:
            layers, n = (None, 0) if self._cache is None else self._cache.take(row.tokens)
            prompts.append(list(row.tokens[n:]))
            caches.append(layers)
            known.append(list(row.tokens[:n]))  # the generator extends it: a list of its own
            if n:
                self._cached[row.seq_id] = n
        uids = self._gen.insert(
            prompts, caches=caches, all_tokens=known,
            max_tokens=[self._context for _ in rows],
            # None for a greedy row: the generator's own argmax, which it runs for the whole
            # batch in one call when every row shares it (a sampler per row is called row by
            # row: 0.53x mlx-lm's speed at 32 greedy rows on an H200).
            samplers=[None if row.sampling.greedy else make_sampler(row.sampling, row.draws)
                      for row in rows],
            logits_processors=[
                [] if row.sampling.processing is None
                else [make_processor(row.sampling.processing, len(row.history[0]))]
                for row in rows],
        )
        for row, uid in zip(rows, uids):
            self._uid[row.seq_id], self._seq[uid] = uid, row.seq_id
            if row.sampling.logprobs is not None:
                self._logprobs[row.seq_id] = row.sampling.logprobs
        self._prefilling.update(row.seq_id for row in rows)

    def release(self, seq_ids: Sequence[int]) -> None:
        if self._held and seq_ids:
            gone = set(seq_ids)
            self._held = [row for row in self._held if row.seq_id not in gone]
        self._prefilling.difference_update(seq_ids)
        if self._lone is not None and self._lone.seq_id in seq_ids:
            lone, self._lone = self._lone, None
            if self._cache is not None:
                self._cache.put(*lone.kept())
        uids = [self._forget(s) for s in seq_ids if s in self._uid]
        if not uids:
            return
        if self._cache is None:
            self._gen.remove(uids)
            return
        for layers, tokens in self._gen.remove(uids, return_prompt_caches=True).values():
            self._cache.put(tokens, layers)

    def close(self) -> None:
        self._gen.close()
