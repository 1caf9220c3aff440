"""The torch engine's quantized linear layers against their dequantized weights, each format on
each kernel this machine has (the CPU kernels and the portable dequantizing path, forced)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines.base import SamplingParams, Step, UnsupportedModel
from engines.quantization import Quantization
from engines.torch_engine import TorchEngine, quant
from tests.engines.helpers import PROMPTS, run_batch


def _linear(n, k, bias=False, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.5)
    return layer.to(dtype)


def _reference(fmt, layer, group):
    """The layer's weight as the format stores it, in float32, from the format's own math."""
    w = layer.weight.detach()
    if fmt == "int8":
        return quant.dequantize_int8(*quant.quantize_int8(w))
    if fmt == "int4":
        return quant.dequantize_int4(*quant.quantize_int4(w, group), group)
    return quant.dequantize_fp8(*quant.quantize_fp8(w))


def test_int8_rounds_each_weight_to_within_half_a_step():
    w = torch.randn(32, 96)
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (quant.dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-6)


def test_int4_rounds_each_weight_to_within_half_a_step_of_its_group():
    w = torch.randn(16, 128)
    q, scale, zero = quant.quantize_int4(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    err = (quant.dequantize_int4(q, scale, zero, 32) - w).abs().reshape(16, 4, 32)
    assert torch.all(err <= scale[..., None] / 2 + 1e-6)
    # and a group's extremes are kept: its min maps to 0, its max to 15
    assert torch.allclose(quant.dequantize_int4(q, scale, zero, 32).reshape(16, 4, 32).amin(2),
                          w.reshape(16, 4, 32).amin(2), atol=1e-5)


def test_int4_groups_of_32_hold_a_q4_1_block_exactly():
    # GGUF Q4_1: w = q * d + m per block of 32 inputs, q in 0..15
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (8, 64)).float()
    codes[:, ::32] = 0  # each block uses its full range, as a quantizer leaves it
    codes[:, 1::32] = 15
    d = torch.rand(8, 2, 1) * 0.01 + 0.001
    m = torch.randn(8, 2, 1) * 0.05
    w = (codes.reshape(8, 2, 32) * d + m).reshape(8, 64)
    back = quant.dequantize_int4(*quant.quantize_int4(w, 32), 32)
    assert torch.allclose(back, w, atol=1e-6)


def test_fp8_keeps_each_weight_within_e4m3_precision():
    w = torch.randn(16, 64)
    back = quant.dequantize_fp8(*quant.quantize_fp8(w))
    # e4m3 has 3 mantissa bits: a relative step of 1/8, so rounding is within 1/16
    assert torch.all((back - w).abs() <= w.abs() / 16 + 1e-3)


CASES = [("int8", "cpu"), ("int8", "dequant"), ("int4", "cpu"), ("int4", "dequant"),
         ("fp8", "dequant")]


@pytest.mark.parametrize("fmt,kernel", CASES)
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_computes_what_its_dequantized_weight_computes(fmt, kernel, rows, bias):
    group = 32
    layer = _linear(96, 128, bias=bias)
    ref_w = _reference(fmt, layer, group)
    config = Quantization(fmt, group)
    if kernel == "cpu":
        q = quant.quantize_linear(layer, config, "cpu")
        assert q.kernel == "cpu"
    else:  # the portable path MPS takes, forced here
        q = {"int8": quant.Int8Linear, "int4": quant.Int4Linear}.get(fmt)
        q = (q(layer, "dequant", group) if fmt == "int4" else q(layer, "dequant")) if q \
            else quant.FP8Linear(layer, "dequant", tensor_cores=False)
    torch.manual_seed(2)
    x = torch.randn(2, rows, 128).to(torch.bfloat16)
    bias_f = None if layer.bias is None else layer.bias.float()
    expected = F.linear(x.float(), ref_w, bias_f)
    got = q(x)
    assert got.shape == (2, rows, 96) and got.dtype == torch.bfloat16
    # bfloat16 activations and outputs: within a few of their rounding steps
    tol = 0.02 * expected.abs().max().item() + 1e-3
    assert (got.float() - expected).abs().max().item() <= tol
    # the kernels compute each row as they would alone (a request's tokens must not depend on
    # what it is batched with)
    assert torch.equal(q(x[:1, :1]), got[:1, :1])
    # and not the unquantized layer's result by accident: the reference differs from it
    assert not torch.equal(ref_w, layer.weight.float())


def test_int8_layer_in_float32_activations_keeps_its_dtype():
    layer = _linear(64, 64, dtype=torch.float32)
    q = quant.quantize_linear(layer, Quantization("int8"), "cpu")
    x = torch.randn(1, 1, 64)
    y = q(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, F.linear(x, _reference("int8", layer, 64)), atol=0.02, rtol=0.02)


def _rowwise_scaled_mm_on_cpu() -> bool:
    """Whether this torch's CPU torch._scaled_mm takes one scale a row (2.11's took one for the
    whole tensor only)."""
    w8 = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(w8, w8.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _quantized_rows(x, levels):
    """x's rows as the tensor-core paths quantize them (absmax / levels a row), in float32."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / levels).clamp(min=1e-12)
    if levels == 127:
        return torch.round(x / scale).clamp(-127, 127) * scale
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_cuda_layer_of_a_few_rows_takes_the_tensor_cores_padded(monkeypatch, fmt):
    """The CUDA layers' routing, on this CPU (torch._int_mm and torch._scaled_mm run here too):
    from two rows, and eagerly at one, the activations are quantized per row and padded to the
    rows ATen's kernel takes (torch._int_mm wants more than 16); only the compiled step's one
    row reads the weight as stored. (A compiled 2-15 row weight read widened the whole weight
    to bfloat16 every step.)"""
    if fmt == "fp8" and not _rowwise_scaled_mm_on_cpu():
        pytest.skip("this torch's CPU torch._scaled_mm takes per-tensor scales only")
    layer = _linear(96, 128)
    q = (quant.Int8Linear(layer, "cuda") if fmt == "int8"
         else quant.FP8Linear(layer, "cuda", tensor_cores=True))
    name = "_int_mm" if fmt == "int8" else "_scaled_mm"
    seen = []
    real = getattr(torch, name)
    monkeypatch.setattr(torch, name,
                        lambda a, *r, **kw: seen.append(a.shape[0]) or real(a, *r, **kw))
    w = _reference(fmt, layer, 64)
    torch.manual_seed(3)
    x = torch.randn(5, 128).to(torch.bfloat16)
    got = q(x)
    want = F.linear(_quantized_rows(x, 127 if fmt == "int8" else quant.FP8_MAX), w)
    assert (got.float() - want).abs().max().item() <= 0.01 * want.abs().max().item()
    for rows in (1, 3):  # each row the same bits alone
        assert torch.equal(q(x[:rows]), got[:rows])
    assert seen == [17, 17, 17] if fmt == "int8" else seen == [16, 16, 16]
    # the compiled step's one row: the weight as stored times unquantized activations
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    one = q(x[:1])
    exact = F.linear(x[:1].float(), w)
    assert (one.float() - exact).abs().max().item() <= 0.01 * exact.abs().max().item()
    assert not torch.equal(one, got[:1]) and len(seen) == 3
    assert quant.on_tensor_cores(2) and not quant.on_tensor_cores(1)


