"""The PyTorch engine: duet's own decode loop over a preallocated KV cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..base import EngineInfo, SamplingParams
from ..device import choose_device, choose_dtype, configure_mps, memory_meter, torch_dtype
from ..generation import TokenLoopEngine, warm_up
from ..tokenizer import ChatTokenizer
from . import cpu_linear
from .loader import load_model
from .runner import CudaGraphRunner, CudaReadback, EagerRunner, StaticRunner, pipelined_ids
from .sampling import make_sampler

log = logging.getLogger("duet.engines.torch")


COMPILE_MODES = ("auto", "on", "off")


class TorchEngine(TokenLoopEngine):
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
    ):
        started = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = choose_device(device)
        if self.device == "mps":
            configure_mps(mps_memory_fraction)
        self.dtype = choose_dtype(dtype, self.device)
        self.model = load_model(model_dir, torch_dtype(self.dtype), self.device)
        if onednn_linears(self.device, compile):
            log.info("cpu: %d linear layers run through oneDNN", cpu_linear.pack_linears(self.model))
        self.context_length = context_length
        self.model.setup_cache(context_length)
        self.tokenizer = ChatTokenizer(model_dir)
        self._meter = memory_meter(self.device)
        self.runner = make_runner(self.model, self.device, compile)
        self.runner.warm_up()
        self.info = EngineInfo(
            engine=self.name,
            device=self.device,
            dtype=self.dtype,
            context_length=context_length,
            backend_version=f"torch {torch.__version__}",
            extra={"compiled": str(self.runner.compiled).lower()},
        )
        log.info(
            "torch engine loaded %s on %s (%s, %s) in %.1fs; warm-up took %.2fs",
            model_dir, self.device, self.dtype, type(self.runner).__name__,
            time.perf_counter() - started, warm_up(self),
        )

    def _token_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        sample = make_sampler(params, self.device)
        token = sample(self.runner.prefill(prompt_ids))
        if params.greedy:
            step = self.runner.decode_greedy
        else:
            def step(token, pos):
                return sample(self.runner.decode(token, pos))
        if self.device.startswith("cuda"):
            yield from pipelined_ids(token, len(prompt_ids), self.context_length, step,
                                     CudaReadback())
            return
        pos = len(prompt_ids)
        while True:
            yield int(token.item())  # the one host sync per token: streaming needs the id
            if pos >= self.context_length:
                return
            token = step(token, pos)
            pos += 1

    @torch.inference_mode()
    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_fits(len(prompt_ids), 0)
        tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        return self.model(tokens, 0)[0].float().cpu().numpy()

    def score_continuations(self, prompts, continuations, should_stop=None):
        from .scoring import score_continuations

        return score_continuations(self.model, prompts, continuations, self.device, should_stop)

    def _kv_cache_bytes(self) -> int:
        return self.model.kv_cache_bytes

    def close(self) -> None:
        self.model = None


def onednn_linears(device: str, compile: str) -> bool:
    """Eager CPU only: the compiler cannot trace oneDNN's opaque weights (and with
    --compile on, Inductor packs weights its own way)."""
    return device == "cpu" and compile != "on" and cpu_linear.available()


def make_runner(model, device: str, compile: str):
    """compile=auto: compiled static decode (CUDA graphs) on CUDA, eager elsewhere."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, not '{compile}'")
    if device.startswith("cuda") and compile in ("auto", "on"):
        return CudaGraphRunner(model, device)
    if compile == "on":
        return StaticRunner(model, device, compile=True)
    return EagerRunner(model, device)
