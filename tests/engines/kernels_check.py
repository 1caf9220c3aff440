"""Run by test_cuda_kernels.py in a subprocess with TRITON_INTERPRET=1: Triton's interpreter
runs the CUDA path's kernels (decode attention, SiLU * up) on the CPU (the flag must be set
before a kernel is defined, so it cannot share the test process). Exits non-zero on a
mismatch."""

from __future__ import annotations

import functools
import os
import sys

import torch

from engines.torch_engine import runner as runners
from engines.torch_engine.config import ModelArgs
from engines.torch_engine.decode_attention import decode_attention
from engines.torch_engine.loader import random_model
from engines.torch_engine.silu_mul import silu_mul

CASES = [  # heads, kv heads, head dim, bucket, position, window
    (8, 2, 64, 256, 0, 0), (8, 2, 64, 256, 255, 0), (14, 2, 64, 512, 300, 0),
    (4, 4, 16, 16, 9, 0), (8, 2, 64, 512, 400, 100), (32, 8, 128, 256, 129, 0),
]


def reference(q, k, v, pos: int, window: int):
    h, kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kv, 1).float()
    v = v.repeat_interleave(h // kv, 1).float()
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    slots = torch.arange(k.shape[2], device=q.device)
    ok = slots <= pos
    if window:
        ok &= slots > pos - window
    return torch.softmax(scores.masked_fill(~ok, float("-inf")), -1) @ v


def check_op(dtypes=((torch.float32, 1e-5), (torch.float16, 2e-3)), device="cpu") -> None:
    """The op against plain attention: GQA groups of 1, 4 and 7, head dims 16 to 128, the
    first and last slot of a bucket, a bucket shorter than one block, a sliding window, and
    K/V that are a slice of a longer cache (the strides the model passes)."""
    torch.manual_seed(0)
    for dtype, tol in dtypes:
        for h, kv, d, bucket, pos, window in CASES:
            cache_k = torch.randn(1, kv, 1024, d, dtype=dtype, device=device)
            cache_v = torch.randn(1, kv, 1024, d, dtype=dtype, device=device)
            q = torch.randn(1, h, 1, d, dtype=dtype, device=device)
            k, v = cache_k[:, :, :bucket], cache_v[:, :, :bucket]
            out = decode_attention(q, k, v, torch.tensor([pos], device=device), window)
            assert out.shape == q.shape and out.dtype == dtype
            err = (out.float() - reference(q, k, v, pos, window)).abs().max().item()
            assert err < tol, (dtype, h, kv, d, bucket, pos, window, err)


def check_silu_mul(dtypes=((torch.float32, 1e-6), (torch.float16, 1e-3)), device="cpu") -> None:
    """One row (decode) and many (prefill), a width that is not a multiple of the block."""
    torch.manual_seed(0)
    for dtype, tol in dtypes:
        for shape in ((1, 1, 2 * 1500), (1, 7, 2 * 64)):
            x = torch.randn(shape, dtype=dtype, device=device) * 4
            gate, up = x.float().chunk(2, dim=-1)
            out = silu_mul(x)
            assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
            torch.testing.assert_close(
                out.float(), torch.nn.functional.silu(gate) * up, rtol=tol, atol=tol
            )


def check_model(window: int | None) -> None:
    """A whole static decode with the kernels equals the PyTorch-op path (itself checked
    against transformers), through prefill and 30 steps that cross attention buckets 16, 32,
    64."""
    runners.MIN_DECODE_BUCKET = 16
    args = ModelArgs.from_hf(dict(
        model_type="mistral" if window else "llama", vocab_size=64, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, sliding_window=window, tie_word_embeddings=False,
    ))
    torch.manual_seed(1)
    model = random_model(args, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Large Q/K weights make attention peaked, so a wrong weight on any slot shows.
            p.normal_(0, 0.5 if "qkv_proj" in name else 0.08)
    model.setup_cache(64)
    prompt = [5, 9, 1, 33, 7, 2, 60, 4, 8, 11, 3]
    traces = []
    for kernel in (False, True):
        model.use_kernels(attention=kernel, activation=kernel)
        runner = runners.StaticRunner(model, "cpu", compile=False)
        with torch.no_grad():
            logits = runner.prefill(prompt)
            steps = [logits]
            for pos in range(len(prompt), len(prompt) + 30):
                logits = runner.decode(logits.argmax().view(1), pos)
                steps.append(logits)
        traces.append(torch.stack(steps))
    torch.testing.assert_close(traces[1], traces[0], atol=1e-5, rtol=1e-4)

    # The CUDA runner's step (decode + greedy pick, kernels as opaque ops) must trace as one
    # graph with the attention bucket dynamic, and compute what the eager step computes.
    runner = runners.StaticRunner(model, "cpu", compile=False)
    step = torch.compile(
        functools.partial(runners.CudaGraphRunner._decode_and_pick, runner),
        fullgraph=True, dynamic=True, backend="aot_eager",
    )
    with torch.no_grad():
        runner.prefill(prompt)
        token = torch.tensor([[7]])
        for kv_len in (16, 32):
            logits, pick = step(token, runner._pos, kv_len)
            expected = runner._decode_impl(token, runner._pos, kv_len)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
            assert pick.tolist() == [int(expected.argmax())]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (or on CUDA)"
    check_op()
    check_silu_mul()
    check_model(window=None)
    check_model(window=8)
    print("kernels: ok")
    sys.exit(0)
