"""Weight-only quantized linear layers: the model's weights in fewer bytes, its activations in
its dtype.

Decode reads every weight once per step, so its speed is the weights' bytes: int8 halves
bfloat16's, int4 quarters them. Three formats:
- int8: one scale per output channel (symmetric, absmax / 127), gpt-fast's int8.
- int4: groups of `group_size` inputs, each with a scale and a zero: w = (q - 8) * scale + zero,
  q in 0..15; this is tinygemm's layout (torch._weight_int4pack_mm) and holds GGUF's Q4_0/Q4_1
  blocks of 32 exactly (Q4_1's w = q * d + m is zero = m + 8 * d).
- fp8: float8 e4m3 weights with one scale per output channel.

Which kernel a layer runs is decided once, per device, by `kernel()`:
- CPU: ATen's packed int8/int4 kernels, in bfloat16 (their float32 paths are 8-25x slower on
  an AVX2 EPYC); their cost grows with the rows, so an int8 layer of more than 16 rows (prefill)
  dequantizes its weight to float32 for that call instead (on that EPYC, 512 rows: 8.8 ms
  against the kernel's 15.7 and float32's 6.7).
- CUDA: int4 in tinygemm's layout, through tinygemm (bfloat16) up to 6 rows and duet's
  kernel (int4_kernel.int4_mm_tiny) past them, where tinygemm's time grows with the rows; or
  duet's kernel alone, on its own layout, with DUET_INT4_KERNEL=triton; int8 and fp8 as
  `linear(x, w.to(dtype)) * scale` for the compiled decode
  step's one row, which Inductor makes one weight-reading kernel; two rows or more on the
  tensor cores, the activations quantized per row: int8 x int8 through torch._int_mm, fp8
  (compute capability 8.9+) through torch._scaled_mm, or for up to 64 rows duet's kernel
  (fp8_kernel.py; by default on Hopper).
- elsewhere (MPS, or a shape a kernel cannot take): dequantize for each call. Correct anywhere;
  memory is still the quantized bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization import DEFAULT_GROUP, Quantization
from . import fp8_kernel, int4_kernel, row_quant

# An fp8 or int8 layer on CUDA reads its weight as stored for one row of the compiled decode
# step: there Inductor makes `linear(x, w.to(dtype))` a reduction over the stored weight (its
# one-row decomposition under coordinate-descent tuning). From two rows the product runs on the
# tensor cores, the activations quantized per row: Inductor compiles the expression of 2-15 rows
# into the weight widened to bfloat16 whole, then a GEMM (every step of the 8B shape wrote 16 GB,
# and its LM head's 1 GiB buffer ran a GPU shared by two servers out of memory while capturing).
# Eager calls take the tensor cores at any rows, for the same reason.
TENSOR_CORE_ROWS = 2
# Rows ATen's kernels are given at least, fewer padded with zero rows: torch._int_mm wants more
# than 16; torch._scaled_mm is given 16, where it was measured.
SCALED_MM_ROWS = 16
INT_MM_ROWS = 17
FP8_MAX = 448.0
# Rows up to which an int4 layer on CUDA runs tinygemm; more take duet's kernel on the same
# words (int4_kernel.int4_mm_tiny). Measured on an H100 (probe_quant_layers.py, 2026-11-27),
# an 8B layer's four products: tinygemm 96 us at 4 rows, 156 at 8, 971 at 64; the kernel
# about 136 from 2 to 16 rows, 185 at 64: even near 6.
TINYGEMM_ROWS = 6


# --- the formats' arithmetic, device-independent (tests check the kernels against these) ---

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: int8 [N, K] and a float32 scale [N]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric, by groups of inputs: q uint8 [N, K] in 0..15, scale and zero float32 [N, K/g]
    (each group's min maps to q = 0 and its max to q = 15)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = lo + 8.0 * scale
    return q.to(torch.uint8).reshape(n, k), scale, zero


def scales_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[K/g, N, 2]: the layout both of ATen's int4 kernels take, in bfloat16 (tinygemm's)."""
    return torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()


def tinygemm_pack(q: torch.Tensor, inner_k_tiles: int = 8) -> torch.Tensor:
    """q [N, K] in 0..15 as tinygemm's words (CUDA), from its byte pairs."""
    return torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                             inner_k_tiles)


def dequantize_int4(q, scale, zero, group: int) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // group, group) - 8.0
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: float8 e4m3 [N, K] and a float32 scale [N]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w8.float() * scale.float()[:, None]


# --- which kernel ---

