"""The body of POST /v1/responses (OpenAI's Responses API), validated at the HTTP edge and
turned into what a chat request is: messages for the chat template, tools, a grammar.

duet is stateless: the conversation comes whole in `input` (a text, or message,
`function_call` and `function_call_output` items), and fields that would need a stored
response, conversation or prompt are refused by name. The sampling fields and duet's
extensions (`engine`, `top_k`, `seed`, `stop`, ...) are chat's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, model_validator
from pydantic_core import PydanticCustomError

from .protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS_CHAT,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    GenerationFields,
    JSONObjectFormat,
    JSONSchemaFormat,
    JSONSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    Strict,
    Text,
    TextFormat,
    ToolCall,
    ToolDef,
    generation_grammar,
    template_messages,
    tool_use,
)
from .tool_calls import ToolUse

LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for logprobs

# Fields that need state duet does not keep -> why they are refused.
STATEFUL = {
    "previous_response_id": "duet stores no responses: send the whole conversation in 'input'",
    "conversation": "duet stores no conversations: send the whole conversation in 'input'",
    "prompt": "duet stores no prompt templates: send 'instructions' and 'input'",
}
# Nullable in the Responses API, where null means the default.
NULL_IS_DEFAULT = ("temperature", "top_p")
ITEM_KINDS = {"message": "Message", "function_call": "FunctionCall",
              "function_call_output": "FunctionCallOutput"}
PART_TYPES = ("input_text", "output_text", "refusal")


def _refused(name: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "'{name}' is not supported: {why}",
                               {"name": name, "why": why})


def _kind(value: dict, name: str, default: str | None = None) -> str | None:
    """An object's `type`, which must be a string when it is there; name: its param."""
    kind = value.get("type", default)
    if kind is not None and not isinstance(kind, str):
        raise PydanticCustomError("invalid_value", "the type must be a string", {"name": name})
    return kind


class ContentPart(Strict):
    """A message's text part: input_text and output_text (an earlier answer's) carry `text`,
    refusal its `refusal`; annotations, logprobs and the like are ignored."""

    type: Literal["input_text", "output_text", "refusal"]
    text: Text | None = None
    refusal: Text | None = None

    @model_validator(mode="after")
    def _has_text(self):
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise PydanticCustomError("invalid_value", "{article} {kind} part needs its {field}",
                                      {"article": "a" if field == "refusal" else "an",
                                       "kind": self.type, "field": field})
        return self

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _text_or_list(value: Any) -> str:
    return "List" if isinstance(value, list) else "Text"


# A text or a list of parts, told apart first so that a part's error names the part.
TextOrParts = Annotated[Annotated[Text, Tag("Text")] | Annotated[list[ContentPart], Tag("List")],
                        Discriminator(_text_or_list)]


def _joined(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.value() for p in content)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextOrParts


class FunctionCallItem(Strict):
    """An earlier call of the model's, as the response's output gave it."""

    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text
    arguments: Text


class FunctionCallOutputItem(Strict):
    """The caller's result of an earlier call."""

    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: TextOrParts


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(kind := value.get("type", "message"), str):
        return ITEM_KINDS.get(kind)
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDef):
    """Responses' function tool: chat's function, flat, without the `function` wrapper."""

    type: Literal["function"]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: Text


class JSONSchemaTextFormat(JSONSchemaSpec):
    """Responses' json_schema format: chat's json_schema object, flat."""

    type: Literal["json_schema"]


def _tag(tags: dict[str, str]) -> Callable[[Any], str | None]:
    """A union's discriminator whose tags (capitalised: errors.py leaves them out of a
    param's path) are told apart by a dict's `type`, or by what the value is."""
    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            kind = value.get("type")
            return tags.get(kind) if isinstance(kind, str) else None
        return tags.get(type(value).__name__)

    return tag


class TextConfig(Strict):
    format: Annotated[
        Annotated[TextFormat, Tag("Text")] | Annotated[JSONObjectFormat, Tag("JSONObject")]
        | Annotated[JSONSchemaTextFormat, Tag("JSONSchema")],
        Discriminator(_tag({"text": "Text", "json_object": "JSONObject",
                            "json_schema": "JSONSchema"}),
                      custom_error_type="invalid_value",
                      custom_error_message="the format's type is one of 'text', 'json_object' "
                      "and 'json_schema'"),
    ] | None = None
    # verbosity is not read: a model without a verbosity setting has nothing to set

    def chat_format(self) -> TextFormat | JSONObjectFormat | JSONSchemaFormat | None:
        fmt = self.format
        if isinstance(fmt, JSONSchemaTextFormat):
            spec = JSONSchemaSpec.model_validate(fmt.model_dump(by_alias=True, exclude={"type"}))
            return JSONSchemaFormat(type="json_schema", json_schema=spec)
        return fmt


def _no_reasoning(value: Any) -> bool:
    return isinstance(value, dict) and all(
        v is None or (k == "effort" and v == "none") for k, v in value.items())


