"""The MLX engine of an embed model: our BERT encoder behind engines/embed.py's Embedder."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..embed import Embedder, load_embedder
from .bert import MLXBert
from .engine import _MX_DTYPES, MLXMeter, choose_mlx_dtype, mlx_device


def mlx_embedder(model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                 **_ignored) -> Embedder:
    device = mlx_device()
    dtype = choose_mlx_dtype(dtype, device)
    return load_embedder(
        "mlx", model_dir, context_length=context_length, device=device, dtype=dtype,
        backend_version=f"mlx {mx.__version__}", meter=MLXMeter(),
        encoder=lambda path, shape: MLXBert(path, shape, _MX_DTYPES[dtype]))
