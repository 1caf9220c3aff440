"""The Triton kernels of the CUDA path (decode attention, SiLU * up, the nucleus border): on
this CPU through Triton's interpreter, on a GPU (where there is one) compiled, in bfloat16
too."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)


@needs_triton
def test_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.engines.kernels_check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernels: ok" in done.stdout


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_cuda():
    from tests.engines.kernels_check import check_model, check_op, check_silu_mul

    check_op(((torch.bfloat16, 2e-2), (torch.float32, 1e-5)), device="cuda")
    check_silu_mul(((torch.bfloat16, 1e-2), (torch.float32, 1e-6)), device="cuda")
    check_borders(device="cuda")
    check_model(window=None, device="cuda")
    check_model(window=8, device="cuda")


def test_model_refuses_the_kernels_without_triton(monkeypatch, tiny_dirs):
    from engines.torch_engine import decode_attention
    from engines.torch_engine.loader import load_model

    model = load_model(tiny_dirs["llama"][0], torch.float32, "cpu")
    model.setup_cache(32)
    monkeypatch.setattr(decode_attention, "triton", None)
    with pytest.raises(RuntimeError, match="Triton"):
        model.use_kernels(attention=True)
    with pytest.raises(RuntimeError, match="Triton"):
        model.use_kernels(attention=False, activation=True)
    model.use_kernels(attention=False)  # the PyTorch-op path needs nothing
