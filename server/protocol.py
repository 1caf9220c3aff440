"""The OpenAI request bodies duet accepts, validated once at the HTTP edge.

Unknown fields are ignored, as OpenAI clients send many optional ones; every field duet does
read is checked here, and each request turns itself into engine SamplingParams. OpenAI fields
that would change the answer but that duet does not implement are refused by name (400,
code unsupported_parameter) unless they hold their neutral value, never silently dropped.
Types are checked as strictly as OpenAI's API checks them: "10" is not a number, nor true.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engines.base import SamplingParams
from engines.grammar import GrammarError, json_schema_grammar
from engines.keep_alive import parse_keep_alive

from .tool_calls import Tool, ToolUse, call_grammar, call_text, fallback_system_text

MAX_STOP = 4
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's limits
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 128  # prompts x n in one request
MAX_PROMPTS = 128
_SIBLING_STRIDE = 0x9E3779B97F4A7C15  # odd: n siblings' seeds never meet
MAX_TOOLS = 128  # OpenAI's limit
MAX_LOGPROBS_COMPLETION = 5
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


def _valid_keep_alive(value: str | float) -> str | float:
    parse_keep_alive(value)
    return value


# A duration as Ollama's keep_alive takes it (engines/keep_alive.py).
KeepAlive = Annotated[str | float, AfterValidator(_valid_keep_alive)]


class Strict(BaseModel):
    """A request body or part of one: OpenAI clients send many optional fields, which are
    ignored; the ones read are typed as strictly as OpenAI types them."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self, native_tools: bool = True) -> dict:
        """The message as chat templates take it. Earlier tool calls and results go as
        OpenAI-shaped fields to a template that takes tools, else as text in the format the
        model is asked to call in (server/tool_calls.py)."""
        # Chat templates know "system", not OpenAI's newer "developer".
        role = "system" if self.role == "developer" else self.role
        if native_tools:
            out: dict[str, Any] = {"role": role, "content": self.text()}
            if self.tool_calls:
                out["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name,
                                  "arguments": _arguments(c.function.arguments)}}
                    for c in self.tool_calls]
            if self.tool_call_id is not None:
                out["tool_call_id"] = self.tool_call_id
            return out
        if role == "tool":
            return {"role": "user",
                    "content": f"<tool_response>\n{self.text()}\n</tool_response>"}
        text = self.text()
        if self.tool_calls:
            calls = "\n".join(call_text(c.function.name, c.function.arguments)
                              for c in self.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        return {"role": role, "content": text}


def _arguments(text: str) -> Any:
    """Templates index into arguments: a JSON object's text becomes the object."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationFields(Strict):
    """What chat and text completions share."""


    model: Text = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=TOP_K_MAX, description="duet extension: keep the k most "
                       "likely tokens (0, or a k at or above the vocabulary: keep all)")
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    engine: EngineChoice | None = Field(
        None, description="duet extension: the engine that serves this request"
    )
    keep_alive: KeepAlive | None = Field(
        None, description="duet extension (Ollama's): how long the model stays loaded after "
        "this request (30s, 5m; 0: unloaded once it is done; -1: kept); default: the model's")
    ignore_eos: bool = Field(
        False, description="duet extension (as vLLM's): keep generating past end-of-sequence "
        "tokens, to max_tokens (benchmarks)",
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, description="duet extension (as vLLM's): divide the logits of "
        "tokens already in the prompt or completion by this when positive, multiply when not")
    min_p: float | None = Field(
        None, ge=0.0, le=1.0, description="duet extension (as vLLM's): after temperature, drop "
        "tokens less likely than min_p times the likeliest")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, not '{key[:20]}'")
        return value

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

    def logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k likeliest alternatives'."""
        return None

    def grammar(self) -> str | None:
        """The grammar the completion must follow, if any."""
        return None

    def choice_params(self, max_tokens: int) -> list[SamplingParams]:
        """Each of a prompt's n choices' parameters. With a seed, choice j draws from seed and j
        (choice 0 from the seed itself), so siblings differ and each is repeatable."""
        params = self.to_sampling_params(max_tokens)
        if self.n == 1:
            return [params]
        return [params if params.seed is None or j == 0 else
                dataclasses.replace(params, seed=(params.seed + j * _SIBLING_STRIDE) % 2**64)
                for j in range(self.n)]

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else self.seed % 2**64,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_wanted(),
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            min_p=self.min_p or 0.0,
            grammar=self.grammar(),
        )


def _no_tools(value: Any) -> bool:
    return value == []


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat,
                           Field(discriminator="type")]


def response_grammar(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None,
                     name: str = "response_format") -> str | None:
    """The grammar a response format asks for (None: free text). A schema llguidance cannot
    follow is a 400 naming what it lacks; name: the request's field that holds the format."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    schema = fmt.json_schema.schema_ if isinstance(fmt, JSONSchemaFormat) else None
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise PydanticCustomError(
            "invalid_value", "{name}: this schema cannot be followed: {why}",
            {"name": name, "why": str(exc)[:300]}) from None


def generation_grammar(tools: ToolUse | None,
                       fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None,
                       name: str = "response_format") -> str | None:
    """The grammar of a chat-shaped request: its forced tool calls', else its format's. A forced
    call with a JSON format is a 400 naming the format's field (name)."""
    if tools is not None and tools.forced:
        if fmt is not None and not isinstance(fmt, TextFormat):
            raise PydanticCustomError(
                "invalid_value", "{name} cannot be combined with a tool_choice that forces "
                "a call", {"name": name})
        return tools.grammar
    return response_grammar(fmt, name)


