"""models.toml: the model registry, validated once at start-up."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..keep_alive import parse_keep_alive

SOURCE_KINDS = ("package", "path", "hf", "dummy")


class ConfigError(ValueError):
    pass


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    source: str = Field(
        description=(
            "package:MODULE/FILE.gguf or package:MODULE/FILE.zip (a GGUF file, or a zip of a "
            "model directory, shipped in an installed Python package), "
            "path:/a/model/dir (a local Hugging Face-style directory, a .gguf or a .zip), "
            "hf:org/name (a Hugging Face id, resolved from the local HF cache only), "
            "dummy:SHAPE (random weights of a known shape, for benchmarks)"
        )
    )
    engine: Literal["torch", "mlx", "auto"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantize: Literal["auto", "none", "int8", "int4", "fp8"] = Field(
        "auto",
        description=(
            "weights served in int8, int4 (groups of 64) or fp8 (torch engine; e4m3 with fp8 "
            "tensor cores on CUDA), or none; auto keeps a quantized GGUF's precision (Q4 files "
            "int4 in groups of 32, 5-8 bit ones int8) and serves anything else as stored"
        ),
    )
    context_length: int = Field(default=4096, ge=16, le=1 << 20)
    keep_alive: str | float | None = Field(
        None,
        description=(
            "how long the model stays loaded after a request (Ollama's keep_alive: 30s, 5m, "
            "1h30m; 0 unloads it after each request; -1 keeps it); default: the server's "
            "--keep-alive"
        ),
    )
    task: Literal["generate", "classify", "embed"] = Field(
        "generate",
        description=(
            "generate: a causal LM for chat and text completions (and zero-shot "
            "classification); classify: a *ForSequenceClassification checkpoint; embed: a "
            "BERT sentence-embedding model (sentence-transformers' layout) for /v1/embeddings"
        ),
    )
    tensor_parallel: int | None = Field(
        None, ge=1, le=64,
        description=(
            "torch engine, generate models: split the model over this many GPUs (tensor "
            "parallelism, NCCL; on the CPU ranks over gloo); default: the server's "
            "--tensor-parallel (1)"
        ),
    )
    description: str = ""

    @model_validator(mode="after")
    def _task_rules(self) -> "ModelSpec":
        if (self.tensor_parallel or 1) > 1 and (self.task != "generate" or self.engine == "mlx"):
            raise ValueError("tensor_parallel is for generate models on the torch engine")
        if self.task == "classify" and self.engine == "mlx":
            raise ValueError("task 'classify' models run on the torch engine: set engine to "
                             "torch or auto")
        if self.task != "generate" and self.quantize not in ("auto", "none"):
            raise ValueError(f"quantize '{self.quantize}' is for generate models; task "
                             f"'{self.task}' models are served as stored")
        if self.task in ("classify", "embed") and self.source_kind == "dummy":
            raise ValueError(f"task '{self.task}' needs a real checkpoint, not a dummy: source")
        return self

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value):
        if value is not None:
            parse_keep_alive(value)
        return value

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        kind, sep, rest = value.partition(":")
        if not sep or kind not in SOURCE_KINDS or not rest:
            raise ValueError(f"must start with one of {', '.join(k + ':' for k in SOURCE_KINDS)}")
        return value

    @property
    def source_kind(self) -> str:
        return self.source.partition(":")[0]

    @property
    def source_ref(self) -> str:
        return self.source.partition(":")[2]


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelSpec] = Field(min_length=1)

    @field_validator("models")
    @classmethod
    def _unique_ids(cls, models: list[ModelSpec]) -> list[ModelSpec]:
        seen: set[str] = set()
        for m in models:
            if m.id in seen:
                raise ValueError(f"model id '{m.id}' appears twice")
            seen.add(m.id)
        return models


def load_models_file(path: str | Path) -> list[ModelSpec]:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: model registry file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return ModelsFile.model_validate(raw).models
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = _key_path(raw, err["loc"])
            problems.append(f"{path}: {key}: {err['msg']}")
        raise ConfigError("\n".join(problems)) from None


def _key_path(raw: dict, loc: tuple) -> str:
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and item < len(node) and isinstance(node[item], dict):
                model_id = node[item].get("id")
                if model_id:
                    label = f"[{item}] (id '{model_id}')"
            parts.append(label)
            node = node[item] if isinstance(node, list) and item < len(node) else {}
        else:
            parts.append(("." if parts else "") + str(item))
            node = node.get(item, {}) if isinstance(node, dict) else {}
    return "".join(parts) or "(top level)"
