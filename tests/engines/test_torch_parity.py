"""duet's own Llama-family model against transformers, fp32, on tiny random checkpoints."""

import pytest
import torch

from engines.base import SamplingParams, Step
from engines.torch_engine import TorchEngine, cpu_linear
from engines.torch_engine.loader import load_model
from tests.tiny_models import FAMILIES

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")
PROMPT = [5, 70, 80, 90, 33, 44, 55, 66, 120, 7, 200]


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_cached_decode_match_transformers(tiny_dirs, family, packed):
    """Also with the linear layers on oneDNN, as the engine runs them on the CPU."""
    path, reference = tiny_dirs[family]
    model = load_model(path, torch.float32, "cpu")
    if packed:
        assert cpu_linear.pack_linears(model) == 1 + 4 * model.args.num_layers
    model.setup_cache(64)
    seq = torch.tensor([PROMPT])
    with torch.no_grad():
        ours = model(seq, 0)
        torch.testing.assert_close(ours, reference(seq).logits, atol=2e-5, rtol=1e-4)
        for _ in range(20):  # 20 decode steps through the KV cache
            token = ours[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], dim=1)
            ours = model(token, seq.shape[1] - 1)
            expected = reference(seq).logits[:, -1:]
            torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)


def test_greedy_generation_follows_reference_argmax(tiny_dirs):
    path, reference = tiny_dirs["llama"]
    engine = TorchEngine(path, context_length=128, dtype="float32", device="cpu")
    if cpu_linear.available():  # the engine's CPU path: linear layers on oneDNN
        assert isinstance(engine.model.lm_head, cpu_linear.PackedLinear)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [e.token_id for e in engine.generate(PROMPT, params) if isinstance(e, Step) and e.token_id >= 0]
    seq = torch.tensor([PROMPT])
    expected = []
    with torch.no_grad():
        for _ in range(12):
            nxt = reference(seq).logits[0, -1].argmax().item()
            expected.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    assert ids[: len(expected)] == expected


def test_seeded_sampling_is_reproducible_and_varies_with_seed(tiny_dirs):
    engine = TorchEngine(tiny_dirs["llama"][0], context_length=128, dtype="float32", device="cpu")

    def run(seed):
        params = SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        return [e.token_id for e in engine.generate(PROMPT, params) if isinstance(e, Step)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_one_is_greedy(tiny_dirs):
    engine = TorchEngine(tiny_dirs["qwen2"][0], context_length=128, dtype="float32", device="cpu")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    ids = lambda p: [e.token_id for e in engine.generate(PROMPT, p) if isinstance(e, Step)]
    assert ids(greedy) == ids(top1)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from engines.base import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModel, match="gpt2.*not supported"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_path_matches_transformers(tiny_dirs, family):
    """The runtime's path: the prompt prefilled into pages of the pool in two chunks, then 30
    decode steps gathering the pages back (the second chunk and the decode steps cross pages
    of 16 positions; the 4-token window of mistral_window is crossed many times)."""
    from engines.runtime.plan import RowSampling, ScheduledSeq
    from engines.torch_engine.paged import build_batch

    path, reference = tiny_dirs[family]
    engine = TorchEngine(path, context_length=64, dtype="float32", device="cpu")
    model, kv = engine.model, engine.kv
    blocks = (5, 2, 7, 0)  # out of order on purpose

    def logits_after(tokens, start):
        row = ScheduledSeq(0, tuple(tokens), start, blocks, True, RowSampling(0.0, 0, 1.0, 0), 0)
        with torch.no_grad():
            return model.forward_paged(build_batch([row], kv, 64, model.args.sliding_window,
                                                   "cpu"), kv)[0]

    seq = torch.tensor([PROMPT])
    logits_after(PROMPT[:6], 0)
    logits = logits_after(PROMPT[6:], 6)
    torch.testing.assert_close(logits, reference(seq).logits[0, -1], atol=2e-5, rtol=1e-4)
    for _ in range(30):
        token = int(logits.argmax())
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
        logits = logits_after([token], seq.shape[1] - 1)
        torch.testing.assert_close(logits, reference(seq).logits[0, -1], atol=2e-5, rtol=1e-4)


def onednn_runs(dtype):
    return pytest.mark.skipif(not cpu_linear.available(dtype),
                              reason=f"this CPU or torch has no oneDNN {dtype} path")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=onednn_runs(torch.float32)),
                                   pytest.param(torch.bfloat16, marks=onednn_runs(torch.bfloat16))])
