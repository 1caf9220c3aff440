"""The OpenAI request bodies duet accepts, validated once at the HTTP edge.

Unknown fields are ignored, as OpenAI clients send many optional ones; every field duet does
read is checked here, and each request turns itself into engine SamplingParams.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engines.base import SamplingParams

MAX_STOP = 4
EngineChoice = Literal["auto", "torch", "mlx"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        # Chat templates know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="duet extension: keep the k most likely tokens")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    engine: EngineChoice | None = Field(
        None, description="duet extension: the engine that serves this request"
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, p: str | list[str] | list[int]):
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], str):
                if len(p) > 1:
                    raise ValueError("only one prompt per request is supported")
                return p[0]
        return p

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo
