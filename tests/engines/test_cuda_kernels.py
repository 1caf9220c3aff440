"""The Triton kernels of the CUDA path (decode attention, SiLU * up, the nucleus border, the
tensor-parallel peer kernels): on this CPU through Triton's interpreter and compiled for an
H100 (sm_90) without running, on a GPU (where there is one) compiled and run, in bfloat16 too."""

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
@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "a GPU checks the kernels compiled (test_kernel_on_cuda); the interpreter of Triton 3.6, "
    "torch 2.11's, cannot loop over a helper's runtime ints under NumPy 2.4"))
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
    from tests.engines.kernels_check import (check_borders, check_fp8_layer, check_fp8_mm,
                                             check_int4_cuda_layer, check_int4_layer,
                                             check_int4_mm, check_int4_tiny, check_model,
                                             check_op, check_quantize_rows, check_scale_products,
                                             check_silu_mul)

    check_op(((torch.bfloat16, 2e-2), (torch.float32, 1e-5)), device="cuda")
    check_silu_mul(((torch.bfloat16, 1e-2), (torch.float32, 1e-6)), device="cuda")
    check_borders(device="cuda")
    check_int4_mm(device="cuda")
    check_int4_tiny(device="cuda")
    check_int4_layer(device="cuda")
    check_int4_cuda_layer()
    check_fp8_mm(device="cuda")
    check_fp8_layer(device="cuda")
    check_quantize_rows(device="cuda")
    check_scale_products(device="cuda")
    check_model(window=None, device="cuda")
    check_model(window=8, device="cuda")


def test_model_refuses_the_kernels_without_triton(monkeypatch, tiny_dirs):
    from engines.torch_engine import decode_attention
    from engines.torch_engine import silu_mul  # noqa: F401  (imported whole before Triton hides)
    from engines.torch_engine.loader import load_model

    model = load_model(tiny_dirs["llama"][0], torch.float32, "cpu")
    model.setup_cache(32)
    monkeypatch.setattr(decode_attention, "triton", None)
    with pytest.raises(RuntimeError, match="Triton"):
        model.use_kernels(attention=True)
    with pytest.raises(RuntimeError, match="Triton"):
        model.use_kernels(attention=False, activation=True)
    model.use_kernels(attention=False)  # the PyTorch-op path needs nothing


PTR16 = "*bf16"
ATTENTION_SIGNATURE = {
    "QKV": PTR16, "Cos": PTR16, "Sin": PTR16, "K": PTR16, "V": PTR16, "Table": "*i64",
    "Pos": "*i64", "Slots": "*i64", "Acc": "*fp32", "M": "*fp32", "L": "*fp32", "Out": PTR16,
    "Counters": "*i32", **{f"stride_{n}": "i32" for n in (
        "qkv", "cos", "ks", "kh", "vs", "vh", "tb", "pos", "slot")},
    "kv_len": "i32", "window": "i32", "scale": "fp32"}
