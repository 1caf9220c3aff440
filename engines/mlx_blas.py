"""MLX's CPU backend with an optimized BLAS on Linux (a module apart from the MLX engine's
package, which imports mlx: this must run first). The mlx-cpu wheel links netlib's reference
BLAS (auditwheel bundles it as mlx_cpu.libs/libblas-*.so.3.10.0), whose float32 GEMM ran at
1-3 GFLOP/s on a 2-core AVX2 EPYC: the default model's vocabulary projection of a 36-token
prompt took 1.7-2.4 s, and OpenBLAS did it in 0.06 s. A BLAS loaded into the process's global
scope before libmlx is searched first for the cblas_* and Fortran symbols that libmlx and its
bundled LAPACK call, so MLX's products run in it. macOS has MLX on Accelerate and the GPU,
CUDA on cuBLAS: only Linux's CPU products change."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# ctypes.util.find_library's names, tried in order (Debian/Ubuntu: libopenblas0 provides it).
LIBRARIES = ("openblas",)
# "reference" keeps MLX's own BLAS (to compare, or where a system BLAS misbehaves).
ENV = "DUET_MLX_BLAS"


@functools.cache
def preload() -> str | None:
    """Load the first optimized BLAS found into the global scope, once; its file name, or None
    where MLX keeps its own (not Linux, none installed, or DUET_MLX_BLAS=reference). Must run
    before mlx.core is first imported: libmlx's symbols are bound as it loads."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV) == "reference":
        return None
    if "mlx.core" in sys.modules:  # too late to come first: say so rather than pretend
        return None
    for name in LIBRARIES:
        found = ctypes.util.find_library(name)
        if not found:
            continue
        try:
            ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return found
    return None


def described() -> str:
    """What MLX's CPU products run in, for the load's log line."""
    if not sys.platform.startswith("linux"):
        return "the platform's BLAS"
    found = preload()
    if found:
        return found
    return ("MLX's bundled reference BLAS (slow: install OpenBLAS, e.g. apt-get install "
            "libopenblas0, for faster CPU products)")
