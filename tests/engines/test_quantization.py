"""Which quantization a model is served in (engines/quantization.py), and models.toml's key."""

import pytest

from engines.base import UnsupportedModel
from engines.models.config import ModelSpec
from engines.quantization import SOURCE_KEY, resolve


def test_auto_keeps_a_gguf_sources_precision_and_nothing_else():
    q4 = resolve("auto", {SOURCE_KEY: "Q4_K"}, "torch")
    assert (q4.format, q4.group_size) == ("int4", 32) and "Q4_K" in q4.describe()
    assert resolve("auto", {SOURCE_KEY: "Q6_K"}, "mlx").format == "int8"
    assert resolve("auto", {SOURCE_KEY: "Q8_0"}, "torch").format == "int8"
    assert resolve("auto", {}, "torch") is None


def test_explicit_choices_and_none():
    assert resolve("none", {SOURCE_KEY: "Q4_0"}, "torch") is None
    int4 = resolve("int4", {}, "mlx")
    assert (int4.format, int4.group_size) == ("int4", 64)
    assert resolve("fp8", {}, "torch").format == "fp8"
    with pytest.raises(UnsupportedModel, match="mlx engine has no fp8"):
        resolve("fp8", {}, "mlx")
    with pytest.raises(ValueError, match="quantize must be one of"):
        resolve("int3", {}, "torch")


def test_a_checkpoint_quantized_on_disk_is_served_as_it_is():
    assert resolve("int4", {"quantization": {"bits": 4, "group_size": 64}}, "mlx") is None


def test_models_toml_quantize_key():
    spec = ModelSpec(id="m", source="dummy:llama-3.2-1b", quantize="int4")
    assert spec.quantize == "int4"
    assert ModelSpec(id="m", source="dummy:llama-3.2-1b").quantize == "auto"
    with pytest.raises(ValueError, match="quantize"):
        ModelSpec(id="m", source="dummy:llama-3.2-1b", quantize="q3")
    with pytest.raises(ValueError, match="for generate models"):
        ModelSpec(id="e", source="path:/x", task="embed", quantize="int8")