def kernel(fmt: str, device: str, shape: tuple[int, int], group: int = DEFAULT_GROUP) -> str:
    """'cpu', 'cuda', 'triton' (int4_kernel.py, opt-in, or fp8_kernel.py) or 'dequant' (the
    portable path) for a layer of this format and [N, K]."""
    n, k = shape
    if device == "cpu":
        if fmt == "int4" and (k % group or n % 16):
            return "dequant"
        return "dequant" if fmt == "fp8" else "cpu"
    if device.startswith("cuda"):
        if fmt == "int4" and int4_kernel.wanted() and int4_kernel.fits(n, k, group):
            return "triton"
        if fmt == "fp8" and fp8_kernel.wanted(device) and fp8_kernel.fits(n, k):
            return "triton"
        # tinygemm packs K in tiles of 8 x 16 and N in 8s.
        if fmt == "int4" and (k % 128 or n % 8 or k % group):
            return "dequant"
        return "cuda"
    return "dequant"


def fp8_tensor_cores(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.get_device_capability(device) >= (8, 9)


# --- the layers ---

class QuantLinear(nn.Module):
    """A linear layer of a quantized weight."""

    format: str
    in_features: int
    out_features: int
    kernel: str
    bias: torch.Tensor | None

    def _dequant_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # On the CPU reduced-precision matmuls of many rows are slow without AVX-512 (see
        # cpu_linear); float32 is fast everywhere there.
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        bias = None if self.bias is None else self.bias.to(compute)
        return F.linear(x.to(compute), w.to(compute), bias).to(x.dtype)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def on_tensor_cores(rows: int) -> bool:
    """Whether an fp8 or int8 product of this many rows on CUDA quantizes its activations for
    the tensor cores rather than reading its weight as stored (see TENSOR_CORE_ROWS)."""
    return rows >= TENSOR_CORE_ROWS or not torch.compiler.is_compiling()


def _padded(x2: torch.Tensor, rows: int) -> torch.Tensor:
    """x2 [M, K] with zero rows added up to `rows` (their products are sliced off after)."""
    m = x2.shape[0]
    return x2 if m >= rows else F.pad(x2, (0, 0, 0, rows - m))


class Int8Linear(QuantLinear):
    format = "int8"

    def __init__(self, linear: nn.Linear, kernel_name: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel_name
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        # ATen's CPU kernel takes the scales in the activations' dtype, and is fast in bfloat16.
        if kernel_name == "cpu":
            self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cuda":
            if (on_tensor_cores(_rows(x)) and self.in_features % 8 == 0
                    and self.out_features % 8 == 0):
                return self._finish(self._int8_tensor_cores(x), x)
            return self._finish(F.linear(x, self.qweight.to(x.dtype)) * self.scale, x)
        if self.kernel == "cpu":
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                          self.qweight, self.scale_bf16)
            return self._finish(y, x)
        return self._dequant_linear(x, dequantize_int8(self.qweight, self.scale))


    def _int8_tensor_cores(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: the activations quantized per row too, an int8 x int8 product on the
        tensor cores (the weight-only expression, fused by Inductor for a few rows, compiled
        for 64 rows into a kernel that took 1 s a step for an 8B model on an H100)."""
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        x2 = _padded(x2, INT_MM_ROWS)
        fused = row_quant.available(x2)  # eager: two kernels for the expressions' ten and four
        x8, x_scale = (row_quant.quantize_rows if fused else quantize_rows)(x2, "int8")
        acc = torch._int_mm(x8, self.qweight.t())
        if fused:
            return row_quant.scale_products(acc, x_scale, self.scale, x.dtype)[:rows]
        return (acc.float() * x_scale * self.scale.float())[:rows]


class Int4Linear(QuantLinear):
    format = "int4"
    """The packed kernels run every call, prefill included: no unpacked copy is kept to
    multiply densely (on the CPU a 512-row product costs 2.5x float32's; decode is the gain; on
    CUDA a product past int4_kernel.TINY_DEQUANT_ROWS dequantizes its weight for that call)."""

    def __init__(self, linear: nn.Linear, kernel_name: str, group: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel, self.group = kernel_name, group
        self.tinygemm_rows = TINYGEMM_ROWS  # the "cuda" kernel's (probe_quant_layers sets it)
        q, scale, zero = quantize_int4(linear.weight.detach(), group)
        if kernel_name == "dequant":
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        elif kernel_name == "triton":  # K-major words, [K/g, N] scales and zeros
            self.register_buffer("qweight", int4_kernel.pack(q))
            self.register_buffer("scales", scale.t().to(torch.bfloat16).contiguous())
            self.register_buffer("zeros", zero.t().to(torch.bfloat16).contiguous())
        else:
            self.register_buffer("scales_zeros", scales_zeros(scale, zero))
            if kernel_name == "cpu":
                packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            else:
                packed = tinygemm_pack(q)
            self.register_buffer("packed", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "triton":
            y = torch.ops.duet.int4_mm(x2.to(torch.bfloat16), self.qweight, self.scales,
                                       self.zeros, self.group)
            return self._finish(y, x)
        if self.kernel == "cuda":
            if x2.shape[0] > self.tinygemm_rows and int4_kernel.available():
                y = torch.ops.duet.int4_mm_tiny(x2.to(torch.bfloat16), self.packed,
                                                self.scales_zeros, self.group)
            else:
                y = torch._weight_int4pack_mm(x2.to(torch.bfloat16), self.packed, self.group,
                                              self.scales_zeros)
            return self._finish(y, x)
        if self.kernel == "cpu":
            # Its float32 path is 25x slower than its bfloat16 one on an AVX2 EPYC.
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed,
                                                  self.group, self.scales_zeros)
            return self._finish(y, x)
        return self._dequant_linear(x, dequantize_int4(self.q, self.scale, self.zero, self.group))


def compile_kernels(model: nn.Module) -> int:
    """Run each int4 layer shape on CUDA once through duet's kernel at the row counts past
    tinygemm's that compile a kernel of its own (tiles of 16 rows, of 64, the weight
    dequantized whole past int4_kernel.TINY_DEQUANT_ROWS), so that Triton compiles them now:
    else the first request long enough to need one pays for it in the serving thread (the
    dequantizing kernel's first call took 0.75 s on an H100, 2026-11-27; the decode graphs'
    capture, beside the first requests, compiles only the tiles). Returns the shapes run."""
    if not int4_kernel.available():
        return 0
    shapes = {}
    for layer in model.modules():
        if isinstance(layer, Int4Linear) and layer.kernel == "cuda":
            shapes.setdefault((layer.out_features, layer.in_features, layer.group), layer)
    with torch.inference_mode():
        for layer in shapes.values():
            for rows in (16, 64, int4_kernel.TINY_DEQUANT_ROWS + 1):
                x = torch.zeros(rows, layer.in_features, dtype=torch.bfloat16,
                                device=layer.packed.device)
                torch.ops.duet.int4_mm_tiny(x, layer.packed, layer.scales_zeros, layer.group)
    return len(shapes)


class FP8Linear(QuantLinear):
    format = "fp8"

    def __init__(self, linear: nn.Linear, kernel_name: str, tensor_cores: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel, self.tensor_cores = kernel_name, tensor_cores
        w8, scale = quantize_fp8(linear.weight.detach())
        self.register_buffer("weight8", w8)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel not in ("cuda", "triton"):
            return self._dequant_linear(x, dequantize_fp8(self.weight8, self.scale))
        rows = _rows(x)
        if self.tensor_cores and on_tensor_cores(rows):
            x2 = x.reshape(-1, self.in_features)
            own_kernel = self.kernel == "triton" and rows <= fp8_kernel.MAX_ROWS
            if not own_kernel:
                x2 = _padded(x2, SCALED_MM_ROWS)
            x8, x_scale = (row_quant.quantize_rows if row_quant.available(x2)
                           else quantize_rows)(x2, "fp8")
            if own_kernel:
                y = torch.ops.duet.fp8_mm(x8, x_scale, self.weight8, self.scale)
            else:
                y = torch._scaled_mm(x8, self.weight8.t(), scale_a=x_scale,
                                     scale_b=self.scale[None, :], out_dtype=x.dtype)[:rows]
            return self._finish(y, x)
        return self._finish(F.linear(x, self.weight8.to(x.dtype)) * self.scale.to(x.dtype), x)


def quantize_rows(x2: torch.Tensor, fmt: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] quantized per row, with one float32 scale a row [M, 1]: fp8 to e4m3
    (absmax / 448), int8 (absmax / 127, rounded half to even). The torch expression, which the
    compiled decode step fuses; row_quant's kernel gives its bits eagerly on CUDA."""
    levels, smallest, dtype = row_quant.FORMATS[fmt]
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / levels).clamp(min=smallest)
    q = x2.float() / x_scale
    if fmt == "int8":
        q = torch.round(q)
    return q.clamp(-levels, levels).to(dtype), x_scale