def test_kernel_choice_falls_back_where_a_kernel_cannot_take_the_shape():
    assert quant.kernel("int4", "cpu", (64, 96), 64) == "dequant"  # K not a multiple of 64
    assert quant.kernel("int4", "cpu", (64, 128), 64) == "cpu"
    assert quant.kernel("int4", "cuda", (64, 64), 32) == "dequant"  # tinygemm tiles K by 128
    assert quant.kernel("int4", "cuda", (64, 256), 32) == "cuda"
    assert quant.kernel("int8", "mps", (64, 64)) == "dequant"
    assert quant.kernel("fp8", "cpu", (64, 64)) == "dequant"


def test_int4_on_cuda_takes_duets_kernel_only_when_asked_and_the_shape_fits(monkeypatch):
    from engines.torch_engine import int4_kernel

    if int4_kernel.triton is None:
        pytest.skip("Triton is not installed")
    assert quant.kernel("int4", "cuda", (4096, 4096), 64) == "cuda"  # tinygemm by default
    monkeypatch.setenv("DUET_INT4_KERNEL", "triton")
    assert quant.kernel("int4", "cuda", (4096, 4096), 64) == "triton"
    assert quant.kernel("int4", "cuda", (4096, 4096), 32) == "triton"  # GGUF's blocks
    assert quant.kernel("int4", "cuda", (96, 96), 32) == "dequant"  # K not whole steps of 64
    assert quant.kernel("int4", "cpu", (4096, 4096), 64) == "cpu"  # CUDA only
    assert quant.kernel("int8", "cuda", (4096, 4096), 64) == "cuda"


