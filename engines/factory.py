"""Create engines by name, importing each backend only when it is asked for."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
from pathlib import Path

from .base import BackendMissing, Embedder, Engine, UnsupportedModel
from .runtime.sizing import RuntimeOptions

ENGINE_NAMES = ("torch", "mlx")
# engine -> (module that must be importable, pyproject extra that installs it)
_BACKENDS = {"torch": ("torch", "torch"), "mlx": ("mlx_lm", "mlx")}


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def resolve_engine_name(name: str) -> str:
    """'auto' means MLX on Apple Silicon and PyTorch everywhere else."""
    if name == "auto":
        return "mlx" if is_apple_silicon() else "torch"
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown engine '{name}' (choose from auto, {', '.join(ENGINE_NAMES)})")
    return name


def backend_available(name: str) -> bool:
    module, _ = _BACKENDS[name]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def backend_missing(name: str) -> BackendMissing:
    module, extra = _BACKENDS[name]
    return BackendMissing(name, module, extra)


def require_backend(name: str) -> None:
    if not backend_available(name):
        raise backend_missing(name)


def import_backend(name: str) -> None:
    """Import what building the named engine imports (seconds of torch and its compiler or of
    MLX), in an engine's process before it is asked to load. The tokenizer's library is left
    to the load, which builds the tokenizer beside its weights (tokenizer.load_hf_tokenizer:
    the class's own module, under 2 s); on a model's first start AutoTokenizer imports
    torch's compiler too, already imported by then (two threads importing one module from
    both ends is a deadlock Python raises as an error)."""
    if name == "torch":
        from .torch_engine.engine import import_compiler

        import_compiler()  # an engine process is for a GPU, where the load compiles
    else:
        from . import mlx_engine  # noqa: F401
        from .tokenizer import import_transformers

        import_transformers()


def create_engine(
    name: str,
    model_dir: Path,
    *,
    context_length: int,
    dtype: str = "auto",
    task: str = "generate",
    quantize: str = "auto",
    runtime_options: RuntimeOptions | None = None,
    **torch_options,
) -> Engine | Embedder:
    """runtime_options (kv_cache_memory, kv_cache_limit, max_batch, max_prefill_tokens,
    prefix_cache) go to
    either generating engine; torch_options (device, compile, mps_memory_fraction) to the torch engine only.
    A classify model (a sequence-classification checkpoint) runs on the torch engine only; an
    embed model (a BERT sentence encoder) on either."""
    require_backend(name)
    if task == "embed":
        if name == "torch":
            from .torch_engine.embedder import torch_embedder

            return torch_embedder(model_dir, context_length=context_length, dtype=dtype,
                                  **torch_options)
        from .mlx_engine.embedder import mlx_embedder

        return mlx_embedder(model_dir, context_length=context_length, dtype=dtype)
    if task == "classify":
        if name != "torch":
            raise UnsupportedModel("classify models (sequence-classification checkpoints) run on "
                                   "the torch engine only")
        from .torch_engine.classifier import SequenceClassifierEngine

        return SequenceClassifierEngine(
            model_dir, context_length=context_length, dtype=dtype, **torch_options
        )
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model_dir, context_length=context_length, dtype=dtype,
                           quantize=quantize, **_runtime_kwargs(runtime_options), **torch_options)
    from .mlx_engine import MLXEngine

    return MLXEngine(model_dir, context_length=context_length, dtype=dtype,
                     quantize=quantize, **_runtime_kwargs(runtime_options))


def _runtime_kwargs(options: RuntimeOptions | None) -> dict:
    """The generating engines' constructors take the server's runtime asks as keywords."""
    return dataclasses.asdict(options) if options is not None else {}
