"""The PyTorch engine: duet's own decode loop over a preallocated KV cache."""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..base import EngineInfo
from ..device import (
    choose_decode_dtype,
    choose_device,
    configure_mps,
    free_memory_bytes,
    memory_meter,
    torch_dtype,
)
from ..generation import GenerationEngine, MemoryMeter, warm_up
from ..quantization import resolve as resolve_quantization
from ..runtime.plan import RankStatus
from ..runtime.sizing import KVFacts, RuntimeOptions, RuntimeShape
from ..tokenizer import build_beside
from . import cpu_linear, cpu_norm, quant, trace_guard
from .config import ModelArgs
from .executor import TorchExecutor
from .loader import load_model, read_config
from .paged import PagedKV
from .ranks import REPORT_S, PoolShape
from .tensor_parallel import Shard, check_splits, use_peer_sums

log = logging.getLogger("duet.engines.torch")


COMPILE_MODES = ("auto", "on", "off")  # auto/on: CUDA graphs on CUDA


class TorchEngine(GenerationEngine):
    name = "torch"
    ranks = None  # the other ranks under tensor parallelism (ranks.RankGroup)
    # Graphs of eager ops serving while the compiled ones are made (DUET_INTERIM_GRAPHS=0: none).
    interim = None
    _own_read = float("-inf")  # when rank_status() last read this rank's memory

    def __init__(self, model_dir: str | Path, **options):
        try:
            self._load(model_dir, **options)
        except BaseException:
            if self.ranks is not None:  # no rank outlives a load that failed
                self.ranks.close()
            raise

    def _load(
        self,
        model_dir: str | Path,
        *,
        context_length: int,
        dtype: str = "auto",
        device: str = "auto",
        compile: str = "auto",
        mps_memory_fraction: float | None = None,
        kv_cache_memory: int | None = None,
        kv_cache_limit: int | None = None,
        max_batch: int | None = None,
        max_prefill_tokens: int | None = None,
        prefix_cache: bool = True,
        quantize: str = "auto",
        tensor_parallel: int = 1,
    ):
        started = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = choose_device(device)
        if self.device.startswith("cuda"):
            # Here first (a no-op after the engine process's import_compiler), so that no
            # module is ever imported by the two threads from both ends at once (a deadlock
            # Python raises as an error).
            import_compiler()
        tokenizer = build_beside(model_dir)
        if self.device == "mps":
            configure_mps(mps_memory_fraction)
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, not '{compile}'")
        cfg = read_config(model_dir)
        self.quantization = resolve_quantization(quantize, cfg, "torch")
        self.dtype = choose_decode_dtype(dtype, self.device)
        if dtype == "auto":
            log.info("dtype auto on %s: %s", self.device, self.dtype)
        shard = None
        if tensor_parallel > 1:
            shard = self._start_ranks(model_dir, ModelArgs.from_hf(cfg), compile,
                                      tensor_parallel)
        self.model = load_model(model_dir, torch_dtype(self.dtype), self.device, shard,
                                self.ranks.group if self.ranks else None)
        weights_bytes = prepare_weights(self.model, self.quantization, self.device, compile,
                                        self.dtype)
        if self.ranks is not None:
            weights_bytes += self.ranks.loaded_bytes()
        shape = self.start_runtime(
            KVFacts(PagedKV.model_bytes_per_token(self.model, torch_dtype(self.dtype)),
                    context_length, self.device, free_memory_bytes(self.device)),
            RuntimeOptions(kv_cache_memory, kv_cache_limit, max_batch, max_prefill_tokens,
                           prefix_cache))
        use_peer_sums(self.model, self.device, shape.max_batch, shape.max_prefill_tokens)
        # One GPU: its graphs are captured beside the eager steps it serves meanwhile, from the
        # end of the load. A tensor-parallel group's ranks capture theirs now, in step.
        beside = self.ranks is None
        decoder = make_decoder(self.model, self.kv, self.device, compile, shape.max_batch,
                               capture=not beside)
        # While a compiled step is made (half a minute warm, minutes cold), graphs of eager ops
        # serve (DUET_INTERIM_GRAPHS=0: not): captured first (seconds), they replay a step at a
        # few GIL hand-overs, where an eager step takes hundreds, each a wait while the
        # compiler holds the GIL.
        interim = None
        if beside and decoder is not None and decoder.compiled:
            from .cuda_graphs import interim_wanted

            if interim_wanted():
                interim = make_decoder(self.model, self.kv, self.device, "off",
                                       shape.max_batch, capture=False)
        self.decoder, self.interim = (None if beside else decoder), None
        self.meter = self._own_meter = memory_meter(self.device)  # own: this rank's
        world = 1
        if self.ranks is not None:
            self.ranks.built()
            self.model.mirror = self.ranks.mirror
            self.meter = RanksMeter(self._own_meter, self.ranks)
            world = self.ranks.world
        self.tokenizer = tokenizer()
        self.info = EngineInfo(
            engine=self.name,
            device=self.device,
            dtype=self.dtype,
            context_length=self.context_length,
            backend_version=f"torch {torch.__version__}",
            quantization=self.quantization.describe() if self.quantization else "none",
            weights_bytes=weights_bytes,
            kv_cache_bytes=shape.pool.capacity_bytes * world,
            memory_measure=self.meter.measures,
            # Ranks on the CPU share its memory: one device, whatever the ranks.
            devices=world if self.device.startswith("cuda") else 1,
            extra={"cuda_graphs": str(decoder is not None).lower(),
                   "tensor_parallel": str(world), **shape.info()},
        )
        loaded = time.perf_counter() - started
        # Eager, before the capture starts: alone, it takes a fraction of its time beside it
        # (5 s on an H100 host, where the two threads share the interpreter).
        quant.compile_kernels(self.model)
        warmed = warm_up(self)
        if beside and decoder is not None:
            decoder.compile_kernels()
            warmed = time.perf_counter() - started - loaded
            trace_guard.install()  # the compile beside traces; prefills run modules meanwhile
            first = interim.warm_up_beside() if interim is not None else None
            self.compiled = decoder.warm_up_beside(after=first)
            self.decoder, self.interim = decoder, interim
            if interim is not None:
                # Once the compiled graphs serve, the interim ones' memory is let go (the
                # executor drops them at its switch).
                self.compiled.add_done_callback(self._drop_interim)
        log.info("torch engine loaded %s on %s (%s) in %.1fs; %s; warm-up took %.2fs",
                 model_dir, self.device, self.dtype, loaded, shape.describe(), warmed)

    def _start_ranks(self, model_dir: Path, args: ModelArgs, compile: str, world: int) -> Shard:
        """Start the other ranks of a tensor-parallel group (ranks.py); this engine is rank 0."""
        from .ranks import RankGroup, RankSpec, rank_device

        if self.device == "mps":
            raise ValueError("tensor parallelism runs on CUDA GPUs or the CPU, not MPS")
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        if kind == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor parallelism over {world} ranks needs {world} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        check_splits(args, world)
        self.device = rank_device(kind)
        self.ranks = RankGroup(RankSpec(str(model_dir), self.dtype, kind, compile,
                                        self.quantization, 0, world, ""))
        log.info("tensor parallelism: %d ranks over %s (%s)", world,
                 "GPUs 0-%d" % (world - 1) if kind == "cuda" else "the CPU",
                 "NCCL" if kind == "cuda" else "gloo")
        return Shard(0, world)

    def allocate_kv(self, shape: RuntimeShape) -> None:
        """The pool's blocks for this rank's KV heads (and the other ranks' for theirs)."""
        self.model.setup_rope(shape.context_length)
        self.kv = PagedKV.for_model(self.model, shape.pool.num_blocks, shape.pool.block_size,
                                    torch_dtype(self.dtype), self.device)
        if self.ranks is not None:
            self.ranks.build(PoolShape(shape.pool.num_blocks, shape.pool.block_size,
                                       shape.context_length, shape.max_batch,
                                       shape.max_prefill_tokens))

    def rank_status(self) -> tuple[RankStatus, ...]:
        if self.ranks is None:
            return ()
        now = time.monotonic()
        if now - self._own_read >= REPORT_S:  # the other ranks' come as they report
            self._own_read = now
            self._own_status = RankStatus(0, os.getpid(), device_memory_bytes(self.device),
                                          self._own_meter.peak_bytes())
        return (self._own_status, *self.ranks.status())

    def executor(self, *, prefix_cache: bool = False) -> TorchExecutor:
        # The KV lives in the pool's blocks: their reuse is the scheduler's.
        return TorchExecutor(self.model, self.kv, self.device, self.decoder, self.ranks,
                             interim=self.interim)

    def _drop_interim(self, compiled) -> None:
        if compiled.exception() is None:
            self.interim = None

    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_fits(len(prompt_ids), 0)
        with (trace_guard.eager(), torch.inference_mode(),
              self.model.scratch_cache(len(prompt_ids))):
            tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            return self.model(tokens, 0)[0].float().cpu().numpy()

    def score_continuations(self, prompts, continuations, should_stop=None):
        from .scoring import score_continuations

        longest = max(len(p) for p in prompts) + max(len(c) for c in continuations)
        with trace_guard.eager(), self.model.scratch_cache(min(longest, self.context_length)):
            return score_continuations(self.model, prompts, continuations, self.device,
                                       should_stop)

    def close(self) -> None:
        # Their threads hold the model and the pool till they end. Both told first: the
        # compiled capture, waiting for the interim one, then never begins.
        decoders = [d for d in (self.interim, self.decoder) if d is not None]
        for decoder in decoders:
            decoder.stop()
        for decoder in decoders:
            decoder.abandon()
        self.model = None
        self.kv = None
        self.decoder = self.interim = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None


