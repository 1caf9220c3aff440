"""The OpenAI request bodies duet accepts, validated once at the HTTP edge.

Unknown fields are ignored, as OpenAI clients send many optional ones; every field duet does
read is checked here, and each request turns itself into engine SamplingParams. OpenAI fields
that would change the answer but that duet does not implement are refused by name (400,
code unsupported_parameter) unless they hold their neutral value, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engines.base import SamplingParams

MAX_STOP = 4
MAX_MESSAGES = 2048  # OpenAI's own limit on the messages array
SEED_RANGE = (-(2**63), 2**64 - 1)  # int64 or uint64, folded into uint64 for the engines
EngineChoice = Literal["auto", "torch", "mlx"]
TOP_K_MAX = 2**31 - 1  # no vocabulary is larger; a k at or above the model's keeps every token


def _valid_text(value: str) -> str:
    # JSON can carry a lone UTF-16 surrogate ("\ud800"), which Python keeps in a str but no
    # tokenizer can encode: refuse it here, naming the field, instead of deep in an engine.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_text", "the text is not valid Unicode: it has a lone surrogate at "
            "character {at}", {"at": exc.start}) from None
    return value


# Every string duet reads from a request, so that invalid text is refused at the edge.
Text = Annotated[str, AfterValidator(_valid_text)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

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

    model: Text = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=TOP_K_MAX, description="duet extension: keep the k most "
                       "likely tokens (0, or a k at or above the vocabulary: keep all)")
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    engine: EngineChoice | None = Field(
        None, description="duet extension: the engine that serves this request"
    )
    ignore_eos: bool = Field(
        False, description="duet extension (as vLLM's): keep generating past end-of-sequence "
        "tokens, to max_tokens (benchmarks)",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in cls.UNSUPPORTED.items():
                value = data.get(name)
                if value is not None and not neutral(value):
                    raise PydanticCustomError(
                        "unsupported_parameter",
                        "'{name}' is not supported by duet (leave it out or send its default)",
                        {"name": name},
                    )
        return data

    # field -> "this value asks for nothing duet lacks". Checked before validation so that the
    # error names the field whatever its type.
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "logprobs": lambda v: v is False or v == 0,
        "top_logprobs": lambda v: v == 0,
        "logit_bias": lambda v: v == {},
        "frequency_penalty": lambda v: v == 0,
        "presence_penalty": lambda v: v == 0,
    }

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
            seed=None if self.seed is None else self.seed % 2**64,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
        )


def _no_tools(value: Any) -> bool:
    return value == []


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **GenerationFields.UNSUPPORTED,
        "tools": _no_tools,
        "functions": _no_tools,
        "tool_choice": lambda v: v in ("none", "auto"),
        "function_call": lambda v: v in ("none", "auto"),
        "response_format": lambda v: v == {"type": "text"},
        "audio": lambda v: False,
        "modalities": lambda v: v == ["text"],
        "prediction": lambda v: False,
        "web_search_options": lambda v: False,
        "reasoning_effort": lambda v: False,
    }

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(GenerationFields):
    prompt: Text | list[Text] | list[int]
    echo: bool = False

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **GenerationFields.UNSUPPORTED,
        "best_of": lambda v: v == 1,
        "suffix": lambda v: v == "",
        "echo": lambda v: v is False,
    }

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
