"""The MLX engine's quantized weights (mlx-lm's affine q4/q8) against a float model holding the
same weights dequantized."""

import numpy as np
import pytest

from tests.engines.helpers import PROMPTS

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
pytest.importorskip("mlx_lm")

from engines.mlx_engine import MLXEngine  # noqa: E402


def _dequantized_weights(model) -> list[tuple[str, object]]:
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size,
                              module.bits)
            out.append((f"{name}.weight", w))
    return out


@pytest.mark.parametrize("fmt,bits", [("int8", 8), ("int4", 4)])
def test_mlx_quantized_logits_are_the_dequantized_models(tiny_dirs, fmt, bits):
    from mlx.utils import tree_unflatten

    path, _ = tiny_dirs["llama"]
    engine = MLXEngine(path, context_length=96, dtype="float32", quantize=fmt)
    assert engine.info.quantization.startswith(fmt)
    layers = [m for _, m in engine.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and {m.bits for m in layers} == {bits, 8}  # the head keeps 8 bits
    reference = MLXEngine(path, context_length=96, dtype="float32", quantize="none")
    plain = reference.logits(PROMPTS[0])
    reference.model.update(tree_unflatten(_dequantized_weights(engine.model)))
    want, got = reference.logits(PROMPTS[0]), engine.logits(PROMPTS[0])
    err = np.abs(got - want).max()
    assert err <= 1e-3 * np.abs(want).max()
    assert err < 0.01 * np.abs(plain - want).max()


def test_mlx_engine_has_no_fp8(tiny_dirs):
    from engines.base import UnsupportedModel

    path, _ = tiny_dirs["llama"]
    with pytest.raises(UnsupportedModel, match="no fp8"):
        MLXEngine(path, context_length=96, quantize="fp8")


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_quantize_keeps_a_q4_1_like_block_exactly_and_packs_as_mlx_does(bits):
    from engines.mlx_engine.engine import grid_quantize

    rng = np.random.default_rng(0)
    levels = 2**bits - 1
    codes = rng.integers(0, levels + 1, size=(8, 64)).astype(np.float32)
    codes[:, ::32], codes[:, 1::32] = 0, levels  # each block spans its grid, as quantizers leave it
    d = rng.uniform(0.001, 0.01, size=(8, 2, 1)).astype(np.float32)
    m = rng.normal(0, 0.05, size=(8, 2, 1)).astype(np.float32)
    w = (codes.reshape(8, 2, 32) * d + m).reshape(8, 64)
    packed, scales, biases = grid_quantize(mx.array(w), 32, bits)
    assert packed.dtype == mx.uint32 and packed.shape == (8, 64 * bits // 32)
    back = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))
    np.testing.assert_allclose(back, w, atol=1e-6)
    # mx.quantize's own grid keeps 0 on it instead, and misses these blocks
    own = np.array(mx.dequantize(*mx.quantize(mx.array(w), group_size=32, bits=bits),
                                 group_size=32, bits=bits))
    assert np.abs(own - w).max() > np.abs(back - w).max()