def import_compiler() -> None:
    """Import what the compile of a CUDA load imports, and transformers may too (5 s on an H100
    host): in the engine's process while the server decides, or first thing in the load."""
    for module in ("torch._dynamo", "torch.distributed.tensor"):
        importlib.import_module(module)


class RanksMeter(MemoryMeter):
    """A tensor-parallel engine's memory: rank 0's meter and the other ranks' last reports,
    summed."""

    def __init__(self, own: MemoryMeter, ranks) -> None:
        self._own, self._ranks = own, ranks
        self.measures = f"{own.measures}, summed over {ranks.world} ranks"

    def reset(self) -> None:
        self._own.reset()
        self._ranks.reset_meters()

    def sample(self) -> None:
        self._own.sample()

    def peak_bytes(self) -> int:
        return self._own.peak_bytes() + self._ranks.peak_bytes()


def device_memory_bytes(device: str) -> int:
    """What this process holds on its device now: the CUDA allocator's tensors, else the
    process's resident set."""
    if device.startswith("cuda"):
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def prepare_weights(model, quantization, device: str, compile: str, dtype: str) -> int:
    """Quantize the loaded weights, or on the CPU hand the linear layers to oneDNN; on the CPU
    the RMS norms become one kernel each (cpu_norm). Returns the weights' bytes (counted before
    oneDNN packs them: its packed weights are opaque)."""
    if quantization is not None:
        counts = quant.quantize_model(model, quantization, device)
        if device.startswith("cuda"):
            # The float weights' blocks go back to the driver: left in the allocator's cache
            # they held an 8B model's 16 GB from other processes on the GPU (three servers
            # beside each other ran out of memory so, 2026-11-27).
            torch.cuda.empty_cache()
        log.info("weights quantized to %s: %s", quantization.describe(),
                 ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    weights_bytes = sum(t.numel() * t.element_size()
                        for t in [*model.parameters(), *model.buffers()])
    if device == "cpu":
        log.info("cpu: %d RMS norms run as layer norms", cpu_norm.swap_norms(model))
    if quantization is None:
        if onednn_linears(device, compile, torch_dtype(dtype)):
            log.info("cpu: %d linear layers run through oneDNN", cpu_linear.pack_linears(model))
        elif device == "cpu" and compile != "on" and dtype != "float32":
            log.info("cpu: %d linear layers run through ATen, in float32 for more than %d rows: "
                     "this CPU lacks the instructions oneDNN's packed %s path needs",
                     cpu_linear.widen_linears(model), cpu_linear.WIDEN_ROWS, dtype)
    return weights_bytes


def onednn_linears(device: str, compile: str, dtype: torch.dtype) -> bool:
    """Eager CPU only, in a dtype this CPU's oneDNN runs: the compiler cannot trace oneDNN's
    opaque weights (and with --compile on, Inductor packs weights its own way)."""
    return device == "cpu" and compile != "on" and cpu_linear.available(dtype)


def make_decoder(model, kv: PagedKV, device: str, compile: str, max_batch: int,
                 head: bool = True, capture: bool = True):
    """On CUDA the decode step is replayed as CUDA graphs: compiled by Inductor (compile auto
    or on), or of eager ops (off, or DUET_CUDA_GRAPHS=eager), captured now, or (capture
    False) when the caller says, on a thread while the engine serves eagerly
    (GraphDecoder.warm_up_beside). None (eager decode) elsewhere: MPS and the CPU have no
    graph replay, and eager decode is their fast path."""
    if not device.startswith("cuda"):
        if compile == "on":
            log.warning("--compile on: %s decodes eagerly; CUDA graphs are for CUDA", device)
        return None
    import os

    from .cuda_graphs import GraphDecoder

    eager = compile == "off" or os.environ.get("DUET_CUDA_GRAPHS") == "eager"
    decoder = GraphDecoder(model, kv, device, max_batch, backend=None if eager else "inductor",
                           head=head)
    if capture:
        decoder.warm_up()
    return decoder
