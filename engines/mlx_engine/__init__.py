"""The MLX engine (imports mlx: load it through engines.factory)."""

from ..mlx_blas import preload

preload()  # before engine.py imports mlx.core: MLX's CPU products in an optimized BLAS

from .engine import MLXEngine  # noqa: E402

__all__ = ["MLXEngine"]