def quantize_linear(linear: nn.Linear, config: Quantization, device: str,
                    fmt: str | None = None) -> QuantLinear:
    fmt = fmt or config.format
    if fmt == "int4" and linear.in_features % config.group_size:
        fmt = "int8"  # its inputs do not split into groups
    shape = (linear.out_features, linear.in_features)
    name = kernel(fmt, device, shape, config.group_size)
    if fmt == "int8":
        return Int8Linear(linear, name)
    if fmt == "int4":
        return Int4Linear(linear, name, config.group_size)
    return FP8Linear(linear, name, fp8_tensor_cores(device))


def quantize_model(model: nn.Module, config: Quantization, device: str) -> dict[str, int]:
    """Replace every nn.Linear of the model by its quantized layer, in place; returns how many
    layers took each kernel. The LM head of an int4 model stays int8, as llama.cpp's Q4 files
    keep their output layer in 6 or 8 bits: the logits feel its error most. A head tied to the
    embedding gets its own quantized copy; the embedding keeps its float weight."""
    counts: dict[str, int] = {}
    with torch.no_grad():
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                head = child_name == "lm_head"
                fmt = "int8" if head and config.format == "int4" else config.format
                layer = quantize_linear(child, config, device, fmt)
                setattr(module, child_name, layer)
                key = f"{layer.format}:{layer.kernel}"
                counts[key] = counts.get(key, 0) + 1
    return counts
