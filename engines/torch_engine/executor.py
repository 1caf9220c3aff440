"""The torch engine's step executor: a step's prefill chunks and decode rows through the model
over the paged KV pool, then one sampled token per row that is due one.

Decode rows (one token each) go through one forward; prefill chunks through another, right-
padded to the longest. Every row's sampling settings travel with it, so the batch is sampled
in one call."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base import DeviceOutOfMemory
from ..runtime.plan import ExecutorTraits, ScheduledSeq, StepOutput, StepPlan
from . import trace_guard
from .paged import PagedKV, build_batch
from .processing import RowProcessor, StepProcessing
from .sampling import (Sampler, ScoredRows, sample_rows, score_tokens, scores_table,
                       token_logprobs)
from .transfer import ReadBack


def prefill_attention(device: str):
    """Which SDPA kernels a prefill may use. On CUDA not cuDNN's: it builds a plan for every
    new shape (measured on an H200: a 128-token prompt's first token took 780 ms, 150-200 ms
    once the shape was known), and prompt lengths change with every request."""
    if not device.startswith("cuda"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def out_of_memory(exc: torch.OutOfMemoryError) -> DeviceOutOfMemory:
    """The step's requests fail with what ran out, in a line (torch's message goes on with
    allocator advice meant for the server's operator, who finds it in the log)."""
    first = str(exc).split(". ", 2)
    return DeviceOutOfMemory(
        f"the device ran out of memory running this request's step ({'. '.join(first[:2])}); "
        "the server goes on: retry, or serve with a smaller --max-batch or KV cache")


@dataclass
class Launched:
    """A launched step, as collect() reads it: its sampled rows, its prompts' scores, and once
    drawn, its tokens on their way to the host (ReadBack) and its log-probabilities; until
    then, its processing under way (RowProcessor.begin)."""

    due: Sequence[ScheduledSeq]
    prompt_scores: dict
    processing: StepProcessing | None = None
    pending: list[int] | tuple[torch.Tensor, torch.cuda.Event] | None = None
    scored: ScoredRows | None = None


