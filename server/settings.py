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
    preload: bool = Field(True, description="Load the start-up model before accepting requests")
    max_prompt_chars: int = Field(1_000_000, ge=1, description="Longest prompt text accepted")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