def test_fp8_on_cuda_takes_duets_kernel_on_hopper_or_when_asked(monkeypatch):
    from engines.torch_engine import int4_kernel

    if int4_kernel.triton is None:
        pytest.skip("Triton is not installed")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[0])
    monkeypatch.delenv("DUET_FP8_KERNEL", raising=False)
    assert quant.kernel("fp8", "cuda", (4096, 4096)) == "triton"  # an H100, H200
    assert quant.kernel("fp8", "cuda", (4096, 4000)) == "cuda"  # K not whole steps of 128
    assert quant.kernel("fp8", "cpu", (4096, 4096)) == "dequant"  # CUDA only
    monkeypatch.setenv("DUET_FP8_KERNEL", "aten")
    assert quant.kernel("fp8", "cuda", (4096, 4096)) == "cuda"  # torch._scaled_mm
    capability[0] = (8, 9)  # Ada: torch._scaled_mm unless asked
    monkeypatch.delenv("DUET_FP8_KERNEL")
    assert quant.kernel("fp8", "cuda", (4096, 4096)) == "cuda"
    monkeypatch.setenv("DUET_FP8_KERNEL", "triton")
    assert quant.kernel("fp8", "cuda", (4096, 4096)) == "triton"


@pytest.mark.parametrize("m,n,k,group", [(1, 4096, 4096, 64), (1, 4096, 14336, 64),
                                         (1, 28672, 4096, 64), (4, 6144, 4096, 32),
                                         (64, 4096, 4096, 64), (2048, 28672, 4096, 128)])
