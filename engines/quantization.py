"""Which weight quantization a model is served in: the one place both engines ask.

`quantize` in models.toml: none, int8, int4, fp8, or auto. auto keeps a quantized source's
precision (what a user who picked a Q4 GGUF file expects): a GGUF converted from 4-bit blocks is
served int4 in groups of 32 (GGUF's block size, so Q4_0/Q4_1 are reproduced exactly), one of
5, 6 or 8 bits int8; any other source is served as it is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import UnsupportedModel

CHOICES = ("auto", "none", "int8", "int4", "fp8")
FORMATS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP = 64
GGUF_BLOCK = 32
# Written by the GGUF converter into config.json: the quantized type most of the source's
# matrices had.
SOURCE_KEY = "duet_gguf_weights"
_GGUF_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")
# What each engine serves; MLX has no fp8 format of its own.
_ENGINE_FORMATS = {"torch": FORMATS, "mlx": ("int8", "int4")}


@dataclass(frozen=True)
class Quantization:
    format: str
    group_size: int = DEFAULT_GROUP  # int4 (and MLX's int8): inputs per scale
    reason: str = "asked for"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not '{self.format}'")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size must be one of {GROUP_SIZES}, not {self.group_size}")

    def describe(self) -> str:
        fmt = f"int4, groups of {self.group_size}" if self.format == "int4" else self.format
        return f"{fmt} ({self.reason})"


def source_format(config: dict) -> str | None:
    """The GGUF quantized type the model was converted from, if any."""
    value = config.get(SOURCE_KEY)
    return value if isinstance(value, str) else None


def resolve(requested: str, config: dict, engine: str) -> Quantization | None:
    """The quantization to serve in, or None for the stored weights as they are."""
    if requested not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not '{requested}'")
    if "quantization" in config or "quantization_config" in config:
        # Already quantized on disk (an mlx-lm or a Hugging Face quantized checkpoint).
        return None
    if requested == "none":
        return None
    if requested == "auto":
        gguf = source_format(config)
        if gguf is None:
            return None
        fmt = "int4" if gguf in _GGUF_FOUR_BIT else "int8"
        quant = Quantization(fmt, GGUF_BLOCK, reason=f"kept from the GGUF's {gguf}")
    else:
        quant = Quantization(requested)
    if quant.format not in _ENGINE_FORMATS[engine]:
        raise UnsupportedModel(f"the {engine} engine has no {quant.format} weights "
                               f"(it serves {', '.join(_ENGINE_FORMATS[engine])})")
    return quant
