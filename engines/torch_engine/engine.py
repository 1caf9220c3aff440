"""The PyTorch engine: duet's own decode loop over a preallocated KV cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..base import EngineInfo, SamplingParams
from ..device import choose_device, choose_dtype, memory_meter, torch_dtype
from ..generation import TokenLoopEngine, warm_up
from ..tokenizer import ChatTokenizer
from .loader import load_model
from .sampling import make_sampler

log = logging.getLogger("duet.engines.torch")


class TorchEngine(TokenLoopEngine):
    name = "torch"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        context_length: int,
        dtype: str = "auto",
        device: str = "auto",
    ):
        started = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = choose_device(device)
        self.dtype = choose_dtype(dtype, self.device)
        self.model = load_model(model_dir, torch_dtype(self.dtype), self.device)
        self.context_length = context_length
        self.model.setup_cache(context_length)
        self.tokenizer = ChatTokenizer(model_dir)
        self._meter = memory_meter(self.device)
        self.info = EngineInfo(
            engine=self.name,
            device=self.device,
            dtype=self.dtype,
            context_length=context_length,
            backend_version=f"torch {torch.__version__}",
        )
        log.info(
            "torch engine loaded %s on %s (%s) in %.1fs; warm-up took %.2fs",
            model_dir, self.device, self.dtype, time.perf_counter() - started, warm_up(self),
        )

    # The two calls a compiler can wrap: a variable-length prefill and a one-token step.
    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, 0, last_only=True)[0, -1]

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        return self.model(token.view(1, 1), pos)[0, -1]

    def _token_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        sample = make_sampler(params, self.device)
        tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        token = sample(self.prefill(tokens))
        pos = len(prompt_ids)
        while True:
            yield int(token.item())  # the one host sync per token: streaming needs the id
            if pos >= self.context_length:
                return
            token = sample(self.decode_step(token, pos))
            pos += 1

    @torch.inference_mode()
    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_fits(len(prompt_ids), 0)
        tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        return self.model(tokens, 0)[0].float().cpu().numpy()

    def _kv_cache_bytes(self) -> int:
        return self.model.kv_cache_bytes

    def close(self) -> None:
        self.model = None