CUDA_KERNELS = {  # module, kernel[, variant]: signature as the ops launch it (bfloat16), constants[, options]
    ("peer_sum", "_peer_sum_kernel"): (
        {"X": "*i16", "Out": PTR16, "Ptrs": "*i64", "rank": "i32", "n": "i32",
         "slot_stride": "i32", "phase_offset": "i32"},
        {"WORLD": 2, "BF16": True, "BLOCK": 1024, "PDL": True}),
    ("peer_sum", "_peer_sum_kernel", "prefill"): (  # the largest block, as layout() gives it
        {"X": "*i16", "Out": PTR16, "Ptrs": "*i64", "rank": "i32", "n": "i32",
         "slot_stride": "i32", "phase_offset": "i32"},
        {"WORLD": 2, "BF16": True, "BLOCK": 4096, "PDL": False}, {"num_warps": 8}),
    ("peer_sum", "_peer_sum_norm_kernel"): (
        {"X": "*i16", "Res": PTR16, "W": PTR16, "NewRes": PTR16, "Normed": PTR16, "Ptrs": "*i64",
         "rank": "i32", "rows": "i32", "hidden": "i32", "eps": "fp32", "slot_stride": "i32",
         "phase_offset": "i32"},
        {"WORLD": 2, "BF16": True, "BLOCK_H": 4096, "PDL": True}, {"num_warps": 8}),
    ("peer_sum", "_add_norm_kernel"): (
        {"Sum": PTR16, "Res": PTR16, "W": PTR16, "NewRes": PTR16, "Normed": PTR16,
         "rows": "i32", "hidden": "i32", "eps": "fp32"},
        {"BLOCK_H": 4096, "PDL": True}, {"num_warps": 8}),
    ("peer_sum", "_peer_gather_kernel"): (
        {"X": "*i16", "Out": "*i16", "Ptrs": "*i64", "rank": "i32", "n": "i32", "part": "i32",
         "slot_stride": "i32"},
        {"WORLD": 2, "BLOCK": 1024}),
    ("peer_sum", "_peer_share_kernel"): (
        {"X": "*i64", "Out": "*i64", "Ptrs": "*i64", "rank": "i32", "n": "i32",
         "phase_offset": "i32"},
        {"WORLD": 2, "BLOCK": 256}),
    ("decode_attention", "_attention_kernel"): (  # slices merged by the last program
        ATTENTION_SIGNATURE,
        {"N_HEADS": 16, "N_KV": 4, "REP": 4, "REP_PAD": 16, "D": 128, "PAGE": 16,
         "SPLIT_LEN": 64, "N_SPLITS": 8, "PRECISION": "tf32", "PDL": True}),
    ("decode_attention", "_attention_kernel", "one slice"): (
        ATTENTION_SIGNATURE,
        {"N_HEADS": 32, "N_KV": 8, "REP": 4, "REP_PAD": 16, "D": 128, "PAGE": 16,
         "SPLIT_LEN": 64, "N_SPLITS": 1, "PRECISION": "tf32", "PDL": False}),
    ("silu_mul", "_silu_mul_kernel"): (
        {"X": PTR16, "Out": PTR16, "hidden": "i32"}, {"BLOCK": 1024, "PDL": True}),
    ("int4_kernel", "_int4_mm_kernel", "decode"): (  # split: float32 parts
        {"X": PTR16, "QW": "*i32", "Scales": PTR16, "Zeros": PTR16, "Out": "*fp32", "M": "i32",
         "N": "i32", "K": "i32"},
        {"GROUP": 64, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4,
         "BF16_DOT": True}, {"num_warps": 4, "num_stages": 3}),
    ("int4_kernel", "_int4_mm_kernel", "prefill"): (  # not split: the result in bfloat16
        {"X": PTR16, "QW": "*i32", "Scales": PTR16, "Zeros": PTR16, "Out": PTR16, "M": "i32",
         "N": "i32", "K": "i32"},
        {"GROUP": 32, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1,
         "BF16_DOT": True}, {"num_warps": 4, "num_stages": 3}),
    ("int4_kernel", "_int4_mm_tiny_kernel", "split"): (
        {"X": PTR16, "QW": "*i32", "SZ": PTR16, "Out": "*fp32", "M": "i32", "N": "i32",
         "K": "i32"},
        {"GROUP": 32, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4,
         "BF16_DOT": True}, {"num_warps": 4, "num_stages": 3}),
    ("int4_kernel", "_int4_mm_tiny_kernel", "64 rows"): (
        {"X": PTR16, "QW": "*i32", "SZ": PTR16, "Out": PTR16, "M": "i32", "N": "i32",
         "K": "i32"},
        {"GROUP": 64, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1,
         "BF16_DOT": True}, {"num_warps": 4, "num_stages": 3}),
    ("int4_kernel", "_int4_mm_tiny_kernel", "groups of 256"): (
        {"X": PTR16, "QW": "*i32", "SZ": PTR16, "Out": PTR16, "M": "i32", "N": "i32",
         "K": "i32"},
        {"GROUP": 256, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 1,
         "BF16_DOT": True}, {"num_warps": 4, "num_stages": 3}),
    ("int4_kernel", "_dequant_kernel", "tinygemm's words"): (
        {"QW": "*i32", "Scales": PTR16, "Zeros": PTR16, "W": PTR16, "N": "i32", "K": "i32"},
        {"GROUP": 128, "BLOCK_K": 128, "BLOCK_N": 64, "TINY": True}),
    ("int4_kernel", "_dequant_kernel"): (
        {"QW": "*i32", "Scales": PTR16, "Zeros": PTR16, "W": PTR16, "N": "i32", "K": "i32"},
        {"GROUP": 64, "BLOCK_K": 64, "BLOCK_N": 64, "TINY": False}),
    ("fp8_kernel", "_fp8_mm_kernel", "split"): (  # float32 parts
        {"X": "*fp8e4nv", "XScale": "*fp32", "W": "*fp8e4nv", "Scale": "*fp32", "Out": "*fp32",
         "M": "i32", "N": "i32", "K": "i32"},
        {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "PRECISE_EVERY": 128},
        {"num_warps": 4, "num_stages": 4}),
    ("fp8_kernel", "_fp8_mm_kernel", "whole"): (
        {"X": "*fp8e4nv", "XScale": "*fp32", "W": "*fp8e4nv", "Scale": "*fp32", "Out": PTR16,
         "M": "i32", "N": "i32", "K": "i32"},
        {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "PRECISE_EVERY": 128},
        {"num_warps": 4, "num_stages": 6}),
    ("row_quant", "_quantize_rows_kernel", "fp8"): (
        {"X": PTR16, "XQ": "*fp8e4nv", "XScale": "*fp32", "K": "i32"},
        {"LEVELS": 448.0, "SMALLEST": 1e-12, "ROUND": False, "BLOCK": 1024}),
    ("row_quant", "_scale_products_kernel"): (
        {"Acc": "*i32", "XScale": "*fp32", "Scale": PTR16, "Out": PTR16, "M": "i32", "N": "i32"},
        {"BLOCK": 1024}),
    ("row_quant", "_quantize_rows_kernel", "int8"): (
        {"X": PTR16, "XQ": "*i8", "XScale": "*fp32", "K": "i32"},
        {"LEVELS": 127.0, "SMALLEST": 1e-10, "ROUND": True, "BLOCK": 1024}),
    ("int4_kernel", "_sum_splits_kernel"): (
        {"Parts": "*fp32", "Out": PTR16, "size": "i32"}, {"SPLIT_K": 4, "BLOCK": 1024}),
    ("nucleus_kernel", "_borders_kernel"): (
        {"Probs": "*fp32", "stride": "i32", "Floats": "*fp32", "Ints": "*i64", "Out": "*fp32",
         "V": "i32"}, {"BLOCK": 4096}, {"num_warps": 16}),
}