class TorchExecutor:
    def __init__(self, model, kv: PagedKV, device: str, decoder=None, ranks=None, interim=None):
        self.model, self.kv, self.device = model, kv, device
        # Under tensor parallelism (ranks.py): the other ranks, told each step before it runs.
        self.ranks = ranks
        self.window = model.args.sliding_window
        self.on_logits = None  # f(rows, logits): a check's look at what each row was scored
        self._last: tuple[torch.Tensor, dict[int, int]] | None = None  # picks, seq id -> index
        self._last_read = None  # the same picks on their way to the host (ReadBack.start)
        self._deferred: Launched | None = None  # a step whose draw waits for its masks
        self._told = False  # this step's plan went to the other ranks (tensor parallelism)
        self._readback = ReadBack(device)
        self._processor = RowProcessor(model.args.vocab_size, device)
        # Decoders whose graphs are captured beside the steps, in the order they come (the
        # interim one's graphs of eager ops, then the compiled one's): each taken at the first
        # launch after its graphs all are (cuda_graphs.GraphDecoder.warm_up_beside); eager
        # till the first.
        self._coming = [d for d in (interim, decoder)
                        if d is not None and d.capturing is not None]
        self._use(None if self._coming else decoder)
        self._take_coming()

    def _use(self, decoder) -> None:
        """Decode through decoder's CUDA graphs (None: eagerly). With graphs the step is
        pipelined: launched before the last one is read back, its decode rows' PENDING tokens
        taken on the device from the last step's picks. The runtime turns pipelined at its next
        step when the executor does (Runtime.step)."""
        self.decoder = decoder
        self.pipelined = decoder is not None
        self.traits = ExecutorTraits(pipelined=self.pipelined, scores_prompts=True,
                                     processes_in_flight=True, reuses_kv_blocks=True)
        graphed = decoder is not None and decoder.head
        self._sampler = decoder.sampler if graphed else Sampler()
        self._scorer = decoder.scorer if graphed else scores_table

    def _take_coming(self) -> None:
        """Decode through the last coming decoder whose graphs are all captured (those before
        it are dropped, their memory freed with them); one whose graphs never will be is
        passed over, and the steps go on as they were."""
        done = [d for d in self._coming if d.capturing.done()]
        if not done:
            return
        # By `done`, not asking again: one that finishes in between comes next launch.
        self._coming = [d for d in self._coming if d not in done]
        ready = [d for d in done if d.capturing.exception() is None]
        if ready:
            self._use(ready[-1])

    def launch(self, plan: StepPlan):
        """Queue the step's work on the device; collect() reads its tokens."""
        self._told = False
        try:
            return self._launch(plan)
        except Exception as exc:  # under tensor parallelism: gloo's when a rank is gone, or ours
            if self.ranks is not None:
                raise self.ranks.failed(exc, self._told) from exc
            if isinstance(exc, torch.OutOfMemoryError):
                raise out_of_memory(exc) from exc
            raise

    def _launch(self, plan: StepPlan):
        self._settle()  # the last step's picks, which this step's PENDING rows read
        # After the draw above, with the sampler it was launched for. Nothing of the decoder
        # given up is replayed again, so the last step's outputs (its picks, scores, logits)
        # stay where the next step and the read-back find them.
        self._take_coming()
        self._processor.release(plan.released)
        if self.ranks is not None:
            self.ranks.step(plan.prefill, plan.decode, share=self.pipelined)
            self._told = True
        with torch.inference_mode():
            logits, greedy, due = [], [], []
            prompt_scores: dict = {}
            for rows in (plan.prefill, plan.decode):
                if not rows:
                    continue
                if rows is plan.decode and self.decoder is not None:
                    out, picks = self.decoder.run(rows, self._last)
                else:
                    out = self._forward(rows, prompt_scores, decode=rows is plan.decode)
                    picks = None
                keep = [i for i, r in enumerate(rows) if r.sample]
                if keep:
                    whole = len(keep) == len(rows)
                    logits.append(out if whole else out[keep])
                    greedy.append(picks if picks is None or whole else picks[keep])
                    due += [rows[i] for i in keep]
            if not due:
                return Launched((), prompt_scores)
            if self.on_logits is not None:
                self.on_logits(due, torch.cat(logits))
            processed = any(r.sampling.processing is not None for r in due)
            if all(r.sampling.greedy for r in due) and not processed:
                if len(greedy) == 1 and greedy[0] is not None and self.ranks is None:
                    # The graph's own picks, no copy: everything that reads them (the
                    # read-back, the next step, the scores) is queued before its next replay.
                    # A tensor-parallel step's go to the other ranks by NCCL too, on a stream of
                    # its own, so they are copied.
                    tokens = greedy[0]
                else:
                    tokens = torch.cat([torch.argmax(x, dim=-1) if g is None else g
                                        for x, g in zip(logits, greedy)])
                scored = any(r.sampling.logprobs is not None for r in due)
                whole = (torch.cat(logits) if len(logits) > 1 else logits[0]) if scored else None
                return self._sampled(Launched(due, prompt_scores), tokens, whole)
            # The graphs' greedy picks were made before any processing: picked anew. Pipelined
            # (no tensor parallelism, whose ranks take the picks at once), the grammar masks are
            # computed on a worker while the runtime reads back and hands out the last step, and
            # the draw waits for them at the start of the next launch (or this step's collect).
            step = self._processor.begin(
                torch.cat(logits) if len(logits) > 1 else logits[0], due, self._in_flight,
                overlap=self.pipelined and self.ranks is None)
            launched = Launched(due, prompt_scores, step)
            if step.masks is None:
                self._draw(launched)
            else:
                self._deferred = launched
            return launched

    def _draw(self, launched: Launched) -> None:
        """The processed step's tokens: its masks applied, its rows drawn."""
        whole, counted = self._processor.finish(launched.processing)
        launched.processing = None
        tokens = sample_rows(whole, launched.due, self._sampler)
        self._processor.count(counted, tokens)
        self._sampled(launched, tokens, whole)

    def _settle(self) -> None:
        """Draw the step whose masks were computing, if one is."""
        launched, self._deferred = self._deferred, None
        if launched is not None:
            with torch.inference_mode():
                self._draw(launched)

    def _sampled(self, launched: Launched, tokens: torch.Tensor,
                 whole: torch.Tensor | None) -> Launched:
        """The step's tokens on their way to the host, the log-probabilities its rows asked
        for (from whole, the logits they were drawn from), and, pipelined, where the next
        step's PENDING rows find their tokens."""
        due = launched.due
        if any(r.sampling.logprobs is not None for r in due):
            launched.scored = token_logprobs(whole, tokens, due, self._scorer)
        if self.ranks is not None and self.pipelined:
            self.model.token_share.send(tokens)  # the ranks' next step takes its PENDING tokens
        launched.pending = self._readback.start(tokens)
        if self.pipelined:
            self._last = (tokens, {r.seq_id: i for i, r in enumerate(due)})
            self._last_read = launched.pending
        return launched

    def _in_flight(self, seq_id: int) -> int:
        """The token the last step sampled for seq_id, on the host: a grammar's matcher needs
        it for this step's mask. Waits for that step alone; this step's forward is queued by
        then, so the device works while the host reads the token and computes the mask."""
        if not isinstance(self._last_read, list):
            self._last_read = self._readback.finish(self._last_read)
        return self._last_read[self._last[1][seq_id]]

    def collect(self, handle: Launched) -> StepOutput:
        try:
            return self._collect(handle)
        except torch.OutOfMemoryError as exc:  # the deferred draw's, or the scores' read-back
            raise out_of_memory(exc) from exc

    def _collect(self, handle: Launched) -> StepOutput:
        if not handle.due:
            return StepOutput({}, prompt_logprobs=handle.prompt_scores)
        if handle is self._deferred:  # no step launched since to draw it
            self._settle()
        tokens = dict(zip((r.seq_id for r in handle.due),
                          self._readback.finish(handle.pending)))
        scored = handle.scored.read() if handle.scored is not None else {}
        return StepOutput(tokens, scored, handle.prompt_scores)

    def _forward(self, rows: Sequence[ScheduledSeq], prompt_scores: dict,
                 decode: bool = False) -> torch.Tensor:
        """The rows' last positions' logits; a scored prompt chunk's positions are scored into
        prompt_scores (seq id -> (first position scored, scores))."""
        batch = build_batch(rows, self.kv, self.model.max_len, self.window, self.device)
        if decode and self._coming:
            batch = self._coming[-1].bucketed(batch)
        # Modules run here, beside a compile's traces on another thread (trace_guard).
        with trace_guard.eager(), prefill_attention(self.device):
            if not any(r.score_next for r in rows):
                return self.model.forward_paged(batch, self.kv)
            x = self.model.hidden_paged(batch, self.kv)
            for i, row in enumerate(rows):
                if row.score_next:
                    logits = self.model.head(x[i, : len(row.score_next)])
                    prompt_scores[row.seq_id] = (row.start + 1, score_tokens(
                        logits, row.score_next, row.sampling.prompt_logprobs))
            return self.model.head(x[torch.arange(x.shape[0], device=x.device), batch.last])

    def release(self, seq_ids) -> None:
        self._processor.release(seq_ids)  # the penalties' counts; a row carries the rest

    def close(self) -> None:
        if self._deferred is not None and self._deferred.processing is not None:
            self._deferred.processing.masks.wait()  # llguidance writes into its buffer
        self._last, self._deferred = None, None
        self._processor.close()
        self._processor = RowProcessor(self.model.args.vocab_size, self.device)
