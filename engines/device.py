"""The one place that decides which torch device and dtype to use, and how to read its memory."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import psutil

from .generation import MemoryMeter

MPS_FALLBACK_ENV = "PYTORCH_ENABLE_MPS_FALLBACK"

log = logging.getLogger("duet.engines.device")


def choose_device(requested: str = "auto") -> str:
    """mps, then cuda, then cpu; an explicit request that cannot be met is an error."""
    import torch

    if requested == "auto":
        if torch.backends.mps.is_available():
            return "mps"
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' was requested but torch.backends.mps is not available")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{requested}' was requested but CUDA is not available")
    if requested not in ("cpu", "mps") and not requested.startswith("cuda"):
        raise ValueError(f"unknown device '{requested}' (use auto, cpu, cuda or mps)")
    return requested


def cuda_visible(dev: Path = Path("/dev"), env: Mapping[str, str] = os.environ) -> bool:
    """Whether NVIDIA's driver shows this process a GPU, read from its device files without
    importing torch (seconds): a guess for work that may start before choose_device decides (an
    engine's process), never the decision (a CPU-only torch build sees no GPU here)."""
    if env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return (dev / "nvidiactl").exists()


def choose_dtype(requested: str, device: str) -> str:
    """bf16 on CUDA, fp16 on MPS (bf16 MPS kernels need a recent macOS), fp32 on CPU (an
    encoder's products are many rows: float32 is fast and exact there)."""
    if requested != "auto":
        return requested
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "mps":
        return "float16"
    return "float32"


def choose_decode_dtype(requested: str, device: str) -> str:
    """A generating engine's dtype: as choose_dtype, but bf16 on the CPU too. Decode reads every
    weight once per token, and bf16 reads half of float32's bytes: on an AVX2-only EPYC the
    default model decodes 25.2 tok/s unquantized against 13.3 in float32, and 36 against 32.5
    with its int4 weights (whose kernels compute in bf16 either way). Prefill stays float32
    where bf16 products of many rows are slow (cpu_linear.WidenedLinear)."""
    if requested == "auto" and device == "cpu":
        return "bfloat16"
    return choose_dtype(requested, device)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def mps_fallback_enabled() -> bool:
    return os.environ.get(MPS_FALLBACK_ENV) == "1"


def configure_mps(memory_fraction: float | None) -> None:
    """Apply the MPS settings and say at start-up how ops without an MPS kernel will behave."""
    import torch

    if memory_fraction is not None:
        # Unified memory is shared with the whole system: cap what this process may take.
        torch.mps.set_per_process_memory_fraction(memory_fraction)
        log.info("MPS memory capped at %.0f%% of the recommended maximum", memory_fraction * 100)
    if mps_fallback_enabled():
        log.warning(
            "%s=1: ops without an MPS kernel run on the CPU, each costing a sync and copies",
            MPS_FALLBACK_ENV,
        )
    else:
        log.info(
            "%s is not set: an op without an MPS kernel fails instead of running on the CPU",
            MPS_FALLBACK_ENV,
        )


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


@functools.cache
def cuda_multiprocessors(index: int) -> int:
    """The SMs of CUDA device `index` (a kernel sizes its grid to them)."""
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """CUDA device `index`'s compute capability (9.0: Hopper)."""
    import torch

    return torch.cuda.get_device_capability(index)


def free_memory_bytes(device: str) -> int | None:
    """Memory free for the KV cache on the device, now (after the weights loaded). On CUDA
    what the driver has free plus what this process's allocator holds unused: blocks freed
    since, such as a quantized model's float weights, count as free."""
    import torch

    if device.startswith("cuda"):
        dev = torch.device(device)
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free + max(cached, 0))
    if device == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return int(psutil.virtual_memory().available)


def total_memory_bytes(device: str) -> int:
    """The device's memory: the GPU's, what Metal recommends a process keep to, or the RAM."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    if device == "mps":
        return int(torch.mps.recommended_max_memory())
    return int(psutil.virtual_memory().total)


# The default memory budget's share of it: a dedicated GPU may be filled; unified memory and
# RAM are the whole system's.
BUDGET_SHARE = {"cuda": 0.9, "mps": 0.75, "cpu": 0.75}


def default_memory_budget(device: str) -> int:
    kind = "cuda" if device.startswith("cuda") else device
    return int(total_memory_bytes(device) * BUDGET_SHARE.get(kind, 0.75))


class RSSMeter(MemoryMeter):
    """CPU: the process's resident set, sampled each step (RSS has no resettable peak)."""

    measures = "process RSS, sampled each step"

    def __init__(self) -> None:
        self._proc = psutil.Process(os.getpid())
        self._peak = 0

    def reset(self) -> None:
        self._peak = self._proc.memory_info().rss

    def sample(self) -> None:
        self._peak = max(self._peak, self._proc.memory_info().rss)

    def peak_bytes(self) -> int:
        self.sample()
        return self._peak


class CudaMeter(MemoryMeter):
    measures = "torch CUDA allocator peak"

    def __init__(self, device: str) -> None:
        self._device = device

    def reset(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self._device)

    def peak_bytes(self) -> int:
        import torch

        # Not max_memory_allocated(): it flattens and sorts every allocator statistic in
        # Python, and read after every step that took a tenth of a busy engine's host time
        # (py-spy, H200). The nested statistics are the same numbers.
        stats = torch.cuda.memory_stats_as_nested_dict(self._device)
        return int(stats["allocated_bytes"]["all"]["peak"])


class MPSMeter(MemoryMeter):
    """MPS has no peak counter: sample the allocator each step. Tensors only
    (current_allocated_memory), like CUDA's max_memory_allocated; driver_allocated_memory would
    also count Metal's cached blocks."""

    measures = "torch MPS allocator, sampled each step"

    def __init__(self) -> None:
        self._peak = 0

    def reset(self) -> None:
        import torch

        self._peak = int(torch.mps.current_allocated_memory())

    def sample(self) -> None:
        import torch

        self._peak = max(self._peak, int(torch.mps.current_allocated_memory()))

    def peak_bytes(self) -> int:
        self.sample()
        return self._peak


def memory_meter(device: str) -> MemoryMeter:
    if device.startswith("cuda"):
        return CudaMeter(device)
    if device == "mps":
        return MPSMeter()
    return RSSMeter()
