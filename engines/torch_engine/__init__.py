"""The PyTorch engine (imports torch: load it through engines.factory)."""

from .engine import TorchEngine

__all__ = ["TorchEngine"]
