"""The torch engine of an embed model: our BERT encoder behind engines/embed.py's Embedder."""

from __future__ import annotations

from pathlib import Path

import torch

from ..device import choose_device, choose_dtype, memory_meter, torch_dtype
from ..embed import Embedder, load_embedder
from .bert import TorchBert


def torch_embedder(model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                   device: str = "auto", **_ignored) -> Embedder:
    device = choose_device(device)
    dtype = choose_dtype(dtype, device)
    return load_embedder(
        "torch", model_dir, context_length=context_length, device=device, dtype=dtype,
        backend_version=f"torch {torch.__version__}", meter=memory_meter(device),
        encoder=lambda path, shape: TorchBert(path, shape, device, torch_dtype(dtype)))
