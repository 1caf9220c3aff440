"""How the model is stepped: eagerly over the filled cache prefix, or with static shapes that
torch.compile fuses and (on CUDA) replays as CUDA graphs.

Methods enter inference mode in their bodies rather than through a decorator: mutmut leaves
decorated functions unmutated, and these are the ones mutation testing must reach."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .model import Transformer
from .sampling import argmax_in_chunks

log = logging.getLogger("duet.engines.torch")

MIN_BUCKET = 16
MIN_DECODE_BUCKET = 256


def prefill_bucket(n: int, max_len: int) -> int:
    """Prompt lengths are padded up to a power of two so few shapes ever reach the compiler."""
    bucket = MIN_BUCKET
    while bucket < n:
        bucket *= 2
    return min(bucket, max_len)


def decode_bucket(n: int, max_len: int) -> int:
    """How many cache slots a decode step attends over when n are filled: a power of two, so
    a short conversation does not pay for reading (and masking) the whole context's cache."""
    return prefill_bucket(max(n, MIN_DECODE_BUCKET), max_len)


def decode_buckets(max_len: int) -> list[int]:
    buckets = [decode_bucket(1, max_len)]
    while buckets[-1] < max_len:
        buckets.append(decode_bucket(buckets[-1] + 1, max_len))
    return buckets


