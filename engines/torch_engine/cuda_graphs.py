"""CUDA: the batch's decode step replayed as CUDA graphs, one per (batch bucket, attention
bucket), captured at load.

A step of n decode rows runs the graph of the smallest batch bucket that holds n (powers of
two up to --max-batch; the rows past n are padding that writes to the pool's trash slot) and
of the smallest attention bucket that holds the longest row (powers of two from 256 up to the
context). The graph reads every input (token, position, write slot, block table) from one
device buffer, filled by a single host-to-device copy per step: a step's host work is that copy
and a replay. Attention and the MLP's activation run through the Triton kernels of
decode_attention.py and silu_mul.py; greedy picks are made inside the graph. Inductor's
compiled step and its tuned kernels are cached across starts (configure_inductor)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

import torch

from ..beside import run_beside
from ..runtime.plan import PENDING, ScheduledSeq
from . import nucleus_kernel
from .decode_attention import dependent_launch_wanted
from .paged import PagedBatch, PagedKV
from .sampling import Sampler, argmax_in_chunks, scores_table

log = logging.getLogger("duet.engines.torch")

MIN_ATTENTION = 256
# While graphs are compiled and captured beside the serving thread, the GIL changes hands at
# least this often (beside.run_beside): each eager op of a step waits up to it for the GIL back.
CAPTURE_SWITCH_INTERVAL_S = 1e-4


def interim_wanted() -> bool:
    """Whether a load whose decode step is compiled serves through graphs of eager ops while
    that step is made (by default; DUET_INTERIM_GRAPHS=0 keeps the eager steps). Measured on an
    H100 (2026-11-27, 1B shape, a stream through each start, one cache): on warm starts the
    stream ran at 340-435 tok/s while compiling against 16-37 with eager steps, its longest
    pause 311-342 ms against 448-531, and the compiled step came as soon (33.8 s against 35.7
    once no tuning was left); a cold start compiled in 169 s (112-184 s without, other
    machines)."""
    return os.environ.get("DUET_INTERIM_GRAPHS", "1") != "0"
# Columns of the input buffer before a row's block table. SOURCE: where a PENDING token is in
# the last step's picks (-1: the token is in TOKEN).
TOKEN, POSITION, WRITE, SOURCE, TABLE = 0, 1, 2, 3, 4


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [1]
    while buckets[-1] < max_batch:
        buckets.append(min(buckets[-1] * 2, max_batch))
    return buckets


def attention_buckets(max_len: int) -> list[int]:
    buckets = [min(MIN_ATTENTION, max_len)]
    while buckets[-1] < max_len:
        buckets.append(min(buckets[-1] * 2, max_len))
    return buckets


def smallest(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


def configure_inductor() -> None:
    """Inductor's settings for the decode step (process-wide, as in gpt-fast: they must hold
    when a kernel first launches, after torch.compile's options have lapsed)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    from ..models.sources import cache_root

    # Coordinate-descent tuning of the generated kernels: for small-batch matrix products the
    # tuned Triton reductions beat cuBLAS's small-M GEMMs (measured on an H200 at batch 1:
    # 1.34 -> 1.16 ms a step for llama-3.2-1b).
    inductor_config.coordinate_descent_tuning = True
    # Programmatic dependent launch on Hopper and later (Inductor checks the GPU), opt-in with
    # DUET_PDL=1: each kernel's programs placed while the one before finishes, as duet's own
    # kernels then are (decode_attention.dependent_launch says why, and why opt-in).
    if hasattr(inductor_config.triton, "enable_pdl"):
        inductor_config.triton.enable_pdl = dependent_launch_wanted()
    # Kernels loaded by the static launcher ignore the tuning kept in Inductor's cache before
    # torch 2.12 (pytorch#172819), and every start tuned again (27 s of a 60 s warm start, 1B
    # shape, H100). Its gain is launch overhead, and the step is replayed as CUDA graphs.
    inductor_config.use_static_cuda_launcher = False
    # Float attributes (norm epsilons) kept as constants: as symbols they made Dynamo restart
    # its analysis halfway through each compile (19 s of that start).
    dynamo_config.specialize_float = True
    # Compiled kernels and their tuning kept where duet keeps its models rather than in /tmp,
    # which a reboot empties; Inductor's keys hold the graph, shapes, torch version and device.
    # A TORCHINDUCTOR_CACHE_DIR of the user's own wins.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def compile_summary() -> str:
    """What this process's compiles took from Inductor's cache, for the start-up log."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (f"compiled: {inductor['fxgraph_cache_hit']} graphs from Inductor's cache, "
            f"{inductor['fxgraph_cache_miss']} compiled anew, "
            f"{inductor['coordesc_tuning_bench']} tuning runs")


class CudaGraphs:
    """Captures a step as a CUDA graph and hands back its replay. The graphs share one memory
    pool, since only one runs at a time and its outputs are read before the next. (Tests stand
    in a fake that re-runs the step, so the host bookkeeping is exercised on the CPU.)

    Every capture is made on one stream that runs nothing else (the capture stream), and every
    warm-up run on another (the warm-up stream). Why: a captured GEMM keeps the cuBLAS
    workspace of the capturing thread's handle and the capturing stream (PyTorch keys its
    workspaces by both), and a thread that ends hands its handle to the next thread that asks.
    Capturing on a fresh pool stream each time, warm-ups included, a compiled decoder's thread
    (handed the interim decoder's handle) ran its warm-ups and Inductor's tuning on pool streams
    that interim graphs had been captured on, while the serving thread replayed those graphs:
    two GEMMs at once on one workspace, whose split-K semaphores then never came right. The GPU
    spun at 100% on a step that never ended (4 of 8 first starts with a stream, H100,
    2026-11-27; docs/benchmarks.md)."""

    def __init__(self) -> None:
        self._pool = None
        # Captures made on a thread beside the steps the engine serves meanwhile
        # (GraphDecoder.warm_up_beside), not while everything waits for them.
        self.beside = False
        self._streams: tuple | None = None  # (warm-up, capture), made at the first capture

    def capture(self, step: Callable[[], tuple]) -> tuple[Callable[[], None], tuple]:
        """Run step a few times (let the allocator and Triton's autotuning settle), then
        capture it once. Returns the replay and the step's outputs, which every replay
        overwrites."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        warm, capturing = self._streams
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(3):
                step()
        capturing.wait_stream(warm)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        if not self.beside:
            with torch.cuda.graph(graph, pool=self._pool, stream=capturing):
                out = step()
        else:
            # Thread-local, with no device-wide synchronize or cache emptying
            # (torch.cuda.graph's): the eager steps another thread launches meanwhile are no
            # part of the capture, and their calls do not break it.
            with torch.cuda.stream(capturing):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = step()
                finally:
                    graph.capture_end()
        self._pool = graph.pool()
        return graph.replay, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class CaptureAbandoned(RuntimeError):
    """The decoder was closed while its graphs were being captured beside eager steps."""


class GraphDecoder:
    def __init__(self, model, kv: PagedKV, device: str, max_batch: int,
                 graphs: CudaGraphs | None = None, kernels: bool = True,
                 backend: str | None = None, head: bool = True):
        self.model, self.kv, self.device = model, kv, device
        # False for a tensor-parallel rank other than 0: it samples nothing, so its step ends
        # at the last layer's hidden states (the vocabulary projection is a large read), or
        # at its share of the logits, sent to rank 0, under a split projection.
        self.head = head
        self.page = kv.block_size
        self.batches = batch_buckets(max_batch)
        self.lengths = attention_buckets(model.max_len)
        self.pages = -(-model.max_len // self.page)
        # One spare column, never read: a step's inputs are then never the buffer's whole
        # width, so they are never contiguous, and the compiled step stays one graph for every
        # attention bucket (Dynamo guards a contiguous slice apart, which cost a third compile,
        # 12-49 s of every start on an H100).
        width = TABLE + self.pages + 1
        self.inputs = torch.zeros(max_batch, width, dtype=torch.long, device=device)
        self.inputs[:, WRITE] = kv.trash  # until rows arrive, any write lands in the trash
        # Two pinned host buffers, filled through numpy, that take turns: a step's copy to the
        # device is asynchronous, and the next step is filled before it has surely run (the
        # runtime reads step N back only after launching N+1); N+2 reuses N's buffer after.
        self._hosts = [torch.zeros(max_batch, width, dtype=torch.long,
                                   pin_memory=device.startswith("cuda")) for _ in range(2)]
        self._turn = 0
        self._last = torch.zeros(max_batch, dtype=torch.long, device=device)
        # The last step's picks, where the step finds a PENDING row's token (at its SOURCE):
        # copied in before each replay, and only read inside the step, so a capture's warm-up
        # runs leave them as they were. (The rows' tokens were put together by four small
        # kernels and a copy between the steps, each a launch and a gap on the device.)
        self._picks = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.graphs = graphs or CudaGraphs()
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], tuple]] = {}
        from . import decode_attention

        # Triton's kernels need the GPU (the CPU stands in for it only in tests).
        self.kernels = kernels and device.startswith("cuda") and decode_attention.available()
        model.use_kernels(attention=self.kernels, activation=self.kernels, rows=max_batch)
        # The kernel's merge counters for the graphs' rows, apart from those of the eager steps
        # that may run while the graphs are captured (warm_up_beside).
        attn = model.model.layers[0].self_attn
        self.counters = (torch.zeros(max_batch * attn.n_kv, dtype=torch.int32, device=device)
                         if self.kernels else None)
        # Set by warm_up_beside: done once every graph is captured (or with why none will be).
        self.capturing: Future | None = None
        self._abandoned = threading.Event()
        self.compiled = backend is not None
        # The executor's, compiled when the step is.
        self.sampler = GraphSampler(backend, self.graphs, max_batch, model.args.vocab_size,
                                    device) if head else None
        self.scorer = GraphScorer(self.graphs, max_batch, model.args.vocab_size,
                                  device) if head else None
        self._fn = self._step_impl
        if backend is not None:
            if backend == "inductor":
                configure_inductor()
            # dynamic: one compiled graph serves every batch of 2 or more and every attention
            # bucket; a batch of 1 gets its own (Dynamo specializes sizes of 1), whose kernels
            # are tuned for one row.
            self._fn = torch.compile(self._step_impl, dynamic=True, fullgraph=True,
                                     backend=backend)

    def _step_impl(self, x: torch.Tensor, last: torch.Tensor, kv_len: int, one_row: bool):
        source = x[:, SOURCE]
        tokens = torch.where(source >= 0, self._picks[source.clamp(min=0)], x[:, TOKEN])
        batch = PagedBatch(
            tokens=tokens[:, None], positions=x[:, POSITION : POSITION + 1],
            write_slots=x[:, WRITE], last=last, table=x[:, TABLE:], kv_len=kv_len,
            page=self.page, trash=self.kv.trash, window=self.model.args.sliding_window,
            counters=self.counters,
        )
        split = self.model.vocab_split
        if split is not None:  # tensor parallel: every rank projects its share
            hidden = self.model.last_hidden(batch, self.kv)
            logits = split(self.model.model.norm(hidden))
            if not self.head:
                return logits, hidden[:, 0]
        elif not self.head:
            hidden = self.model.hidden_paged(batch, self.kv)[:, 0]
            return hidden, hidden[:, 0]
        else:
            logits = self.model.forward_paged(batch, self.kv)
        # ATen's argmax over one row of a 128k vocabulary runs in one thread block (29 us on
        # an H200): a lone row takes the two-stage pick.
        greedy = argmax_in_chunks(logits[0]) if one_row else torch.argmax(logits, dim=-1)
        return logits, greedy

    def _step(self, b: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inputs[:b, : TABLE + -(-kv_len // self.page)]
        return self._fn(x, self._last[:b], kv_len, b == 1)

    def _capture(self, b: int, kv_len: int):
        with torch.inference_mode():
            captured = self.graphs.capture(lambda: self._step(b, kv_len))
        self._graphs[(b, kv_len)] = captured
        return captured

    def compile_kernels(self) -> None:
        """The decode-attention kernel compiled now for every attention bucket (one N_SPLITS
        each), through a one-row eager step of each that writes only the trash slot: before
        any request is served, where each was compiled in the serving thread the first time a
        step reached its bucket (on a cold start; a warm one finds them in Triton's cache)."""
        if not self.kernels:
            return
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        trash = torch.full_like(zero[0], self.kv.trash)
        with torch.inference_mode():
            for kv_len in self.lengths:
                table = torch.zeros(1, -(-kv_len // self.page), dtype=torch.long,
                                    device=self.device)
                batch = PagedBatch(
                    tokens=zero, positions=zero, write_slots=trash, last=zero[0], table=table,
                    kv_len=kv_len, page=self.page, trash=self.kv.trash,
                    window=self.model.args.sliding_window)
                self.model.forward_paged(batch, self.kv)

    def bucketed(self, batch: PagedBatch) -> PagedBatch:
        """An eager decode batch as the graphs shape theirs: its length at its attention bucket
        and its block table that many pages wide (zeros past the rows' pages, which the
        kernel's masked loads never read). Triton compiles the decode kernel for each number of
        64-position slices and each kind of table stride: eager steps of every length compiled
        it anew as a stream grew, 4 s of a stream's 18 s of eager steps while the graphs were
        captured (H100, 2026-11-27)."""
        kv_len = smallest(self.lengths, batch.kv_len)
        pages = -(-kv_len // self.page)
        table = torch.nn.functional.pad(batch.table, (0, pages - batch.table.shape[1]))
        return dataclasses.replace(batch, kv_len=kv_len, table=table)

    def run(self, rows: Sequence[ScheduledSeq], last=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and greedy ids [n] of n decode rows (views into the graph's outputs:
        read them before the next step). last: (picks, seq id -> index) of the step before,
        where rows whose token is PENDING find it."""
        n = len(rows)
        b = smallest(self.batches, n)
        kv_len = smallest(self.lengths, max(r.end for r in rows))
        width = TABLE + -(-kv_len // self.page)
        host_t = self._hosts[self._turn]
        self._turn ^= 1
        host = host_t.numpy()
        host[:b, :width] = 0
        host[n:b, WRITE] = self.kv.trash
        host[n:b, SOURCE] = -1
        pending = False
        for i, r in enumerate(rows):
            pos, token, source = r.start, r.tokens[0], -1
            if token == PENDING:
                token, source, pending = 0, last[1][r.seq_id], True
            blocks = r.blocks[: width - TABLE]
            slot = blocks[pos // self.page] * self.page + pos % self.page
            host[i, :TABLE] = (token, pos, slot, source)
            host[i, TABLE : TABLE + len(blocks)] = blocks
        self.inputs[:b, :width].copy_(host_t[:b, :width], non_blocking=True)
        if pending:
            self._picks[: last[0].numel()].copy_(last[0])
        replay, (logits, greedy) = self._graphs.get((b, kv_len)) or self._capture(b, kv_len)
        replay()
        return logits[:n], greedy[:n]

    def warm_up(self) -> None:
        """Capture every bucket now: a batch crossing a bucket must not stall on it."""
        started = time.perf_counter()
        for b in self.batches:
            for kv_len in self.lengths:
                if (b, kv_len) not in self._graphs:
                    self._check_abandoned()
                    self._capture(b, kv_len)
        if self.sampler is not None:
            self._check_abandoned()
            self.sampler.warm_up()
            self.scorer.warm_up()
        self.graphs.synchronize()
        log.info(
            "captured %d decode graphs (batches %s, attention buckets %s, %s attention, %s) in "
            "%.1fs", len(self._graphs), self.batches, self.lengths,
            "Triton kernel" if self.kernels else "PyTorch-op",
            compile_summary() if self.compiled else "eager ops", time.perf_counter() - started,
        )

    def warm_up_beside(self, after: Future | None = None) -> Future:
        """warm_up() on a thread of its own, while the engine serves with eager steps: the
        compile and the captures were most of a warm start (18 of 32 s, 1B shape, H100). The
        executor takes the graphs at the first step after they are all captured
        (TorchExecutor). The future (also self.capturing) is done then, or holds why they
        never will be: the engine then decodes eagerly on (or through graphs taken before).
        after: another decoder's capture, which this one waits for (whatever its outcome)
        before it starts, not to compete with it."""
        self.graphs.beside = True
        cuda = self.device.startswith("cuda")

        def capture() -> None:
            if after is not None:
                wait([after])
                self._check_abandoned()
            try:
                # A stream of the thread's own: the eager steps' stream never waits on the
                # captures' warm-up runs.
                with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
                    self.warm_up()
            except CaptureAbandoned:
                raise
            except BaseException:
                log.warning("the decode graphs could not be captured; decoding stays eager",
                            exc_info=True)
                raise

        self.capturing = run_beside(capture, "duet-capture", CAPTURE_SWITCH_INTERVAL_S)
        return self.capturing

    def stop(self) -> None:
        """Tell a capture under way to stop between two graphs (abandon() also waits)."""
        self._abandoned.set()

    def abandon(self) -> None:
        """Stop a capture under way (between two graphs) and wait for its thread: the engine
        is closing, and its memory must be free when this returns."""
        self.stop()
        if self.capturing is not None:
            with contextlib.suppress(BaseException):
                self.capturing.result()

    def _check_abandoned(self) -> None:
        if self._abandoned.is_set():
            raise CaptureAbandoned("the engine closed while its decode graphs were captured")


SAMPLER_GRAPH_ROWS = 64


class BucketGraphs:
    """A small step after the decode step (a draw, the tokens' scores) replayed as CUDA graphs,
    one per batch bucket and per variant, captured on first use or at warm_up(). A subclass
    keeps the graphs' inputs in buffers of the largest bucket's rows and says what a bucket's
    step is (_step)."""

    variants: tuple = ()

    def __init__(self, graphs: CudaGraphs, buckets: list[int]):
        self.graphs, self.buckets = graphs, buckets
        self._graphs: dict[tuple[int, object], tuple[Callable[[], None], tuple]] = {}

    def _step(self, b: int, variant) -> tuple:
        raise NotImplementedError

    def replay(self, b: int, variant) -> tuple:
        """Bucket b's graph of this variant run; its outputs, which the next replay
        overwrites."""
        replay, out = self._graphs.get((b, variant)) or self._capture(b, variant)
        replay()
        return out

    def _capture(self, b: int, variant):
        with torch.inference_mode():
            captured = self.graphs.capture(lambda: self._step(b, variant))
        self._graphs[(b, variant)] = captured
        return captured

    def warm_up(self) -> None:
        for b in self.buckets:
            for variant in self.variants:
                if (b, variant) not in self._graphs:
                    self._capture(b, variant)


class GraphSampler(BucketGraphs):
    """The sampler replayed as CUDA graphs, one per batch bucket (2 rows up to
    SAMPLER_GRAPH_ROWS) and per whether rows have a nucleus (top_k, top_p).
    Launched op by op, a draw's host work is 20-odd kernel launches (0.2 ms a step, 0.7 ms
    with top_p, measured on an H100), more than the decode step's replay; as a graph it is one
    launch and three copies in. Larger batches draw through the sampler directly."""

    variants = (False, True)  # ranked: whether rows have a nucleus

    def __init__(self, backend: str | None, graphs: CudaGraphs, max_batch: int, vocab: int,
                 device: str):
        # From 2: a lone row is drawn beside a padding row, in the graphs every batch shares.
        super().__init__(graphs, batch_buckets(max(2, min(max_batch, SAMPLER_GRAPH_ROWS)))[1:])
        # No host reads in a graph; each row's nucleus border searched for, not sorted out,
        # on a GPU with Triton (nucleus_kernel).
        searched = device.startswith("cuda") and nucleus_kernel.available()
        self.sampler = Sampler(backend, captured=True,
                               borders=nucleus_kernel.borders if searched else None)
        self.vocab = vocab
        rows = self.buckets[-1]
        # The graphs' inputs; a padding row keeps the last settings it had, always valid.
        # Inference tensors, as the executor's are: Dynamo would compile them apart.
        with torch.inference_mode():
            self.logits = torch.zeros(rows, vocab, device=device)
            self.floats = torch.tensor([[1.0, -math.inf, 1.0]] * rows, device=device)
            self.ints = torch.tensor([[0, 0, vocab]] * rows, device=device)

    def __call__(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                 ranked: int) -> torch.Tensor:
        n = logits.shape[0]
        if n > self.buckets[-1]:
            return self.sampler(logits, floats, ints, ranked)
        self.logits[:n].copy_(logits)
        self.floats[:n].copy_(floats)
        self.ints[:n].copy_(ints)
        (tokens,) = self.replay(smallest(self.buckets, n), ranked > 0)
        return tokens[:n].clone()  # the next replay overwrites the graph's output

    def _step(self, b: int, ranked: bool) -> tuple:
        # Ranked, every row's border is found over its whole vocabulary: one graph serves
        # every top_k and top_p.
        width = self.vocab if ranked else 0
        return (self.sampler(self.logits[:b], self.floats[:b], self.ints[:b], width),)


class GraphScorer(BucketGraphs):
    """Token log-probabilities (sampling.scores_table) replayed as CUDA graphs, one per batch
    bucket up to SAMPLER_GRAPH_ROWS and per bucket of alternatives (variants: a row reads its
    own first k). Launched op by op, scoring 64 rows of a 49k vocabulary cost a step 0.3-0.7
    ms more host time than plain decoding (two H100 hosts; under cProfile torch.topk's launch
    alone took about 0.15 ms), a fifth or more of a 1B model's step; as a graph it is one launch
    and two copies in (the step's launch 1.08 -> 0.52 ms). Larger batches score directly."""

    variants = (5, 20)  # completions ask for at most 5 alternatives, chat for at most 20

    def __init__(self, graphs: CudaGraphs, max_batch: int, vocab: int, device: str):
        super().__init__(graphs, batch_buckets(min(max_batch, SAMPLER_GRAPH_ROWS)))
        rows = self.buckets[-1]
        with torch.inference_mode():  # as the executor's tensors are
            self.logits = torch.zeros(rows, vocab, device=device)
            self.tokens = torch.zeros(rows, dtype=torch.long, device=device)

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        n = logits.shape[0]
        top = next((t for t in self.variants if t >= k), None)
        if n > self.buckets[-1] or top is None:
            return scores_table(logits, tokens, k)
        self.logits[:n].copy_(logits)
        self.tokens[:n].copy_(tokens)
        (table,) = self.replay(smallest(self.buckets, n), top)
        return table[:n].clone()  # the next replay overwrites the graph's output

    def _step(self, b: int, top: int) -> tuple:
        return (scores_table(self.logits[:b], self.tokens[:b], top),)
