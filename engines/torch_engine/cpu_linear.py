"""CPU: the model's linear layers through oneDNN, with each weight reordered once at load.

Why: for a one-row product (every decode step) ATen's CPU matmul reads weights at 25 GB/s in
bfloat16 and 15 GB/s in float32 on our 2-core AVX-512 test machine; oneDNN with a weight
reordered for that shape reads 35 and 34 GB/s, and a SmolLM2-135M decode step drops from
19.2 to 15.2 ms (bfloat16). These are the ops Inductor's CPU backend emits for frozen linear
weights (torch.ops.mkldnn); where a build lacks them, the layers stay as they are.

oneDNN runs float32 on any x86 CPU, but its bfloat16 and float16 paths need instructions that
AVX2-only CPUs lack (AVX-512 BW/VL/DQ or AVX-NE-CONVERT for bfloat16: an AMD EPYC with AVX2 only
refused to reorder a bfloat16 weight). torch says which it can run. Elsewhere those dtypes keep
ATen's linear layers, widened (WidenedLinear): on that EPYC ATen's bfloat16 products of many
rows are slow (a 512-token prefill of the default model: 70 tokens/s, against 400 in float32),
while one row reads half the bytes of float32 and decodes faster (26-27 tokens/s against 17-19).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Inputs of more rows than this compute a widened layer in float32.
WIDEN_ROWS = 8


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and this CPU run oneDNN's packed linear layers in dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight
        torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    return cpu_supports(dtype)


def cpu_supports(dtype: torch.dtype) -> bool:
    """oneDNN's reduced-precision paths need CPU instructions of their own; float32 runs on any
    x86 CPU."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """nn.Linear's computation on a oneDNN-reordered copy of its weight (an opaque tensor:
    it has no storage of its own, so nothing else may read it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Reordered for one row; longer inputs (prefill) are still computed correctly.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class WidenedLinear(nn.Module):
    """nn.Linear on its reduced-precision weight for a few rows (decode: the weight's bytes are
    the cost), in float32 for more (prefill, a wide batch: the products are), the weight
    widened for that call. Shares the weight (a tied embedding stays tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= WIDEN_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def widen_linears(model: nn.Module) -> int:
    """Swap every nn.Linear in model for a WidenedLinear; returns how many."""
    return swap_modules(model, nn.Linear, WidenedLinear)


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear in model for a PackedLinear; returns how many. A weight tied to the
    embedding (the LM head of small models) is copied, so the embedding keeps its own."""
    return swap_modules(model, nn.Linear, PackedLinear)


def swap_modules(model: nn.Module, kind: type[nn.Module], make) -> int:
    """Every submodule of the given kind replaced by make(it); returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, make(child))
                swapped += 1
    return swapped
