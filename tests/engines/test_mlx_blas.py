"""MLX's CPU products in an optimized BLAS (engines/mlx_blas.py): which library libmlx's GEMM
binds to, as the dynamic linker reports it, with the system's OpenBLAS and without it."""

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="the mlx extra is installed by scripts/setup.sh")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's loader")
ROOT = Path(__file__).resolve().parents[2]

# A product large enough for MLX to hand to BLAS, checked against numpy's.
PRODUCT = """
import numpy as np
from engines import mlx_blas
print("loaded", mlx_blas.preload())
import mlx.core as mx
a, b = np.random.default_rng(0).standard_normal((2, 96, 80), dtype=np.float32)
got = np.array(mx.array(a) @ mx.array(b.T))
print("error", float(np.abs(got - a @ b.T).max()))
"""


def run_product(first: str = "", **env) -> tuple[str, str]:
    """The product's printout, and the file libmlx's cblas_sgemm was bound to."""
    done = subprocess.run([sys.executable, "-c", first + PRODUCT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "LD_DEBUG": "bindings", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    binding = [line for line in done.stderr.splitlines()
               if "libmlx" in line and line.endswith("`cblas_sgemm'")]
    assert len(binding) == 1, binding
    error = float(done.stdout.split("error")[1])
    assert error < 1e-3
    return done.stdout, binding[0].split(" to ")[1]


@pytest.mark.skipif(not ctypes.util.find_library("openblas"), reason="no OpenBLAS installed")
def test_mlx_multiplies_in_the_systems_openblas():
    out, bound = run_product()
    assert "loaded libopenblas" in out
    assert "libopenblas" in bound


def test_without_it_mlx_keeps_its_own_blas_and_the_same_products():
    """DUET_MLX_BLAS=reference (as on a machine without OpenBLAS): MLX's bundled BLAS."""
    out, bound = run_product(DUET_MLX_BLAS="reference")
    assert "loaded None" in out
    assert "mlx_cpu.libs/libblas" in bound


def test_too_late_once_mlx_is_loaded():
    """In a process that imported mlx.core first, libmlx's symbols are bound already: preload
    loads nothing (and the load's log line says so) rather than a library MLX will not use."""
    out, bound = run_product(first="import mlx.core\n")
    assert "loaded None" in out
    assert "mlx_cpu.libs/libblas" in bound