def template_messages(messages: list[ChatMessage], tools: ToolUse | None,
                      native_tools: bool) -> list[dict]:
    """Messages for the model's chat template. native_tools: the template renders tools, calls
    and results itself; else the tools join the system message as text."""
    out = [m.for_template(native_tools) for m in messages]
    if tools is not None and not native_tools:
        offer = fallback_system_text(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{offer}".strip()}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _grammar_text: str | None = PrivateAttr(None)
    _tool_use: ToolUse | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _grammar(self):
        # Compiled once here: a schema that cannot be followed is refused before any work.
        self._tool_use = tool_use(self.tools or [], self.tool_choice,
                                  self.parallel_tool_calls is not False)
        self._grammar_text = generation_grammar(self._tool_use, self.response_format)
        return self

    def grammar(self) -> str | None:
        return self._grammar_text

    @property
    def tool_use(self) -> ToolUse | None:
        """The tools the model is offered and what is asked of them (None: no tools, or
        tool_choice "none")."""
        return self._tool_use

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "invalid_value", "{name} needs logprobs to be true", {"name": "top_logprobs"})
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **GenerationFields.UNSUPPORTED,
        "functions": _no_tools,
        "function_call": lambda v: v in ("none", "auto"),
        "audio": lambda v: False,
        "modalities": lambda v: v == ["text"],
        "prediction": lambda v: False,
        "web_search_options": lambda v: False,
        "reasoning_effort": lambda v: False,
    }

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self, native_tools: bool) -> list[dict]:
        """The messages for the model's chat template (see template_messages)."""
        return template_messages(self.messages, self._tool_use, native_tools)

    def template_tools(self) -> list[dict] | None:
        return None if self._tool_use is None else [t.for_template()
                                                    for t in self._tool_use.tools]


def tool_use(tools: list[ToolDef], choice, parallel: bool) -> ToolUse | None:
    """What the request asks of its tools; 400s for a choice that names no tool, forces a call
    without tools, or tools whose parameters cannot be followed."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise PydanticCustomError("invalid_value", "{name} needs tools to choose from",
                                  {"name": "tool_choice"})
    specs = tuple(Tool(t.function.name, t.function.description,
                       t.function.parameters or {"type": "object", "properties": {}})
                  for t in tools)
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise PydanticCustomError("invalid_value", "{name}: two tools share a name",
                                  {"name": "tools"})
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise PydanticCustomError(
                "invalid_value", "{name} names '{tool}', which is not among the tools",
                {"name": "tool_choice", "tool": choice.function.name[:64]})
        choice = choice.function.name
    forced = [t for t in specs if choice in ("required", t.name)]
    try:
        grammar = call_grammar(tuple(forced), parallel and choice == "required") \
            if choice != "auto" else None
        if choice == "auto":  # each schema checked all the same, so a bad one is a 400 now
            call_grammar(specs, False)
    except GrammarError as exc:
        raise PydanticCustomError(
            "invalid_value", "{name}: a function's parameters cannot be followed: {why}",
            {"name": "tools", "why": str(exc)[:300]}) from None
    return ToolUse(specs, choice, parallel, grammar)


class CompletionRequest(GenerationFields):
    # A text, texts, a prompt's token ids, or several prompts' token ids (lm-eval sends these).
    prompt: Text | list[Text] | list[int] | list[list[int]]
    # With echo, 0 asks for the prompt's scores alone (lm-eval's loglikelihood).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS_COMPLETION)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        params = super().to_sampling_params(max_tokens)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    @model_validator(mode="after")
    def _nothing_asked(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "invalid_value", "{name} may be 0 only with echo (to score the prompt)",
                {"name": "max_tokens"})
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def has_text_prompt(self) -> bool:
        return any(isinstance(p, str) for p in self.prompts())

    @model_validator(mode="after")
    def _choice_count(self):
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise PydanticCustomError(
                "invalid_value", "{name}: prompts times n is at most {most}",
                {"name": "n", "most": MAX_CHOICES})
        return self

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **GenerationFields.UNSUPPORTED,
        "best_of": lambda v: v == 1,
        "suffix": lambda v: v == "",
    }

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p):
        if isinstance(p, list):
            if not p or (isinstance(p[0], list) and not all(p)):
                raise ValueError("prompt must not be empty")
            if not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed")
        return p


class TokenizeRequest(Strict):
    """vLLM's /tokenize body: a prompt, or messages through the chat template."""

    model: Text | None = Field(None, min_length=1, max_length=256)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "send exactly one of prompt or {name}",
                                      {"name": "messages"})
        return self


class DetokenizeRequest(Strict):
    model: Text | None = Field(None, min_length=1, max_length=256)
    tokens: list[int] = Field(max_length=1 << 20)
