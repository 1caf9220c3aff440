"""Server settings: command-line flags and DUET_* environment variables, validated once."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    max_classification_inputs: int = Field(
        256, ge=1, le=100_000, description="POST /v1/classifications: most inputs per request"
    )
    max_classification_labels: int = Field(
        32, ge=2, le=1000, description="POST /v1/classifications: most labels per request"
    )
    max_label_chars: int = Field(
        100, ge=1, le=10_000, description="POST /v1/classifications: longest label, in characters"
    )
