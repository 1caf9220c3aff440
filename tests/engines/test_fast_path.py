"""Device-dependent choices of the torch engine, with the accelerators faked, and dummy models."""

import json
import logging

import pytest
import torch

from engines import device as dev
from engines.models.dummy import SHAPES, write_dummy_model
from engines.torch_engine.config import ModelArgs
from engines.torch_engine.loader import random_model


def test_configure_mps_caps_memory_and_states_the_fallback(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(torch.mps, "set_per_process_memory_fraction", calls.append)
    monkeypatch.delenv(dev.MPS_FALLBACK_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="duet.engines.device"):
        dev.configure_mps(0.5)
    assert calls == [0.5]
    assert "is not set" in caplog.text
    caplog.clear()
    monkeypatch.setenv(dev.MPS_FALLBACK_ENV, "1")
    with caplog.at_level(logging.INFO, logger="duet.engines.device"):
        dev.configure_mps(None)
    assert calls == [0.5] and "run on the CPU" in caplog.text


def test_mps_meter_samples_the_allocator(monkeypatch):
    readings = iter([100, 300, 200, 150])
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: next(readings))
    meter = dev.MPSMeter()
    meter.reset()
    meter.sample()
    meter.sample()
    assert meter.peak_bytes() == 300


def test_onednn_linears_only_for_the_eager_cpu_path(monkeypatch):
    from engines.torch_engine import cpu_linear
    from engines.torch_engine.engine import onednn_linears

    f32, bf16 = torch.float32, torch.bfloat16
    monkeypatch.setattr(cpu_linear, "cpu_supports", lambda dtype: True)
    assert onednn_linears("cpu", "auto", bf16) and onednn_linears("cpu", "off", f32)
    assert not onednn_linears("cpu", "on", f32)
    assert not onednn_linears("mps", "auto", f32) and not onednn_linears("cuda", "auto", f32)
    # A CPU with AVX2 only: float32 still packed, bfloat16 left to ATen.
    monkeypatch.setattr(cpu_linear, "cpu_supports", lambda dtype: dtype == f32)
    assert onednn_linears("cpu", "auto", f32) and not onednn_linears("cpu", "auto", bf16)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not onednn_linears("cpu", "auto", f32)


def test_dummy_model_directory_has_the_real_shape(tmp_path):
    path = write_dummy_model("llama-3.1-8b", tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == 4096 and cfg["num_hidden_layers"] == 32
    assert cfg["vocab_size"] == 128256 and not cfg["tie_word_embeddings"]
    from engines.tokenizer import ChatTokenizer

    assert ChatTokenizer(path).vocab_size == 128256
    with pytest.raises(ValueError, match="unknown dummy shape"):
        write_dummy_model("gpt-5", tmp_path / "x")
    assert set(SHAPES) >= {"llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b"}


def test_random_model_runs_and_ties_embeddings():
    cfg = dict(SHAPES["qwen2.5-0.5b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300)
    model = random_model(ModelArgs.from_hf(cfg), torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.setup_cache(16)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), 0)
    assert out.shape == (1, 3, 300) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64)])
def test_layer_normed_rms_computes_what_rms_norm_computes(dtype, tol, shape):
    from engines.torch_engine.cpu_norm import LayerNormedRMS
    from engines.torch_engine.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    ours, theirs = LayerNormedRMS(norm)(x), norm(x)
    assert ours.dtype == dtype and ours.shape == x.shape and ours.is_contiguous()
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


def test_cpu_weights_prepared_with_every_norm_as_a_layer_norm():
    from engines.torch_engine.cpu_norm import LayerNormedRMS
    from engines.torch_engine.engine import prepare_weights
    from engines.torch_engine.model import RMSNorm

    cfg = dict(SHAPES["llama-3.2-1b"], hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=300)
    model = random_model(ModelArgs.from_hf(cfg), torch.float32, "cpu")
    model.setup_cache(16)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(tokens, 0)
        prepare_weights(model, None, "cpu", "off", "float32")
        after = model(tokens, 0)
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, LayerNormedRMS))]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, LayerNormedRMS) for m in norms)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
