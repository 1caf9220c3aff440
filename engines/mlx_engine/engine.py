"""The MLX engine: mlx-lm's model, prompt cache, sampler and step generator behind duet's
interface. MLX runs on Metal on Apple Silicon, on CUDA where mlx-cuda is installed, else CPU."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..base import EngineInfo
from ..generation import GenerationEngine, MemoryMeter, warm_up
from .. import mlx_blas
from ..memory import kv_bytes_per_token
from ..models.dummy import is_dummy
from ..models.model_config import attention_window
from ..quantization import Quantization
from ..quantization import resolve as resolve_quantization
from ..runtime.sizing import KVFacts, RuntimeOptions
from ..tokenizer import ChatTokenizer
from .executor import MLXExecutor
from .prompt_cache import PromptCache
from .warm_up import warm_up_batching

log = logging.getLogger("duet.engines.mlx")

_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def mlx_device() -> str:
    if mx.default_device() == mx.cpu:
        return "cpu"
    if hasattr(mx, "metal") and mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "gpu"


def choose_mlx_dtype(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    return {"cpu": "float32", "metal": "float16"}.get(device, "bfloat16")


class MLXMeter(MemoryMeter):
    measures = "MLX allocator peak"

    def reset(self) -> None:
        mx.reset_peak_memory()

    def peak_bytes(self) -> int:
        return int(mx.get_peak_memory())


class MLXEngine(GenerationEngine):
    name = "mlx"

    def __init__(self, model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                 kv_cache_memory: int | None = None, kv_cache_limit: int | None = None,
                 max_batch: int | None = None,
                 max_prefill_tokens: int | None = None, prefix_cache: bool = True,
                 quantize: str = "auto"):
        from mlx_lm.utils import load_model

        started = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = mlx_device()
        self.dtype = choose_mlx_dtype(dtype, self.device)
        config = json.loads((model_dir / "config.json").read_text())
        # A dummy model has no weight files: mlx-lm's random initialisation stands in.
        self.model, _ = load_model(
            model_dir, lazy=True, strict=not is_dummy(config),
            model_config=_legacy_rope_keys(config),
        )
        self.model.set_dtype(_MX_DTYPES[self.dtype])
        self.quantization = resolve_quantization(quantize, config, "mlx")
        if self.quantization is not None:
            quantize_weights(self.model, self.quantization)
            log.info("weights quantized to %s", self.quantization.describe())
        if self.device == "cpu":
            log.info("mlx engine: CPU products in %s", mlx_blas.described())
        mx.eval(self.model.parameters())
        # The logits' width (a padded embedding may be wider than the tokenizer): the batch's
        # per-row arrays are that wide.
        self.vocab_size = int(self.model(mx.array([[0]])).shape[-1])
        window = attention_window(config)
        if window is not None and window < context_length:
            # mlx-lm's Llama-family models attend over the whole cache; within the window
            # that is the same attention, past it the answers would silently differ.
            log.warning(
                "mlx engine: %s attends over a sliding window of %d tokens, which mlx-lm does "
                "not implement; serving a context of %d tokens instead of %d",
                model_dir, window, window, context_length,
            )
            context_length = window
        # The pool is the runtime's account of mlx-lm's caches, which grow in steps of 256
        # tokens (no storage to allocate): the bound holds to within a step per sequence.
        shape = self.start_runtime(
            KVFacts(kv_bytes_per_token(config, self.dtype), context_length, self.device),
            RuntimeOptions(kv_cache_memory, kv_cache_limit, max_batch, max_prefill_tokens,
                           prefix_cache))
        self.tokenizer = ChatTokenizer(model_dir)
        self.meter = MLXMeter()
        self.info = EngineInfo(
            engine=self.name,
            device=self.device,
            dtype=self.dtype,
            context_length=self.context_length,
            backend_version=f"mlx {mx.__version__}, mlx-lm {_mlx_lm_version()}",
            quantization=self.quantization.describe() if self.quantization else "none",
            weights_bytes=sum(v.nbytes for _, v in tree_flatten(self.model.parameters())),
            kv_cache_bytes=shape.pool.capacity_bytes,
            memory_measure=self.meter.measures,
            extra=shape.info(),
        )
        log.info(
            "mlx engine loaded %s on %s (%s) in %.1fs; %s; warm-up took %.2fs",
            model_dir, self.device, self.dtype, time.perf_counter() - started,
            shape.describe(), warm_up(self) + self._warm_up_batching(),
        )

    def _warm_up_batching(self) -> float:
        # MLX's CPU backend compiles nothing per graph, and its batched steps are slow: this
        # took 10 s for the default model on a 2-core machine (one request's warm-up: 0.9 s).
        return 0.0 if self.device == "cpu" else warm_up_batching(self)

    def executor(self, *, prefix_cache: bool = False) -> MLXExecutor:
        return MLXExecutor(self.model, vocab=self.vocab_size, max_batch=self.max_batch,
                           max_prefill_tokens=self.max_prefill_tokens,
                           prompt_cache=PromptCache(self.kv_pool) if prefix_cache else None)

    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_fits(len(prompt_ids), 0)
        out = self.model(mx.array([list(prompt_ids)]))
        return np.array(out[0].astype(mx.float32))

    def score_continuations(self, prompts, continuations, should_stop=None):
        from .scoring import score_continuations

        return score_continuations(self.model, prompts, continuations, should_stop)

    def close(self) -> None:
        self.model = None


def quantize_weights(model, quant: Quantization) -> None:
    """MLX's own affine format (mlx-lm's q4/q8): groups of quant.group_size inputs, a scale and
    a bias each. The LM head, or the embedding a tied head reads, keeps 8 bits in an int4
    model, as on the torch engine. Each group is rounded onto the grid from its min to its
    max (grid_quantize), not mx.quantize's, which moves the grid so that 0 is on it: a GGUF
    Q4_1 block of 32 is then kept exactly (the default model's perplexity: 0.996x its float
    copy's, against 1.165x with mx.quantize)."""
    from mlx import nn

    bits = 4 if quant.format == "int4" else 8
    floats = dict(tree_flatten(model.parameters()))

    def predicate(path: str, module) -> bool | dict:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % quant.group_size:
            return False
        head = path == "lm_head" or path.endswith("embed_tokens")
        return {"group_size": quant.group_size, "bits": 8 if head else bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.weight, module.scales, module.biases = grid_quantize(
                floats[f"{path}.weight"], module.group_size, module.bits)


def grid_quantize(w, group: int, bits: int):
    """mx.quantize's layout (values packed little-endian into uint32 words; w = q * scale +
    bias) on each group's own min-to-max grid."""
    n, k = w.shape
    levels = 2**bits - 1
    g = w.astype(mx.float32).reshape(n, k // group, group)
    lo, hi = g.min(axis=2, keepdims=True), g.max(axis=2, keepdims=True)
    scale = mx.maximum((hi - lo) / levels, 1e-10)
    q = mx.clip(mx.round((g - lo) / scale), 0, levels).astype(mx.uint32)
    per_word = 32 // bits
    q = q.reshape(n, k // per_word, per_word) << (mx.arange(per_word, dtype=mx.uint32) * bits)
    packed = q.sum(axis=2).astype(mx.uint32)  # the values' bits do not overlap: sum is or
    return packed, scale.squeeze(-1).astype(w.dtype), lo.squeeze(-1).astype(w.dtype)


def _legacy_rope_keys(cfg: dict) -> dict:
    """transformers 5 writes rope settings under rope_parameters; mlx-lm's models read the
    older top-level rope_theta / rope_scaling and would silently use their defaults."""
    rope = dict(cfg.get("rope_parameters") or {})
    out: dict = {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        out["rope_theta"] = rope.pop("rope_theta")
    if not cfg.get("rope_scaling") and rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")
