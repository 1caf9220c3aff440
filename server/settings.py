"""Server settings: command-line flags and DUET_* environment variables, validated once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engines.keep_alive import parse_keep_alive

REPO_MODELS_FILE = Path(__file__).resolve().parent.parent / "models.toml"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DUET_", extra="forbid")

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless told otherwise")
    port: int = Field(8000, ge=0, le=65535)
    models_file: Path = Field(REPO_MODELS_FILE, description="The model registry (models.toml)")
    model: str | None = Field(
        None, description="Model id loaded at start-up; default: the first in models.toml"
    )
    engine: Literal["auto", "torch", "mlx"] | None = Field(
        None, description="Engine for the start-up model, overriding its models.toml default"
    )
    device: str = Field("auto", description="torch device: auto (mps, cuda, cpu), cpu, cuda, mps")
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch engine: compile the decode step (auto: on CUDA, with CUDA graphs)",
    )
    mps_memory_fraction: float | None = Field(
        None, gt=0.0, le=2.0,
        description="torch engine on MPS: torch.mps.set_per_process_memory_fraction",
    )
    mps_fallback: bool = Field(
        False, description="Set PYTORCH_ENABLE_MPS_FALLBACK=1: run ops MPS lacks on the CPU"
    )
    preload: bool = Field(True, description="Load the start-up model before accepting requests")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Hardening: who may call, how much they may send, how long they may wait.
    api_key: str | None = Field(
        None, description="One accepted Bearer key (DUET_API_KEY); see api_keys for several"
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted Bearer keys; DUET_API_KEYS takes them comma-separated. With none "
        "set (here, in api_key or in api_key_file) the server is open",
    )
    api_key_file: Path | None = Field(
        None, description="A file of accepted keys, one per line ('#' starts a comment)"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Browser origins allowed by CORS (comma-separated in DUET_CORS_ORIGINS; "
        "'*' for any); empty: CORS off",
    )
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413"
    )
    max_queue: int | None = Field(
        None, ge=0, description="Requests that may wait per engine behind the running batch; "
        "more get 429 with Retry-After (default: as many as the batch, at least 32)",
    )
    max_batch: int | None = Field(
        None, ge=1, le=1024, description="Sequences an engine decodes at once (its running "
        "batch); default 32, or on CUDA as many as the KV cache holds 2048-token sequences "
        "for, from 32 to 128",
    )
    max_prefill_tokens: int | None = Field(
        None, ge=16, description="Prompt tokens prefilled per step; longer prompts go in chunks "
        "between decode steps, so running streams keep flowing (default: 2048 on CUDA, 512 "
        "elsewhere)",
    )
    prefix_cache: bool = Field(
        True, description="Keep the KV of earlier prompts in the KV cache's free room and reuse "
        "it for prompts that start the same way (chat turns, shared system prompts)",
    )
    kv_cache_memory: int | None = Field(
        None, ge=1, description="Bytes of KV cache per engine (e.g. 2GiB, 512MB); default: "
        "max_batch full contexts, at most half the memory free once the weights are loaded "
        "(on CUDA 80%)",
    )
    keep_alive: str | float = Field(
        -1, description="How long a model stays loaded after a request, unless its models.toml "
        "table or the request says otherwise (Ollama's keep_alive: 30s, 5m, 1h30m; 0 unloads "
        "it after each request; -1, the default, keeps it)",
    )
    memory_budget: int | None = Field(
        None, ge=1, description="Bytes that the weights and KV caches of every loaded model "
        "share (e.g. 20GiB); a model that does not fit unloads the least recently used idle "
        "ones, or gets 503 (default: 90% of a CUDA GPU's memory, 75% of the RAM or of what "
        "Metal recommends elsewhere)",
    )
    max_loaded_models: int | None = Field(
        None, ge=1, description="Engines loaded at once at most (a model on two engines counts "
        "twice); loading another unloads the least recently used idle one, or answers 503 "
        "while all are busy (default: no bound)",
    )
    tensor_parallel: int = Field(
        1, ge=1, le=64, description="torch engine: split each generate model over this many "
        "GPUs, one process a GPU (tensor parallelism over NCCL); a model's tensor_parallel in "
        "models.toml overrides it",
    )
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto", description="Run each generating engine in a process of its own, so the HTTP "
        "side never holds up its steps (auto: on CUDA)",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Time limit of one generation request, queueing included"
    )
    shutdown_timeout_s: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before "
        "they are ended (a stream with an error event and [DONE], a waiting request with 503)",
    )
    stuck_grace_s: float = Field(
        10.0, gt=0, description="How far past its time limit a unit of engine work may run "
        "before /health reports its engine stuck (503, degraded)",
    )

    # Connections: how many, and how long a client may take to send a request.
    max_connections: int = Field(
        512, ge=1, description="Open connections at most; more are refused with 503"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time to send a request's headers, from connecting or from "
        "the previous response; then the connection is closed (408 if headers had begun)",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time to send a request's body once its headers are in; then 408"
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this long"
    )

    bench_enabled: bool = Field(
        True, description="Serve POST /bench and the GET /bench page (DUET_BENCH_ENABLED=false: off)"
    )
    bench_max_tokens: int = Field(512, ge=1, description="/bench: most tokens per run")
    bench_max_repeats: int = Field(20, ge=1, description="/bench: most measured runs per prompt")
    bench_max_warmup: int = Field(5, ge=0, description="/bench: most warm-up runs per engine")
    bench_max_prompts: int = Field(8, ge=1, description="/bench: most prompts per run")
    bench_max_clients: int = Field(64, ge=1,
                                   description="/bench load mode: most clients of a level")

    max_classification_inputs: int = Field(
        256, ge=1, le=100_000, description="POST /v1/classifications: most inputs per request"
    )
    max_classification_labels: int = Field(
        32, ge=2, le=1000, description="POST /v1/classifications: most labels per request"
    )
    max_label_chars: int = Field(
        100, ge=1, le=10_000, description="POST /v1/classifications: longest label, in characters"
    )
    max_embedding_inputs: int = Field(
        2048, ge=1, le=100_000, description="POST /v1/embeddings: most inputs per request "
                                            "(OpenAI's limit is 2048)"
    )

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value):
        parse_keep_alive(value)
        return value

    @field_validator("kv_cache_memory", "memory_budget", mode="before")
    @classmethod
    def _byte_size(cls, value):
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def accepted_api_keys(self) -> frozenset[str]:
        """Every key from the setting, the single-key setting and the key file."""
        keys = [*self.api_keys, *([self.api_key] if self.api_key else [])]
        if self.api_key_file is not None:
            try:
                lines = self.api_key_file.read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"cannot read the API key file {self.api_key_file}: {exc}") from exc
            from_file = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
            if not from_file:
                raise ValueError(f"the API key file {self.api_key_file} has no key")
            keys += from_file
        for key in keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and contain no whitespace")
        return frozenset(keys)



_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512 MB', '1e9' -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"'{text}' is not a size (for example 2GiB, 512MB or 1000000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