@needs_triton
@pytest.mark.parametrize("key", sorted(CUDA_KERNELS), ids="-".join)
def test_cuda_kernels_compile_for_hopper(key):
    """The CUDA path's Triton kernels compiled as a GPU would compile them (for an H100's
    sm_90, with the ptxas Triton ships), here on the CPU: the interpreter runs their Python,
    not Triton's compiler. The peer kernels' waits must be volatile loads, which see the other
    GPUs' writes."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = key[:2]
    fn = getattr(importlib.import_module(f"engines.torch_engine.{module}"), name)
    signature, constants, *options = CUDA_KERNELS[key]
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=options[0] if options else None)
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower() and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas here: {exc}")
        raise
    assert compiled.asm["cubin"]
    if module == "peer_sum" and name != "_add_norm_kernel":  # it waits for nothing
        assert "ld.volatile.global" in compiled.asm["ptx"]
    if "PDL" in constants:  # launched as a programmatic dependent: its wait, then its release
        ptx = compiled.asm["ptx"]
        if constants["PDL"]:
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        else:
            assert "griddepcontrol" not in ptx
    if name == "_attention_kernel" and constants["N_SPLITS"] > 1:
        # The slices' stores, then a barrier, then the count released at GPU scope; the
        # merge reads the slices past L1.
        ptx = compiled.asm["ptx"]
        assert "bar.sync" in ptx and "atom.global.gpu.acq_rel.add" in ptx, ptx
        assert "ld.global.cg" in ptx


def test_kernels_launch_as_dependents_on_hopper_cuda_only(monkeypatch, tmp_path):
    """With DUET_PDL=1, duet's kernels and the compiled step's launch as programmatic
    dependents on a CUDA GPU of compute capability 9 or more with a Triton that has the wait;
    without it, or elsewhere, they do not."""
    import torch._inductor.config as inductor_config

    from engines.torch_engine import decode_attention
    from engines.torch_engine.cuda_graphs import configure_inductor

    monkeypatch.setenv("DUET_PDL", "1")
    assert not decode_attention.dependent_launch(torch.device("cpu"))
    if decode_attention.gdc_wait is None:
        pytest.skip("this Triton has no programmatic dependent launch")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(decode_attention, "cuda_capability", lambda index: (9, 0))
    assert decode_attention.dependent_launch(cuda)
    monkeypatch.setattr(decode_attention, "cuda_capability", lambda index: (8, 9))
    assert not decode_attention.dependent_launch(cuda)
    monkeypatch.setattr(decode_attention, "cuda_capability", lambda index: (10, 0))
    monkeypatch.delenv("DUET_PDL")
    assert not decode_attention.dependent_launch(cuda)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # left as it is
    with inductor_config.patch({"triton.enable_pdl": True, "coordinate_descent_tuning": False,
                                "use_static_cuda_launcher": True}), \
            torch._dynamo.config.patch(specialize_float=False):
        configure_inductor()
        assert not inductor_config.triton.enable_pdl
        monkeypatch.setenv("DUET_PDL", "1")
        configure_inductor()
        assert inductor_config.triton.enable_pdl


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_the_compiled_step_on_cuda_decodes_as_the_eager_ops(tiny_dirs, monkeypatch, pdl):
    """The CUDA decode step as served (Inductor-compiled, replayed as CUDA graphs, duet's
    kernels; with DUET_PDL=1 every kernel a programmatic dependent) gives a batch of requests
    arriving at different steps the tokens of the eager PyTorch-op path, float32, across
    attention buckets of one slice and of two (the merge by the last program)."""
    from engines.base import SamplingParams
    from engines.torch_engine import TorchEngine, cuda_graphs
    from tests.engines.helpers import PROMPTS, run_batch

    monkeypatch.setenv("DUET_PDL", pdl)
    monkeypatch.setattr(cuda_graphs, "MIN_ATTENTION", 16)
    torch._dynamo.reset()
    path = tiny_dirs["llama"][0]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (70, 9, 30)]
    join_at = [0, 1, 4]
    runs = []
    for compile in ("off", "auto"):
        engine = TorchEngine(path, context_length=96, dtype="float32", device="cuda",
                             compile=compile, max_batch=4)
        if compile == "off":  # the reference: no graphs, no kernels
            engine.decoder = None
            engine.model.use_kernels(attention=False, activation=False)
        runs.append([[s.token_id for s in steps] for steps in run_batch(engine, params, join_at)])
    assert runs[0] == runs[1]
    assert [len(r) for r in runs[1]] == [70, 9, 30] and len(PROMPTS[0]) + 70 > 64


def _attention_specialization(table, positions, write_slots, kv_len):
    """How Triton would specialize the decode-attention kernel for a step's rows (the
    arguments paged_decode_attention passes it, bound by Triton's binder for an H100)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from engines.torch_engine import decode_attention

    kernel = decode_attention._attention_kernel
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((args, kwargs))

    b, n_kv, n_heads, d = positions.shape[0], 2, 4, 16
    pool = torch.zeros(64, n_kv, d)
    original, decode_attention._attention_kernel = decode_attention._attention_kernel, Recorder()
    try:
        decode_attention.paged_decode_attention(
            torch.zeros(b, (n_heads + 2 * n_kv) * d), torch.zeros(b, d), torch.zeros(b, d),
            pool, pool.clone(), table, positions[:, 0], write_slots,
            torch.zeros(b * n_kv, dtype=torch.int32), kv_len, 16, 0)
    finally:
        decode_attention._attention_kernel = original
    (args, kwargs), = launched
    binder = create_function_from_signature(kernel.signature, kernel.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    return binder(*args, **{k: v for k, v in kwargs.items() if k != "launch_pdl"})[1]


@needs_triton
def test_the_attention_kernel_compiles_once_a_bucket_for_eager_and_captured_steps():
    """An eager step's rows (views into one copied tensor, at offsets and strides that vary
    with the batch, its table padded to the bucket) and a captured graph's (columns of its
    input buffer) get one specialization a bucket from Triton: each new one was a compile in
    the serving thread, stalling the streams on a cold start."""
    if not hasattr(pytest.importorskip("triton.runtime.jit"), "create_function_from_signature"):
        pytest.skip("this Triton binds a kernel's arguments another way")
    from engines.torch_engine.cuda_graphs import POSITION, TABLE, WRITE

    seen = {}
    for kv_len in (256, 512):
        pages = kv_len // 16
        keys = []
        for b in (1, 2, 3, 5):  # an eager step: tokens, positions, slots, last, table, in a row
            flat = torch.arange(b * (4 + pages))
            positions = flat[b:2 * b].view(b, 1)
            write = flat[2 * b:3 * b]
            table = torch.nn.functional.pad(flat[4 * b:].view(b, pages)[:, :3], (0, pages - 3))
            keys.append(_attention_specialization(table, positions, write, kv_len))
        inputs = torch.zeros(8, TABLE + 2048 // 16 + 1, dtype=torch.long)  # a graph's buffer
        for b in (1, 4):
            x = inputs[:b, : TABLE + pages]
            keys.append(_attention_specialization(x[:, TABLE:], x[:, POSITION:POSITION + 1],
                                                  x[:, WRITE], kv_len))
        assert all(k == keys[0] for k in keys), keys
        seen[kv_len] = keys[0]
    assert seen[256] != seen[512]  # N_SPLITS: one compile per bucket
