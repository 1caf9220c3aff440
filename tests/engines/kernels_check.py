"""Run by test_cuda_kernels.py in a subprocess with TRITON_INTERPRET=1: Triton's interpreter
runs the CUDA path's kernels (paged decode attention, SiLU * up, the nucleus border, the
tensor-parallel peer sum, alone or with the next norm, and gather) on the CPU (the flag must
be set before a kernel is defined, so it cannot share the test process); on a GPU the same
checks run compiled. Exits non-zero on a mismatch."""

from __future__ import annotations

import os
import sys

import torch

from engines.base import SamplingParams, Step
from engines.runtime.runtime import Runtime, Submission
from engines.torch_engine.config import ModelArgs
from engines.torch_engine.decode_attention import paged_decode_attention
from engines.torch_engine.silu_mul import silu_mul

CASES = [  # heads, kv heads, head dim, positions of the rows, kv_len, window
    (8, 2, 64, [0, 255, 17], 256, 0), (14, 2, 64, [300, 5], 512, 0), (4, 4, 16, [9], 16, 0),
    (8, 2, 64, [400, 99, 250], 512, 100), (16, 4, 128, [129, 1, 63, 64], 256, 0),
    (8, 2, 32, [40, 0, 63], 64, 0), (8, 2, 32, [40, 7], 64, 16),  # one slice a head
]
PAGE = 16


