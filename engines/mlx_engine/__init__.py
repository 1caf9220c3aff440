"""The MLX engine (imports mlx: load it through engines.factory)."""

from .engine import MLXEngine

__all__ = ["MLXEngine"]