class ResponsesRequest(GenerationFields):
    # a text or items, told apart first so that an item's error names the item
    input: Annotated[Annotated[Text, Tag("Text")] | Annotated[list[InputItem], Tag("List")],
                     Discriminator(_text_or_list)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[Text] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)
    store: bool | None = None  # accepted either way: nothing is stored
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = None
    _messages: list[ChatMessage] = PrivateAttr(default_factory=list)
    _tool_use: ToolUse | None = PrivateAttr(None)
    _grammar_text: str | None = PrivateAttr(None)

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **GenerationFields.UNSUPPORTED,
        "n": lambda v: v == 1,
        "background": lambda v: v is False,
        "truncation": lambda v: v == "disabled",
        "reasoning": _no_reasoning,
        "context_management": lambda v: v == [],
        "moderation": lambda v: False,
    }

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_duet_lacks(cls, data: Any) -> Any:
        """Stateful fields, and items, parts, tools and tool choices of kinds duet does not
        serve, refused by name before the fields' own checks."""
        if not isinstance(data, dict):
            return data
        if any(data.get(name, 0) is None for name in NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}
        for name, why in STATEFUL.items():
            if data.get(name) is not None:
                raise _refused(name, why)
        items = data.get("input")
        for i, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict):
                raise PydanticCustomError(
                    "invalid_value", "an item must be an object: a message or a function_call "
                    "or function_call_output item", {"name": f"input[{i}]"})
            kind = _kind(item, f"input[{i}].type", "message")
            if kind not in ITEM_KINDS:
                why = ("duet stores no items: send them whole" if kind == "item_reference" else
                       "duet takes messages, function_call and function_call_output items")
                raise _refused(f"input[{i}].type", f"{str(kind)[:64]!r} items ({why})")
            content = item.get("content") if kind == "message" else item.get("output")
            for j, part in enumerate(content if isinstance(content, list) else []):
                field = "content" if kind == "message" else "output"
                where = f"input[{i}].{field}[{j}].type"
                if isinstance(part, dict) and _kind(part, where) not in PART_TYPES:
                    raise _refused(where,
                                   f"{str(part.get('type'))[:64]!r} parts (duet takes text: "
                                   "input_text, output_text, refusal)")
        tools = data.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            if isinstance(tool, dict) and _kind(tool, f"tools[{i}].type") != "function":
                raise _refused(f"tools[{i}].type", f"{str(tool.get('type'))[:64]!r} tools "
                               "(duet serves function tools only)")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and _kind(choice, "tool_choice.type") != "function":
            raise _refused("tool_choice.type", f"{str(choice.get('type'))[:64]!r} (duet takes "
                           "'none', 'auto', 'required' or a function)")
        return data

    @model_validator(mode="after")
    def _as_chat(self):
        """The conversation as chat messages, the tools as chat's, the grammar."""
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_MESSAGES:
            raise PydanticCustomError("invalid_value", "a list of 1 to {most} items is needed",
                                      {"name": "input", "most": MAX_MESSAGES})
        self._messages = conversation(self.instructions, self.input)
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        tools = [ToolDef(type="function", function=FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in self.tools or []]
        self._tool_use = tool_use(tools, choice, self.parallel_tool_calls is not False)
        fmt = self.text.chat_format() if self.text is not None else None
        self._grammar_text = generation_grammar(self._tool_use, fmt, "text.format")
        return self

    @property
    def tool_use(self) -> ToolUse | None:
        return self._tool_use

    @property
    def messages(self) -> list[ChatMessage]:
        return self._messages

    def grammar(self) -> str | None:
        return self._grammar_text

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens or self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or []) else None

    def template_messages(self, native_tools: bool) -> list[dict]:
        return template_messages(self._messages, self._tool_use, native_tools)

    def template_tools(self) -> list[dict] | None:
        return None if self._tool_use is None else [t.for_template()
                                                    for t in self._tool_use.tools]

    # What the response object echoes of the request.

    def tools_echo(self) -> list[dict]:
        return [t.model_dump() for t in self.tools or []]

    def tool_choice_echo(self) -> str | dict:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return choice.model_dump()
        return choice or "auto"

    def text_echo(self) -> dict:
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}}


def conversation(instructions: str | None, items: str | list) -> list[ChatMessage]:
    """The chat messages of `instructions` and `input`: instructions as a system message
    first; a function_call joins the assistant message before it (or makes one), a
    function_call_output becomes a tool message and must answer an earlier call."""
    messages = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    if isinstance(items, str):
        return [*messages, ChatMessage(role="user", content=items)]
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=_joined(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise PydanticCustomError(
                    "invalid_value", "no function_call item before it has the call_id "
                    "'{call_id}' (duet is stateless: send the call with its output)",
                    {"name": f"input[{i}].call_id", "call_id": item.call_id[:64]})
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_joined(item.output)))
    return messages