def reference(q, k_pool, v_pool, table, pos, window):
    """Row by row: gather the row's positions 0..pos from its pages, plain attention."""
    out = []
    h, kv = q.shape[1], k_pool.shape[1]
    for b, p in enumerate(pos):
        j = torch.arange(p + 1)
        if window:
            j = j[j > p - window]
        slots = table[b, j // PAGE] * PAGE + j % PAGE
        k = k_pool[slots].float().transpose(0, 1).repeat_interleave(h // kv, 0)  # [H, L, D]
        v = v_pool[slots].float().transpose(0, 1).repeat_interleave(h // kv, 0)
        scores = q[b].float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [H, 1, L]
        out.append(torch.softmax(scores, dim=-1) @ v)
    return torch.stack(out)


def check_op(dtypes=((torch.float32, 1e-5), (torch.float16, 2e-3)), device="cpu") -> None:
    """Rows of different lengths over shuffled pages of one pool: the first and last position
    of a bucket, a single position, a sliding window, one slice and many. The kernel rotates
    each row's query and key as the model does, writes the key and value at the row's slot
    (and nothing else), and leaves its counters at zero."""
    from engines.torch_engine.model import apply_rope

    torch.manual_seed(0)
    for dtype, tol in dtypes:
        for h, kv, d, pos, kv_len, window in CASES:
            pages = kv_len // PAGE + 1
            n_pages = pages * len(pos) + 3
            k_pool = torch.randn(n_pages * PAGE, kv, d, dtype=dtype, device=device)
            v_pool = torch.randn(n_pages * PAGE, kv, d, dtype=dtype, device=device)
            table = torch.randperm(n_pages, device=device)[: pages * len(pos)].view(len(pos), pages)
            qkv = torch.randn(len(pos), (h + 2 * kv) * d, dtype=dtype, device=device)
            angles = torch.rand(len(pos), d // 2, device=device) * 6
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            # Positions, slots and tables as strided views of one buffer, as the CUDA graphs
            # pass them.
            packed = torch.zeros(len(pos), 3 + pages, dtype=torch.long, device=device)
            packed[:, 1], packed[:, 3:] = torch.tensor(pos, device=device), table
            p, table = packed[:, 1], packed[:, 3:]
            packed[:, 2] = table.gather(1, p[:, None] // PAGE)[:, 0] * PAGE + p % PAGE
            slots = packed[:, 2]
            counters = torch.zeros(len(pos) * kv + 5, dtype=torch.int32, device=device)
            qk = apply_rope(qkv[:, : (h + kv) * d].view(len(pos), h + kv, d).float(),
                            cos[:, None].float(), sin[:, None].float()).to(dtype)
            q, k = qk[:, :h, None], qk[:, h:]
            v = qkv[:, (h + kv) * d:].view(len(pos), kv, d)
            k_want, v_want = k_pool.clone(), v_pool.clone()
            k_want[slots], v_want[slots] = k, v
            out = paged_decode_attention(qkv, cos, sin, k_pool, v_pool, table, p, slots,
                                         counters, kv_len, PAGE, window)
            assert out.shape == (len(pos), h, d) and out.dtype == dtype
            others = torch.ones(k_pool.shape[0], dtype=torch.bool, device=device)
            others[slots] = False
            assert torch.equal(k_pool[others], k_want[others])  # nothing else written
            assert torch.equal(v_pool, v_want)
            torch.testing.assert_close(k_pool[slots], k_want[slots], rtol=tol, atol=tol)
            assert not counters.any()
            expected = reference(q.cpu(), k_want.cpu(), v_want.cpu(), table.cpu(), pos, window)
            assert len(pos) == 1 or not p.is_contiguous()
            err = (out[:, :, None].float().cpu() - expected).abs().max().item()
            assert err < tol, (dtype, h, kv, d, pos, kv_len, window, err)


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


def _int4_case(n: int, k: int, group: int, m: int):
    """A random [n, k] weight quantized to int4 (q, bfloat16 scales and zeros), its
    dequantized reference, and m rows of activations."""
    from engines.torch_engine import quant

    q, scale, zero = quant.quantize_int4(torch.randn(n, k) * 0.05, group)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    ref = quant.dequantize_int4(q, scale.float(), zero.float(), group)
    return q, scale, zero, ref, torch.randn(m, k).to(torch.bfloat16)


def _within_rounding(got: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, case) -> None:
    """got = x @ ref^T within bfloat16's rounding of each weight and of the result."""
    assert got.shape == (x.shape[0], ref.shape[0]) and got.dtype == torch.bfloat16
    want = x.float() @ ref.t()
    bound = (x.float().abs() @ ref.abs().t()) * 2 ** -7 + want.abs() * 2 ** -7 + 1e-6
    worst = ((got.float() - want).abs() / bound).max().item()
    assert worst <= 1, (*case, worst)


def check_int4_mm(device: str = "cpu") -> None:
    """The int4 kernel against quant.py's dequantized weight: one row and a few (split-K, the
    decode plan), many (the prefill plan), GGUF's groups of 32 and groups of 64 and 128,
    columns that are not a multiple of the tile. Within bfloat16's rounding of each weight and
    of the result (the interpreter rounds float32 to 16 bits toward zero)."""
    from engines.torch_engine import int4_kernel

    torch.manual_seed(0)
    for n, k, group, m in ((64, 128, 64, 1), (96, 256, 32, 3), (80, 512, 64, 20),
                           (64, 1024, 128, 5), (4096, 512, 64, 1),
                           (72, 128, 32, int4_kernel.DEQUANT_ROWS + 1)):
        q, scale, zero, ref, x = _int4_case(n, k, group, m)
        got = torch.ops.duet.int4_mm(x.to(device), int4_kernel.pack(q).to(device),
                                     scale.t().contiguous().to(device),
                                     zero.t().contiguous().to(device), group).cpu()
        _within_rounding(got, x, ref, (n, k, group, m))
        if m > int4_kernel.DEQUANT_ROWS:  # the weight dequantized whole: its exact values
            whole = int4_kernel.dequantize(int4_kernel.pack(q).to(device),
                                           scale.t().contiguous().to(device),
                                           zero.t().contiguous().to(device), group).cpu()
            assert whole.shape == (k, n)
            assert ((whole.float() - ref.t()).abs() <= ref.t().abs() * 2 ** -7).all()


def check_int4_tiny(device: str = "cpu") -> None:
    """The int4 kernel reading tinygemm's words (int4_mm_tiny) against quant.py's dequantized
    weight, as check_int4_mm; on a GPU the words tiny_pack makes are ATen's own."""
    from engines.torch_engine import int4_kernel

    torch.manual_seed(0)
    for n, k, group, m in ((64, 128, 64, 2), (96, 256, 32, 3), (80, 512, 64, 20),
                           (64, 1024, 128, 5), (40, 512, 256, 16),
                           (72, 256, 32, int4_kernel.TINY_DEQUANT_ROWS),
                           (72, 256, 32, int4_kernel.TINY_DEQUANT_ROWS + 1)):
        q, scale, zero, ref, x = _int4_case(n, k, group, m)
        packed = int4_kernel.tiny_pack(q)
        if device != "cpu":
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
            assert torch.equal(torch._convert_weight_to_int4pack(pairs, 8).cpu(), packed)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(device)
        got = torch.ops.duet.int4_mm_tiny(x.to(device), packed.to(device), sz, group).cpu()
        _within_rounding(got, x, ref, (n, k, group, m))
        if m > int4_kernel.TINY_DEQUANT_ROWS:
            whole = int4_kernel.dequantize_tiny(packed.to(device), sz, group).cpu()
            assert whole.shape == (k, n)
            assert ((whole.float() - ref.t()).abs() <= ref.t().abs() * 2 ** -7).all()


def check_int4_cuda_layer() -> None:
    """An int4 layer of tinygemm's words on a GPU: a few rows through tinygemm, more through
    int4_mm_tiny, each what the layer dequantized computes."""
    from engines.torch_engine import quant

    torch.manual_seed(2)
    linear = torch.nn.Linear(512, 96, bias=True).to(torch.bfloat16)
    slow = quant.Int4Linear(linear, "dequant", 64)
    few = quant.TINYGEMM_ROWS
    x = torch.randn(few + 4, 512).to(torch.bfloat16)
    want = slow(x)
    fast = quant.Int4Linear(linear.to("cuda"), "cuda", 64)  # tinygemm's packing: CUDA only
    tol = 0.02 * want.float().abs().max().item()
    for rows in (1, few, few + 1, few + 4):
        got = fast(x[:rows].to("cuda")).cpu()
        assert (got.float() - want[:rows].float()).abs().max().item() <= tol, rows


def check_int4_layer(device: str = "cpu") -> None:
    """An int4 layer on the kernel computes what the same layer dequantized computes, and a
    row the same bits alone as beside others (a request's tokens must not depend on its
    batch)."""
    from engines.torch_engine import quant

    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    slow = quant.Int4Linear(linear, "dequant", 64)
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = slow(x)  # before the layers' shared bias moves to the device with the fast one
    fast = quant.Int4Linear(linear, "triton", 64).to(device)
    got = fast(x.to(device)).cpu()
    assert got.shape == (3, 96) and got.dtype == torch.bfloat16
    tol = 0.02 * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(fast(x[:1].to(device)).cpu(), got[:1])


def check_fp8_mm(device: str = "cpu") -> None:
    """The fp8 kernel against the same fp8 operands multiplied in float32: 16 rows and more
    (16- and 64-row tiles), split-K and not, columns that are not a multiple of the tile.
    e4m3 products are exact in float32; only the sums (their order, and on Hopper their
    precision) and the result's rounding differ (the interpreter rounds float32 to 16 bits
    toward zero: within 2**-7)."""
    from engines.torch_engine import fp8_kernel, quant

    torch.manual_seed(0)
    # Many columns: a layer's width on the GPU; a quarter of it in the interpreter, which runs
    # the programs one after another (the 4,096 took 14 of this check's 17 s there).
    wide = 4096 if device != "cpu" else 1024
    for n, k, m in ((64, 128, 16), (96, 256, 3), (80, 512, 20), (wide, 512, 16),
                    (200, 384, 64), (72, 128, fp8_kernel.MAX_ROWS)):
        w8, scale = quant.quantize_fp8(torch.randn(n, k) * 0.05)
        x8, x_scale = quant.quantize_rows(torch.randn(m, k).to(torch.bfloat16))
        exact = (x8.float() * x_scale) @ quant.dequantize_fp8(w8, scale).t()
        # Hopper's tensor cores sum fp8 products in about 14 bits between the kernel's
        # promotions to float32 (every 128 inputs): 2**-12 of the magnitudes there, float32's
        # 2**-14 in the interpreter.
        sums = 2 ** -14 if device == "cpu" else 2 ** -12
        bound = exact.abs() * 2 ** -7 + ((x8.float() * x_scale).abs() @ quant.dequantize_fp8(
            w8, scale).abs().t()) * sums + 1e-6
        p = fp8_kernel.plan(m, n, k)
        args = [t.to(device) for t in (x8, x_scale, w8, scale)]
        for split in (1, 2) if k % (2 * p.block_k) == 0 else (1,):
            got = fp8_kernel.launch(*args, fp8_kernel.Plan(p.block_m, p.block_n, p.block_k,
                                                            split, p.warps, p.stages)).cpu()
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            assert ((got.float() - exact).abs() <= bound).all(), (n, k, m, split)
        assert torch.equal(torch.ops.duet.fp8_mm(*args).cpu(), fp8_kernel.launch(*args, p).cpu())


def check_quantize_rows(device: str = "cpu") -> None:
    """The fused quantization of a prefill's activations gives quant.quantize_rows' scales and
    e4m3 values bit for bit: rows of values the format holds exactly (each row's largest 448
    times its scale), a row of zeros, rows longer than the kernel's block; and on a GPU random
    rows too (Triton's interpreter rounds float32 to e4m3 wrongly where the rounding carries into
    the exponent: 124.9 -> 64). Its int8 form gives quant.quantize_rows' int8 values, random rows
    (halves rounded to even among them) and zeros."""
    from engines.torch_engine import quant, row_quant

    torch.manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    rows = grid[torch.randint(len(grid), (4, 2500))]
    rows[:, 0] = 448.0
    rows = rows * torch.tensor([2.0 ** -10, 0.25, 1.0, 2.0 ** 6])[:, None]
    cases = [rows.to(torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)]
    if device != "cpu":
        cases.append((torch.randn(7, 4096) * torch.logspace(-3, 2, 7)[:, None]).to(torch.bfloat16))
    for x in cases:
        got8, got_scale = row_quant.quantize_rows(x.to(device), "fp8")
        want8, want_scale = quant.quantize_rows(x)
        assert torch.equal(got_scale.cpu(), want_scale)
        assert torch.equal(got8.cpu().view(torch.uint8), want8.view(torch.uint8))
    halves = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.0]])
    for x in (halves.to(torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16),
              (torch.randn(5, 2500) * torch.logspace(-3, 2, 5)[:, None]).to(torch.bfloat16)):
        got8, got_scale = row_quant.quantize_rows(x.to(device), "int8")
        want8, want_scale = quant.quantize_rows(x, "int8")
        assert torch.equal(got_scale.cpu(), want_scale)
        assert torch.equal(got8.cpu(), want8)
    assert quant.quantize_rows(halves.to(torch.bfloat16), "int8")[0][0, 1:7].tolist() == [
        0, 2, 2, 0, -2, -2]  # torch.round: halves to even


def check_scale_products(device: str = "cpu") -> None:
    """int8's product scaled back in one kernel gives Int8Linear's torch expression bit for
    bit, in bfloat16 and float32 (its scale is the weight's dtype), for a size that is not a
    multiple of the kernel's block. (Triton's interpreter cuts float32 to bfloat16 where the GPU
    rounds to nearest: there within one bfloat16 step, the float32 results still exact.)"""
    from engines.torch_engine import row_quant

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        acc = torch.randint(-2**20, 2**20, (19, 333), dtype=torch.int32)
        x_scale = torch.rand(19, 1) * 0.01
        scale = (torch.rand(333) * 0.01).to(dtype)
        want = (acc.float() * x_scale * scale.float()).to(dtype)
        got = row_quant.scale_products(acc.to(device), x_scale.to(device), scale.to(device), dtype)
        assert got.dtype == dtype
        if device == "cpu" and dtype == torch.bfloat16:
            step = want.float().abs() * 2.0 ** -7
            assert ((got.float() - want.float()).abs() <= step).all()
        else:
            assert torch.equal(got.cpu(), want)


def check_fp8_layer(device: str = "cpu") -> None:
    """An fp8 layer on the kernel computes what torch._scaled_mm's path computes from the same
    quantized activations, within the activations' fp8 rounding of the dequantized layer, and
    a row the same bits in a batch of 3 or 17 as beside others (a few rows take the kernel
    too, not the weight read)."""
    from engines.torch_engine import quant

    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    slow = quant.FP8Linear(linear, "dequant", tensor_cores=False)
    x = torch.randn(20, 256).to(torch.bfloat16)
    want = slow(x)
    fast = quant.FP8Linear(linear, "triton", tensor_cores=True).to(device)
    got = fast(x.to(device)).cpu()
    assert got.shape == (20, 96) and got.dtype == torch.bfloat16
    tol = 0.08 * want.float().abs().max().item()  # e4m3 activations: 3 bits of mantissa
    assert (got.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(fast(x[:17].to(device)).cpu(), got[:17])
    assert torch.equal(fast(x[:3].to(device)).cpu(), got[:3])


def check_borders(device="cpu") -> None:
    """Each row's nucleus border found by the kernel's search keeps the tokens the sorted
    ranks keep (sampling._borders), and a draw with it takes the same tokens: top_k alone,
    top_p alone, both, neither, ties at the top and at the border, tokens min_p zeroed, a
    vocabulary that is not a multiple of the kernel's block."""
    import math

    from engines.torch_engine.nucleus_kernel import BLOCK, borders
    from engines.torch_engine.sampling import Sampler, _borders, probabilities

    torch.manual_seed(0)
    # Cases 0-5 hold every setting below once (ties, rounding, min_p, each top_k); the
    # interpreter takes 8x as long a case over three blocks as over 1000 tokens.
    for v, cases in ((1000, 12), (2 * BLOCK + 37, 6)):
        for case in range(cases):
            rows = 4
            logits = torch.randn(rows, v, device=device) * (0.3 + case)
            if case % 3 == 0:
                logits[:, :50] = logits.max()  # 50 tied likeliest tokens
            if case % 4 == 0:
                logits = (logits * 2).round()  # ties all the way down
            top_p = torch.tensor([[1.0], [0.95], [0.3], [0.999]], device=device)
            k = [v, 40, 1, v // 2, 2, v][case % 6]
            floats = torch.cat([torch.full((rows, 1), 0.7, device=device),
                                torch.full((rows, 1), math.log(0.05) if case % 5 == 0
                                           else -math.inf, device=device), top_p], dim=1)
            ints = torch.tensor([[case, 3, k]] * rows, device=device)
            probs = probabilities(logits, floats)
            ranks = torch.sort(probs, dim=-1, descending=True).values
            expected = probs >= _borders(ranks, floats, ints, None)[0]
            got = probs >= borders(probs, floats, ints)
            assert torch.equal(got, expected), (v, case, got.sum(1), expected.sum(1))
            sorted_draw = Sampler(captured=True)(logits, floats, ints, v)
            searched_draw = Sampler(captured=True, borders=borders)(logits, floats, ints, v)
            assert torch.equal(sorted_draw, searched_draw), (v, case)
    # A row of a model gone to NaN (a NaN's bits are 0x7FFFFFFF on the GPU) beside zeros (masked
    # tokens): the search ends (its midpoint once wrapped in int32, and the kernel ran for ever).
    probs = torch.rand(2, 1000, device=device) / 1000
    probs.view(torch.int32)[0, 5] = 0x7FFFFFFF
    probs[0, 7] = 0.0
    floats = torch.tensor([[1.0, -math.inf, 0.9]] * 2, device=device)
    found = borders(probs, floats, torch.tensor([[0, 0, 40]] * 2, device=device)).cpu()
    assert found.shape == (2, 1) and 0 < found[1, 0] < probs[1].max().cpu()


def tiny_engine(window: int | None, device: str):
    """A TorchEngine over a small random model, without loading files."""
    from engines.generation import MemoryMeter
    from engines.runtime.kv import BlockPool
    from engines.torch_engine.engine import TorchEngine
    from engines.torch_engine.loader import random_model
    from engines.torch_engine.paged import PagedKV
    from tests.engines.helpers import ByteTokens

    args = ModelArgs.from_hf(dict(
        model_type="mistral" if window else "llama", vocab_size=64, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, sliding_window=window, tie_word_embeddings=False,
    ))
    torch.manual_seed(1)
    engine = TorchEngine.__new__(TorchEngine)
    engine.model = random_model(args, torch.float32, device)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            # Large Q/K weights make attention peaked, so a wrong weight on any slot shows.
            p.normal_(0, 0.5 if "qkv_proj" in name else 0.08)
    engine.device, engine.context_length = device, 128
    engine.model.setup_rope(128)
    engine.kv = PagedKV(2, 40, PAGE, 2, 16, torch.float32, device)
    engine.init_runtime(BlockPool(40, PAGE), max_batch=4, max_prefill_tokens=64)
    engine.tokenizer = ByteTokens()
    engine.meter = MemoryMeter()
    engine.name = "torch"
    return engine


def check_model(window: int | None, device: str = "cpu") -> None:
    """A batch decoded with the kernels gives the tokens the PyTorch-op path gives (itself
    checked against transformers), rows of mixed lengths crossing pages."""
    prompts = [[5, 9, 1, 33, 7, 2, 60, 4, 8, 11, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8] * 7]
    # 14 new tokens: the rows still cross a page (11 + 14 > 16, 56 + 14 > 64) and the window,
    # and the longest row's attention a slice of positions (decode_attention.SPLIT_LEN).
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    traces = []
    for kernel in (False, True):
        engine = tiny_engine(window, device)
        engine.model.use_kernels(attention=kernel, activation=kernel)
        engine.decoder = None
        runtime = Runtime(engine)
        got = {i: [] for i in range(len(prompts))}

        def emit_to(i):
            def emit(event):
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Step):
                    got[i].append(event.token_id)
            return emit

        for i, p in enumerate(prompts):
            runtime.add(Submission(p, params, emit_to(i)))
        while runtime.has_work:
            runtime.step()
        traces.append(got)
    assert traces[0] == traces[1], traces


def peer_buffers(world: int, elements: int, device: str):
    """world ranks' empty buffers of `elements` int16 in one process, and their addresses as
    the peer ops take them."""
    from engines.torch_engine import peer_sum as ps

    bufs = [torch.full((elements,), ps.EMPTY, dtype=torch.int16, device=device)
            for _ in range(world)]
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)


def check_peer_sum(device: str = "cpu") -> None:
    """Two ranks' peer sums in one process, one after the other: rank 1 finds rank 0's part
    already in its buffer (put there as rank 0's kernel would), rank 0 then finds rank 1's,
    sent by rank 1's kernel. Both get the same bits, the rank-order float32 sum; a rank's own
    buffer is empty again after its sum; the other phase is left alone; a negative zero goes
    as a zero (sent as is, it would read as not yet arrived)."""
    from engines.torch_engine import peer_sum as ps

    for dtype in (torch.bfloat16, torch.float16):
        # One program, several, every program (its block grown), and several rounds of the
        # largest block (a prefill's sum).
        for n, phase in ((7, 0), (3 * ps.BLOCK + 5, 1), (ps.MAX_PROGRAMS * ps.BLOCK + 100, 0),
                         (2 * ps.MAX_PROGRAMS * ps.MAX_BLOCK + 9, 1)):
            capacity = n + 3
            bufs, ptrs = peer_buffers(2, ps.buffer_elements(2, capacity), device)
            x = [torch.randn(n, dtype=dtype, device=device) for _ in range(2)]
            x[0][:3] = -0.0
            sent0 = torch.where(x[0] == 0, 0.0, x[0]).to(dtype).view(torch.int16)
            base = phase * 2 * capacity
            bufs[1][base:base + n] = sent0  # rank 0's part, as its kernel writes it
            got1 = torch.ops.duet.peer_sum(x[1], ptrs, 1, capacity, phase)
            got0 = torch.ops.duet.peer_sum(x[0], ptrs, 0, capacity, phase)
            want = (x[0].float() + x[1].float()).to(dtype)
            assert torch.equal(got0.view(torch.int16), got1.view(torch.int16)), (dtype, n)
            # Within one rounding: the interpreter rounds float32 to 16 bits toward zero.
            torch.testing.assert_close(got0, want, atol=0,
                                       rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
            assert (bufs[0] == ps.EMPTY).all(), "rank 0's buffer is not empty after its sum"
            # Rank 1's buffer: empty but for rank 0's second send of its part (a real rank 0
            # sends once; here the first was put by hand).
            rest = bufs[1].clone()
            assert torch.equal(rest[base:base + n], sent0)
            rest[base:base + n] = ps.EMPTY
            assert (rest == ps.EMPTY).all(), "rank 1's buffer is not empty after its sum"
            try:  # more than a slot holds: refused before anything is written
                torch.ops.duet.peer_sum(torch.zeros(capacity + 1, dtype=dtype, device=device),
                                        ptrs, 0, capacity, phase)
            except ValueError:
                pass
            else:
                raise AssertionError("a sum past the buffers' capacity went ahead")


def check_peer_sum_norm(device: str = "cpu") -> None:
    """The peer sum fused with its residual add and the next RMS norm, two ranks in turn as in
    check_peer_sum: both get the same bits, residual + sum (rounded as the unfused step rounds)
    and its norm; a rank's buffer is empty again after. Rows up to FUSED_ROWS take one kernel,
    more take the sum's and then the add and norm's."""
    from engines.torch_engine import peer_sum as ps

    for dtype in (torch.bfloat16, torch.float16):
        for rows, hidden, phase in ((1, 64, 0), (3, 96, 1), (ps.FUSED_ROWS + 1, 48, 1),
                                    (ps.MAX_PROGRAMS + 2, 32, 0)):
            capacity = rows * hidden + 3
            bufs, ptrs = peer_buffers(2, ps.buffer_elements(2, capacity), device)
            x = [torch.randn(rows, hidden, dtype=dtype, device=device) for _ in range(2)]
            x[0][0, :2] = -0.0
            residual = torch.randn(rows, hidden, dtype=dtype, device=device)
            weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
            base = phase * 2 * capacity
            bufs[1][base:base + rows * hidden] = \
                torch.where(x[0] == 0, 0.0, x[0]).to(dtype).view(torch.int16).reshape(-1)
            got = [None, None]
            for rank in (1, 0):
                got[rank] = torch.ops.duet.peer_sum_norm(x[rank], residual, weight, 1e-5, ptrs,
                                                         rank, capacity, phase)
            for a, b in zip(*got):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (dtype, rows)
            total = (x[0].float() + x[1].float()).to(dtype)
            new = (residual.float() + total.float()).to(dtype)
            normed = torch.nn.functional.rms_norm(new.float(), (hidden,), weight.float(),
                                                  1e-5).to(dtype)
            # Within a rounding or two: the interpreter rounds float32 to 16 bits toward zero.
            tol = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -9
            torch.testing.assert_close(got[0][0], new, atol=tol, rtol=tol)
            torch.testing.assert_close(got[0][1], normed, atol=tol, rtol=tol)
            assert (bufs[0] == ps.EMPTY).all(), "rank 0's buffer is not empty after its sum"


def check_peer_gather(device: str = "cpu") -> None:
    """Three ranks' gather to rank 0, in turn: ranks 1 and 2 send and return at once, rank 0
    lays their columns beside its own in rank order; negative zeros arrive as zeros; rank 0's
    buffer is empty after."""
    from engines.torch_engine import peer_sum as ps

    world = 3
    for rows, part in ((1, 7), (3, 2 * ps.BLOCK + 9), (2, ps.MAX_PROGRAMS * ps.BLOCK + 3)):
        capacity = rows * part + 5
        bufs, ptrs = peer_buffers(world, world * capacity, device)
        parts = [torch.randn(rows, part, dtype=torch.bfloat16, device=device)
                 for _ in range(world)]
        parts[1][0, :2] = -0.0
        for rank in (2, 1):
            got = torch.ops.duet.peer_gather(parts[rank], ptrs, rank, capacity)
            assert got.shape == (rows, 0), got.shape
        got = torch.ops.duet.peer_gather(parts[0], ptrs, 0, capacity)
        want = torch.cat(parts, dim=1)
        assert torch.equal(got.float(), want.float()), (rows, part)
        assert not torch.signbit(got[0, part:part + 2]).any(), "a negative zero went as is"
        assert (bufs[0] == ps.EMPTY).all(), "rank 0's buffer is not empty after the gather"
        assert all((b == ps.EMPTY).all() for b in bufs[1:]), "a gather wrote past rank 0"


def check_peer_share(device: str = "cpu") -> None:
    """Rank 0's token ids to ranks 1 and 2 in one process: rank 0 sends and goes on, each other
    rank receives the ids (up to the vocabularies' sizes and past 2**16, whose int16 halves
    may look empty alone), in the phase it is given, and empties what it read; rank 0's buffer
    is never written; the other phase is left alone."""
    from engines.torch_engine import peer_sum as ps

    world, capacity = 3, 2 * ps.SHARE_BLOCK + 5
    bufs, ptrs = peer_buffers(world, ps.PHASES * 2 * capacity, device)
    for phase, n in ((0, 1), (1, capacity), (0, ps.SHARE_BLOCK + 1)):
        ids = torch.randint(0, 200_000, (n,), dtype=torch.int64, device=device)
        ids[0] = 32_768  # low half 0x8000: EMPTY as int16
        assert ps.share(ids, ptrs, 0, capacity, phase) is ids
        other = bufs[1].view(torch.int32)[(1 - phase) * capacity:(2 - phase) * capacity]
        assert (other == ps.EMPTY32).all(), "a share wrote into the other phase"
        for rank in (1, 2):
            got = ps.share(torch.empty(n, dtype=torch.int64, device=device), ptrs, rank,
                           capacity, phase)
            assert torch.equal(got, ids), (rank, phase, n)
        assert all((b == ps.EMPTY).all() for b in bufs), "a buffer is not empty after a share"
    # create_share's own check, rank 0 then rank 1, over their buffers.
    rows = 5
    bufs, ptrs = peer_buffers(2, ps.PHASES * 2 * rows, device)
    assert all(ps.shares_known(ps.PeerShare(ps.PeerBuffers(ptrs, bufs[rank], None), rank, rows),
                                rows, device) for rank in (0, 1))


if __name__ == "__main__":
    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    check_op(device=device)
    check_silu_mul(device=device)
    check_borders(device=device)
    check_int4_mm(device=device)
    check_int4_tiny(device=device)
    check_int4_layer(device=device)
    check_fp8_mm(device=device)
    check_fp8_layer(device=device)
    check_quantize_rows(device=device)
    check_scale_products(device=device)
    if device == "cpu":  # on a GPU, scripts/bench_all_reduce.py checks it over two
        # The interpreter runs a kernel's programs one after another: with 4 programs at most
        # the sums take the same paths as with 256 (one program, several, every one with its
        # block grown, rounds of the largest block, more rows than programs) at a 64th of the
        # work (34 s of this check's 110 were check_peer_sum's).
        from engines.torch_engine import peer_sum

        peer_sum.MAX_PROGRAMS = 4
        check_peer_sum(device)
        check_peer_sum_norm(device)
        check_peer_gather(device)
        check_peer_share(device)
    check_model(window=None, device=device)
    check_model(window=8, device=device)
    print("kernels: ok")
    sys.exit(0)