def test_packed_linear_computes_what_linear_computes(dtype):
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 200, bias=bias).to(dtype)
        packed = cpu_linear.PackedLinear(linear)
        for shape in ((1, 96), (1, 1, 96), (3, 17, 96)):  # decode row, prefill, scoring batch
            x = torch.randn(shape, dtype=dtype)
            expected = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                                  None if linear.bias is None else linear.bias.double())
            tol = 1e-5 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(packed(x).double(), expected, atol=tol, rtol=tol)


@needs_onednn
def test_packing_a_tied_head_keeps_the_embedding(tiny_dirs):
    model = load_model(tiny_dirs["smollm"][0], torch.float32, "cpu")  # tied embeddings
    table = model.model.embed_tokens.weight.detach().clone()
    cpu_linear.pack_linears(model)
    assert isinstance(model.lm_head, cpu_linear.PackedLinear)
    assert torch.equal(model.model.embed_tokens.weight, table)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reduced_precision_check_says_what_onednn_does_on_this_cpu(dtype):
    """Run on an AVX2-only CPU and on an AVX-512 one, this covers both answers: where the
    check says yes a weight reorders, where it says no oneDNN refuses it."""
    weight = torch.randn(64, 32).to(dtype)
    if cpu_linear.cpu_supports(dtype):
        cpu_linear.PackedLinear(torch.nn.Linear(32, 64).to(dtype))
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(weight, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_widened_linear_takes_few_rows_as_they_are_and_many_in_float32(dtype):
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 200, bias=bias).to(dtype)
        widened = cpu_linear.WidenedLinear(linear)
        assert widened.weight is linear.weight  # shared: a tied embedding stays tied
        for shape in ((1, 96), (2, 4, 96), (1, 9, 96), (3, 17, 96)):
            x = torch.randn(shape, dtype=dtype)
            rows = x.numel() // 96
            b = None if linear.bias is None else linear.bias
            if rows <= cpu_linear.WIDEN_ROWS:
                expected = torch.nn.functional.linear(x, linear.weight, b)
            else:
                expected = torch.nn.functional.linear(
                    x.float(), linear.weight.float(), None if b is None else b.float()).to(dtype)
            out = widened(x)
            assert out.dtype == dtype and torch.equal(out, expected), (shape, bias)


def test_a_bfloat16_model_serves_where_onednn_has_no_bfloat16_path(tiny_dirs, monkeypatch):
    """The fallback forced, as on a CPU with AVX2 only: ATen's linear layers, widened for many
    rows, the same tokens as the model run that way by hand."""
    monkeypatch.setattr(cpu_linear, "cpu_supports", lambda dtype: dtype == torch.float32)
    path, _ = tiny_dirs["llama"]
    engine = TorchEngine(path, context_length=128, dtype="bfloat16", device="cpu")
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in engine.model.modules())
    assert any(isinstance(m, cpu_linear.WidenedLinear) for m in engine.model.modules())
    assert engine.info.dtype == "bfloat16"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [e.token_id for e in engine.generate(PROMPT, params) if isinstance(e, Step)][:8]
    model = load_model(path, torch.bfloat16, "cpu")
    cpu_linear.widen_linears(model)
    model.setup_cache(64)
    seq, expected = torch.tensor([PROMPT]), []
    with torch.no_grad():
        logits = model(seq, 0)[:, -1]
        for _ in range(8):
            token = logits.argmax(-1, keepdim=True)
            expected.append(int(token))
            seq = torch.cat([seq, token], dim=1)
            logits = model(token, seq.shape[1] - 1)[:, -1]
    assert ids == expected
