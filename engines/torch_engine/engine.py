"""The PyTorch engine: duet's own decode loop over a preallocated KV cache."""

from __future__ import annotations

import logging
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
from ..generation import GenerationEngine, warm_up
from ..quantization import resolve as resolve_quantization
from ..runtime.sizing import (
    describe_pool,
    fit_context,
    pool_info,
    prefill_budget,
    size_pool,
)
from ..tokenizer import ChatTokenizer
from . import cpu_linear, quant
from .executor import TorchExecutor
from .loader import load_model, read_config
from .paged import PagedKV

log = logging.getLogger("duet.engines.torch")


COMPILE_MODES = ("auto", "on", "off")  # auto/on: CUDA graphs on CUDA


class TorchEngine(GenerationEngine):
    name = "torch"

    def __init__(
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
    ):
        started = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = choose_device(device)
        if self.device == "mps":
            configure_mps(mps_memory_fraction)
        self.quantization = resolve_quantization(quantize, read_config(model_dir), "torch")
        self.dtype = choose_decode_dtype(dtype, self.device)
        if dtype == "auto":
            log.info("dtype auto on %s: %s", self.device, self.dtype)
        self.model = load_model(model_dir, torch_dtype(self.dtype), self.device)
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, not '{compile}'")
        if self.quantization is not None:
            counts = quant.quantize_model(self.model, self.quantization, self.device)
            log.info("weights quantized to %s: %s", self.quantization.describe(),
                     ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        # Counted before oneDNN packs the layers: its packed weights are opaque to torch.
        weights_bytes = sum(t.numel() * t.element_size() for t in
                            [*self.model.parameters(), *self.model.buffers()])
        if self.quantization is None:
            self._cpu_linears(compile)
        args = self.model.args
        per_token = PagedKV.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim,
                                            torch_dtype(self.dtype))
        pool, max_batch = size_pool(
            bytes_per_token=per_token, context_length=context_length, max_batch=max_batch,
            memory_bytes=kv_cache_memory, free_bytes=free_memory_bytes(self.device),
            limit_bytes=kv_cache_limit,
            device=self.device,
        )
        self.context_length = fit_context(context_length, pool, "torch")
        self.model.setup_rope(self.context_length)
        self.kv = PagedKV(args.num_layers, pool.num_blocks, pool.block_size, args.num_kv_heads,
                          args.head_dim, torch_dtype(self.dtype), self.device)
        self.init_runtime(pool, max_batch=max_batch,
                          max_prefill_tokens=prefill_budget(max_prefill_tokens, self.device),
                          prefix_cache=prefix_cache)
        self.decoder = make_decoder(self.model, self.kv, self.device, compile, max_batch)
        self.tokenizer = ChatTokenizer(model_dir)
        self.meter = memory_meter(self.device)
        self.info = EngineInfo(
            engine=self.name,
            device=self.device,
            dtype=self.dtype,
            context_length=self.context_length,
            backend_version=f"torch {torch.__version__}",
            quantization=self.quantization.describe() if self.quantization else "none",
            weights_bytes=weights_bytes,
            kv_cache_bytes=pool.capacity_bytes,
            memory_measure=self.meter.measures,
            extra={"cuda_graphs": str(self.decoder is not None).lower(),
                   **pool_info(pool, max_batch)},
        )
        log.info(
            "torch engine loaded %s on %s (%s) in %.1fs; %s; warm-up took %.2fs",
            model_dir, self.device, self.dtype, time.perf_counter() - started,
            describe_pool(pool, max_batch), warm_up(self),
        )

    def _cpu_linears(self, compile: str) -> None:
        if onednn_linears(self.device, compile, torch_dtype(self.dtype)):
            log.info("cpu: %d linear layers run through oneDNN", cpu_linear.pack_linears(self.model))
        elif self.device == "cpu" and compile != "on" and self.dtype != "float32":
            log.info("cpu: %d linear layers run through ATen, in float32 for more than %d rows: "
                     "this CPU lacks the instructions oneDNN's packed %s path needs",
                     cpu_linear.widen_linears(self.model), cpu_linear.WIDEN_ROWS, self.dtype)

    def executor(self, *, prefix_cache: bool = False) -> TorchExecutor:
        # The KV lives in the pool's blocks: their reuse is the scheduler's.
        return TorchExecutor(self.model, self.kv, self.device, self.decoder)

    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_fits(len(prompt_ids), 0)
        with torch.inference_mode(), self.model.scratch_cache(len(prompt_ids)):
            tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            return self.model(tokens, 0)[0].float().cpu().numpy()

    def score_continuations(self, prompts, continuations, should_stop=None):
        from .scoring import score_continuations

        longest = max(len(p) for p in prompts) + max(len(c) for c in continuations)
        with self.model.scratch_cache(min(longest, self.context_length)):
            return score_continuations(self.model, prompts, continuations, self.device,
                                       should_stop)

    def close(self) -> None:
        self.model = None
        self.kv = None
        self.decoder = None


def onednn_linears(device: str, compile: str, dtype: torch.dtype) -> bool:
    """Eager CPU only, in a dtype this CPU's oneDNN runs: the compiler cannot trace oneDNN's
    opaque weights (and with --compile on, Inductor packs weights its own way)."""
    return device == "cpu" and compile != "on" and cpu_linear.available(dtype)


def make_decoder(model, kv: PagedKV, device: str, compile: str, max_batch: int):
    """On CUDA the decode step is replayed as CUDA graphs: compiled by Inductor (compile auto
    or on), or of eager ops (off, or DUET_CUDA_GRAPHS=eager). None (eager decode) elsewhere:
    MPS and the CPU have no graph replay, and eager decode is their fast path."""
    if not device.startswith("cuda"):
        if compile == "on":
            log.warning("--compile on: %s decodes eagerly; CUDA graphs are for CUDA", device)
        return None
    import os

    from .cuda_graphs import GraphDecoder

    eager = compile == "off" or os.environ.get("DUET_CUDA_GRAPHS") == "eager"
    decoder = GraphDecoder(model, kv, device, max_batch, backend=None if eager else "inductor")
    decoder.warm_up()
    return decoder