class Runner:
    def decode(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        raise NotImplementedError

    def decode_greedy(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """The next token [1] when decoding greedily (the same choice as the greedy sampler)."""
        return torch.argmax(self.decode(token, pos), dim=-1, keepdim=True)


class EagerRunner(Runner):
    """CPU and MPS: no compiler; attention reads only the filled part of the cache."""

    compiled = False

    def __init__(self, model: Transformer, device: str):
        self.model, self.device = model, device

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            return self.model(tokens, 0, last_only=True)[0, -1]

    def decode(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(token.view(1, 1), pos)[0, -1]

    def warm_up(self) -> None:
        pass


class StaticRunner(Runner):
    """Static shapes: the decode step always sees a [1, 1] token and the whole cache.

    With compile=True the decode step goes through torch.compile (mode reduce-overhead, which
    on CUDA captures it as a CUDA graph and replays it) and the prefill through a dynamic-shape
    compile fed only bucketed lengths. The decode position lives on the device, so stepping
    needs no host-to-device copy."""

    def __init__(self, model: Transformer, device: str, compile: bool):
        self.model, self.device, self.compiled = model, device, compile
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        decode, prefill = self._decode_impl, self._prefill_impl
        if compile:
            # dynamic: one compiled graph serves every decode bucket and prefill length.
            decode = torch.compile(decode, dynamic=True, fullgraph=True)
            prefill = torch.compile(prefill, dynamic=True, fullgraph=True)
        self._decode_fn, self._prefill_fn = decode, prefill

    def _decode_impl(self, token: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        return self.model(token, pos, kv_len=kv_len)[0, -1]

    def _prefill_impl(self, tokens, positions, last) -> torch.Tensor:
        # Prefill starts at slot 0, so nothing past the padded prompt is ever attended to.
        return self.model(tokens, positions, logits_at=last, kv_len=tokens.shape[1])[0, -1]

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            n = len(prompt_ids)
            bucket = prefill_bucket(n, self.model.max_len)
            padded = list(prompt_ids) + [0] * (bucket - n)
            # Padding writes junk K/V past the prompt; decode overwrites each slot before any
            # query may attend to it, and the mask hides the rest.
            tokens = torch.tensor([padded], dtype=torch.long, device=self.device)
            positions = torch.arange(bucket, device=self.device)
            last = torch.tensor([n - 1], device=self.device)
            logits = self._prefill_fn(tokens, positions, last)
            self._pos.fill_(n)
            return logits

    def decode(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        with torch.inference_mode():
            # The position lives on the device; the host's copy only picks the attention bucket.
            kv_len = decode_bucket(pos + 1, self.model.max_len)
            logits = self._decode_fn(token.view(1, 1), self._pos, kv_len)
            self._pos.add_(1)
            return logits

    def warm_up(self, max_prompt: int = 1024) -> None:
        """Compile (and capture) now, so the first request pays nothing; log how long."""
        started = time.perf_counter()
        for n in (MIN_BUCKET, min(max_prompt, self.model.max_len - 4)):
            logits = self.prefill([1] * n)
            token = torch.argmax(logits).view(1)
            for pos in range(n, n + 3):
                token = torch.argmax(self.decode(token, pos)).view(1)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        log.info("compiled decode and prefill in %.1fs", time.perf_counter() - started)


class CudaGraphs:
    """Captures a step as a CUDA graph and hands back its replay. The graphs share one memory
    pool, since only one runs at a time. (Tests stand in a fake that re-runs the step, so the
    runner's host bookkeeping is exercised on the CPU.)"""

    def __init__(self) -> None:
        self._pool = None

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Run step a few times (compile, let the allocator settle), then capture it once.
        Returns the replay and the step's output tensor, which every replay overwrites."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._pool = graph.pool()
        return graph.replay, out

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class CudaGraphRunner(StaticRunner):
    """CUDA: the compiled decode step captured as CUDA graphs, one per attention bucket,
    replayed per token.

    Capturing by hand (instead of mode="reduce-overhead") keeps the per-token host work to a
    replay: no guard checks or input bookkeeping over every weight. Each graph reads the token
    from a fixed buffer and advances the on-device position itself."""

    def __init__(
        self, model: Transformer, device: str, tune: bool = True, kernels: bool = True,
        act_kernel: bool = True, graphs: CudaGraphs | None = None,
        backend: str | None = "inductor",
    ):
        super().__init__(model, device, compile=False)
        self.compiled = True
        from . import decode_attention

        # Triton's kernels need the GPU (the CPU stands in for it only in tests).
        self.kernels = kernels and device.startswith("cuda") and decode_attention.available()
        model.use_kernels(attention=self.kernels, activation=self.kernels and act_kernel)
        if tune:
            # Coordinate-descent tuning of the generated kernels: for batch-1 matrix-vector
            # products the tuned Triton reductions beat cuBLAS's small-M GEMMs (measured on an
            # H200: 1.34 -> 1.16 ms a step for llama-3.2-1b). Set globally, as gpt-fast does:
            # the tuning runs when a kernel first launches, after compile-time options lapse.
            import torch._inductor.config as inductor_config

            inductor_config.coordinate_descent_tuning = True
        compile = (functools.partial(torch.compile, dynamic=True, fullgraph=True, backend=backend)
                   if backend else (lambda fn: fn))  # None: uncompiled (tests)
        self._prefill_fn = compile(self._prefill_impl)
        self._step = compile(self._decode_and_pick)
        self._token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.graphs = graphs or CudaGraphs()

    def _decode_and_pick(self, token, pos, kv_len: int):
        logits = self._decode_impl(token, pos, kv_len)
        return logits, argmax_in_chunks(logits)

    def _step_and_advance(self, kv_len: int) -> torch.Tensor:
        logits, greedy = self._step(self._token, self._pos, kv_len)
        self._pos.add_(1)
        # The greedy choice is made inside the graph and left where the next step reads its
        # token: greedy decoding needs no launch and no copy between replays.
        self._token.copy_(greedy.view(1, 1))
        return logits

    def _capture(self, kv_len: int) -> tuple[Callable[[], None], torch.Tensor]:
        with torch.inference_mode():
            # The warm-up steps before a capture advance the position and overwrite the token:
            # both go back to where the conversation (if any) left them.
            saved_pos, saved_token = self._pos.clone(), self._token.clone()
            replay, logits = self.graphs.capture(lambda: self._step_and_advance(kv_len))
            self._pos.copy_(saved_pos)
            self._token.copy_(saved_token)
            self._graphs[kv_len] = (replay, logits)
            return replay, logits

    def decode(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        with torch.inference_mode():
            kv_len = decode_bucket(pos + 1, self.model.max_len)
            replay, logits = self._graphs.get(kv_len) or self._capture(kv_len)
            if token.data_ptr() != self._token.data_ptr():  # not the graph's own greedy pick
                self._token.copy_(token.view(1, 1))
            replay()
            return logits

    def decode_greedy(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self.decode(token, pos)
        # A view of the graph's token buffer: read it (or copy it out) before the next step.
        return self._token.view(1)

    def warm_up(self, max_prompt: int = 1024) -> None:
        started = time.perf_counter()
        super().warm_up(max_prompt)
        # Capture every bucket now: a conversation crossing a bucket must not stall on it.
        for kv_len in decode_buckets(self.model.max_len):
            if kv_len not in self._graphs:
                self._capture(kv_len)
        self.graphs.synchronize()
        log.info(
            "captured %d decode graphs (attention buckets %s, %s attention) in %.1fs",
            len(self._graphs), sorted(self._graphs),
            "Triton kernel" if self.kernels else "PyTorch-op", time.perf_counter() - started,
        )


class CudaReadback:
    """Pinned host buffers and events, for reading sampled ids back without a stream-wide
    sync. (Tests stand in plain CPU tensors and no-op events.)"""

    def buffer(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.long, pin_memory=True)

    def event(self):
        return torch.cuda.Event()


def pipelined_ids(
    token: torch.Tensor, pos: int, limit: int,
    step: Callable[[torch.Tensor, int], torch.Tensor], readback: CudaReadback,
) -> Iterator[int]:
    """Token ids as the host reads them back, step n+1 queued before token n is read, so the
    GPU never waits for the host. `token` sits at position `pos`; steps run while pos < limit."""
    slots = [readback.buffer() for _ in range(2)]
    events = [readback.event(), readback.event()]
    slots[0].copy_(token.view(1), non_blocking=True)
    events[0].record()
    i = 0
    while True:
        nxt = None
        if pos < limit:
            nxt = step(token, pos)
            slots[1 - i].copy_(nxt.view(1), non_blocking=True)
            events[1 - i].record()
        events[i].synchronize()
        yield int(slots[i].item())
        if nxt is None:
            return
        token, pos, i = nxt, pos + 1, 1 - i