def test_int4_plan_tiles_whole_groups_and_fills_the_gpu_at_a_few_rows(m, n, k, group):
    from engines.torch_engine import int4_kernel

    p = int4_kernel.plan(m, n, k, group, sms=132)
    assert p.block_k % group == 0 and k % (p.block_k * p.split_k) == 0
    assert p.block_k % int4_kernel.PACK == 0 and p.block_m >= 16  # the tensor cores' least
    assert p.block_m == (16 if m <= 16 else 64)
    columns = -(-n // p.block_n)
    # Split where the columns are few, until there are more programs than SMs, and not past
    # 8 ways or about 8 programs an SM.
    assert columns * p.split_k > 132 or p.split_k == 8
    assert p.split_k == 1 or columns * p.split_k <= 8 * 132
    assert p == int4_kernel.plan(min(m + 1, 16) if m <= 16 else 256, n, k, group, sms=132)


def _aten_int4pack(pairs: torch.Tensor) -> torch.Tensor:
    """ATen's CUDA _convert_weight_to_int4pack(pairs, innerKTiles=8), its kernel
    (matrix_to_m16n8k16_Bint4_layout) transcribed loop for loop: pairs uint8 [n, k/2] ->
    int32 [n/8, k/128, 32, 4]."""
    n, half = pairs.shape
    out = torch.zeros(n // 8, half * 2 // 128, 32, 4, dtype=torch.int64)
    for n_tile in range(n // 8):
        for k_outer in range(half * 2 // 128):
            for t in range(32):
                for inner in range(0, 8, 2):
                    n0 = n_tile * 8 + t // 4
                    base = (k_outer * 8 + inner) * 16 // 2
                    ks = [base + t % 4, base + t % 4 + 4, base + 8 + t % 4, base + 12 + t % 4]
                    v = [int(pairs[n0, kk]) for kk in ks]
                    out[n_tile, k_outer, t, inner // 2] = (
                        (v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20
                        | (v[0] & 0xF) << 16 | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4
                        | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def test_tiny_pack_lays_the_words_out_as_atens_cuda_kernel_does():
    """int4_kernel.tiny_pack (torch ops, so the kernel reading tinygemm's words is tested on
    the CPU) against ATen's CUDA conversion transcribed; a GPU compares it with the op itself
    (tests/engines/kernels_check.py)."""
    from engines.torch_engine import int4_kernel

    torch.manual_seed(0)
    q = torch.randint(0, 16, (16, 256), dtype=torch.uint8)
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    assert torch.equal(int4_kernel.tiny_pack(q), _aten_int4pack(pairs))


def test_int4_layer_on_cuda_takes_tinygemm_for_few_rows_and_duets_kernel_for_more(monkeypatch):
    """Dispatch only (no GPU here): the layer's words are tinygemm's either way."""
    from engines.torch_engine import int4_kernel

    layer = _int4_cuda_shell(8, 128)
    calls = []
    monkeypatch.setattr(torch, "_weight_int4pack_mm",
                        lambda x, *a: calls.append(("tinygemm", x.shape[0])) or x[:, :8])
    monkeypatch.setattr(torch.ops.duet, "int4_mm_tiny",
                        lambda x, *a: calls.append(("duet", x.shape[0])) or x[:, :8])
    monkeypatch.setattr(int4_kernel, "available", lambda: True)
    few = quant.TINYGEMM_ROWS
    for rows in (1, few, few + 1, 300):
        layer(torch.zeros(rows, 128, dtype=torch.bfloat16))
    assert calls == [("tinygemm", 1), ("tinygemm", few), ("duet", few + 1), ("duet", 300)]
    monkeypatch.setattr(int4_kernel, "available", lambda: False)  # no Triton: tinygemm
    layer(torch.zeros(300, 128, dtype=torch.bfloat16))
    assert calls[-1] == ("tinygemm", 300)


def _int4_cuda_shell(n: int, k: int) -> quant.Int4Linear:
    """An int4 layer of the CUDA kernel without its weights (no GPU here): dispatch only."""
    layer = quant.Int4Linear.__new__(quant.Int4Linear)
    torch.nn.Module.__init__(layer)
    layer.in_features, layer.out_features, layer.kernel, layer.group = k, n, "cuda", 64
    layer.tinygemm_rows, layer.bias = quant.TINYGEMM_ROWS, None
    layer.packed, layer.scales_zeros = torch.zeros(1), torch.zeros(1)
    return layer


def test_int4_kernels_are_compiled_at_load_once_a_shape(monkeypatch):
    """Each int4 layer shape on CUDA runs duet's kernel once at each tiling and past the rows
    that dequantize the weight whole (Triton compiles each on its first call); nothing without
    Triton or CUDA layers."""
    from engines.torch_engine import int4_kernel

    model = torch.nn.Sequential(_int4_cuda_shell(8, 128), _int4_cuda_shell(8, 128),
                                _int4_cuda_shell(16, 256), torch.nn.Linear(4, 4))
    calls = []
    monkeypatch.setattr(torch.ops.duet, "int4_mm_tiny",
                        lambda x, packed, sz, group: calls.append(tuple(x.shape)))
    monkeypatch.setattr(int4_kernel, "available", lambda: True)
    assert quant.compile_kernels(model) == 2
    big = int4_kernel.TINY_DEQUANT_ROWS + 1
    assert calls == [(16, 128), (64, 128), (big, 128), (16, 256), (64, 256), (big, 256)]
    assert quant.compile_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
    monkeypatch.setattr(int4_kernel, "available", lambda: False)
    assert quant.compile_kernels(model) == 0


def test_int4_layer_whose_inputs_do_not_split_into_groups_is_int8():
    layer = _linear(32, 72)
    q = quant.quantize_linear(layer, Quantization("int4", 64), "cpu")
    assert isinstance(q, quant.Int8Linear)


def test_quantize_model_replaces_every_linear_and_keeps_the_head_int8(tiny_dirs):
    from engines.torch_engine.loader import load_model

    path, _ = tiny_dirs["smollm"]
    model = load_model(path, torch.bfloat16, "cpu")
    counts = quant.quantize_model(model, Quantization("int4", 32), "cpu")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    layers = model.args.num_layers
    assert counts == {"int4:cpu": 4 * layers, "int8:cpu": 1}
    assert isinstance(model.lm_head, quant.Int8Linear)
    # the embedding keeps its float weight though the head it was tied to is quantized
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def _dequantized_model(path, fmt, group):
    """The float model with each linear weight replaced by what its quantized layer holds."""
    from engines.torch_engine.loader import load_model

    model = load_model(path, torch.float32, "cpu")
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    layer_fmt = "int8" if name == "lm_head" and fmt == "int4" else fmt
                    child.weight = nn.Parameter(_reference(layer_fmt, child, group))
    return model


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_quantized_engine_logits_are_the_dequantized_models(tiny_dirs, fmt):
    path, _ = tiny_dirs["llama"]
    ids = PROMPTS[0]
    engine = TorchEngine(path, context_length=96, dtype="float32", device="cpu", quantize=fmt)
    assert engine.info.quantization.startswith(fmt)
    reference = _dequantized_model(path, fmt, 64)
    reference.setup_rope(96)
    with torch.no_grad(), reference.scratch_cache(len(ids)):
        want = reference(torch.tensor([ids]), 0)[0].numpy()
    plain = TorchEngine(path, context_length=96, dtype="float32", device="cpu", quantize="none")
    got, unquantized = engine.logits(ids), plain.logits(ids)
    # the CPU kernels compute in bfloat16: within its rounding of the reference, and much
    # nearer to it than to the unquantized model
    err = np.abs(got - want).max()
    assert err <= 0.02 * np.abs(want).max()
    assert err < 0.5 * np.abs(unquantized - want).max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_engine_batch_gives_each_request_its_tokens_alone(tiny_dirs, fmt):
    # the CPU kernels compute each row alone, at any row count: the batch changes nothing
    path, _ = tiny_dirs["qwen2"]  # with Q/K/V biases
    engine = TorchEngine(path, context_length=96, dtype="float32", device="cpu", quantize=fmt)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3
    together = run_batch(engine, params, join_at=[0, 0, 2])
    for i in range(3):
        alone = [e.token_id for e in engine.generate(PROMPTS[i], params[i])
                 if isinstance(e, Step) and e.finish_reason is None]
        assert [s.token_id for s in together[i]] == alone


def test_torch_engine_refuses_an_mlx_quantized_checkpoint_in_one_sentence(tiny_dirs, tmp_path):
    import json
    import shutil

    path, _ = tiny_dirs["llama"]
    copy = tmp_path / "mlx-4bit"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel) as err:
        TorchEngine(copy, context_length=96, device="cpu")
    message = str(err.value)
    assert "MLX 4-bit checkpoint" in message and "mlx engine" in message
    assert len(message) < 200 and "size mismatch" not in message


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_cuda_layer_computes_what_its_dequantized_weight_computes(fmt, rows):
    group = 64
    layer = _linear(512, 1024).cuda()
    ref_w = _reference(fmt, layer, group)
    q = quant.quantize_linear(layer, Quantization(fmt, group), "cuda")
    assert q.kernel in ("cuda", "triton")  # triton: duet's fp8 kernel, the default on Hopper
    # drawn on the CPU: on torch 2.11 the CUDA generator refused an offset here in a full run
    # ("Offset increment outside graph capture")
    x = torch.randn(rows, 1024).to("cuda", torch.bfloat16)
    expected = F.linear(x.float(), ref_w)
    got = q(x)
    # int8 and fp8 on the tensor cores also quantize the activations: every eager call, and
    # compiled from two rows
    tol = 0.05 if fmt != "int4" else 0.02
    assert (got.float() - expected).abs().max().item() <= tol * expected.abs().max().item()
    compiled = torch.compile(q, fullgraph=True)
    tol = 0.05 if fmt != "int4" and quant.TENSOR_CORE_ROWS <= rows else 0.02
    assert (compiled(x).float() - expected).abs().max().item() <= tol * expected.abs().max().item()
