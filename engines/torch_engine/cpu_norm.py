"""CPU: the model's RMS norms as one layer_norm kernel each.

Why: ATen's CPU rms_norm is a composite of several ops (the input widened, squared, averaged,
its reciprocal root, two products, the result narrowed): 37-53 us for one 576-wide bfloat16
row on a 2-core AVX2 EPYC, and the default model's decode step runs 61 of them (about 10% of
the step). layer_norm is one vectorized kernel. The rows [x, -x] have mean 0 and variance
mean(x^2), so the first half of their layer norm is x's RMS norm, computed in float32 and
rounded once like rms_norm's: 13 us for that row, within the dtype's rounding of rms_norm's
result (in bfloat16 the last bit differs at times, so greedy tokens can part after many).

CUDA (fused, or compiled into the decode graphs) and MPS keep F.rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNormedRMS(nn.Module):
    """An RMSNorm's computation through layer_norm (see the module's docstring). Keeps the
    norm's weight and eps, which tensor parallelism's fused sums read."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        doubled = torch.cat((norm.weight.detach(), norm.weight.detach()))
        self.register_buffer("doubled", doubled, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        both = torch.cat((x, -x), dim=-1)
        # One row's half is contiguous as it is; more rows' halves are copied out (the int4
        # kernel takes contiguous rows only).
        return F.layer_norm(both, (2 * d,), self.doubled, None, self.eps)[..., :d].contiguous()


def swap_norms(model: nn.Module) -> int:
    """Every RMSNorm of the model replaced by a LayerNormedRMS; returns how many."""
    from .cpu_linear import swap_modules
    from .model import RMSNorm

    return swap_modules(model, RMSNorm, LayerNormedRMS)
