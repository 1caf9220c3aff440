"""Tool calling: tools in the prompt, calls parsed out of the completion, and the grammar that
forces calls when tool_choice asks for them.

The format is Hermes' (Qwen2.5, Hermes and many fine-tunes use it; models trained without tools
know it best of the open ones): each call is a JSON object {"name", "arguments"} between
<tool_call> and </tool_call> lines. A chat template that takes `tools` renders the tools and
the earlier calls itself; for one that does not (the default model's), duet adds the tools to
the system message and writes earlier calls and results into the conversation in the same
format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engines.grammar import JSON_LAYOUT, lark_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # a forced completion's most calls
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()

FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to help with the user's request. The functions are "
    "described inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, "
    "answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    'tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def for_template(self) -> dict:
        """OpenAI's tool object, as chat templates that take `tools` expect it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required", or a tool's name (forced)
    parallel: bool = True
    grammar: str | None = field(default=None, compare=False)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def call_grammar(tools: tuple[Tool, ...], parallel: bool) -> str:
    """The grammar of a completion that is nothing but calls of these tools (one, or with
    `parallel` up to as many as there are tools), each call's arguments valid for its
    function's schema. Unbounded, the default model repeated its call until max_tokens cut
    the last one."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    body = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    body["x-guidance"] = JSON_LAYOUT
    most = min(len(tools), MAX_PARALLEL_CALLS)
    calls = f'call ("\\n" call){{0,{most - 1}}}' if parallel and most > 1 else "call"
    lark = (f"start: {calls}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(body)}\n")
    return lark_grammar(lark)


def fallback_system_text(tools: tuple[Tool, ...]) -> str:
    return FALLBACK_INSTRUCTIONS.format(
        tools="\n".join(json.dumps(t.for_template(), ensure_ascii=False) for t in tools))


def call_text(name: str, arguments: Any) -> str:
    """An earlier call written the way the model is asked to write one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the text outside the calls, or None when nothing is left; the calls in OpenAI's shape).
    A block that is not a JSON object naming one of the tools stays text; a call repeated word
    for word (a small model's loop) counts once."""
    calls, kept, at, seen = [], [], 0, set()
    for start, end, body in _blocks(text):
        if not (isinstance(body, dict) and body.get("name") in names):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        kept.append(text[at:start])
        at = end
        key = json.dumps(body, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        calls.append({
            "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": body["name"],
                         "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)},
        })
    kept.append(text[at:])
    rest = "".join(kept).strip()
    return (rest or None), calls


def _blocks(text: str):
    """(start, end, body) of each block from OPEN to CLOSE: its JSON value read whole, so a
    string in the arguments may hold CLOSE (the grammar of a forced call lets it); a block that
    is not one JSON value ends at the first CLOSE, with body None."""
    at = 0
    while (start := text.find(OPEN, at)) >= 0:
        inside = _SPACE.match(text, start + len(OPEN)).end()
        try:
            body, end = _DECODER.raw_decode(text, inside)
        except ValueError:
            body = None
        else:
            close = _SPACE.match(text, end).end()
            if text.startswith(CLOSE, close):
                at = close + len(CLOSE)
                yield start, at, body
                continue
        close = text.find(CLOSE, start + len(OPEN))
        if close < 0:
            return
        at = close + len(CLOSE)
        yield start, at, None


class CallHolder:
    """A stream's text with tools about: text before a call goes out as it comes; from the
    first sign of a call (or a possible start of one at the end of what came) it is held, to be
    parsed when the completion ends."""

    def __init__(self) -> None:
        self.held = ""
        self._calling = False

    def feed(self, text: str) -> str:
        """What may be sent as content now."""
        if self._calling:
            self.held += text
            return ""
        whole = self.held + text
        at = whole.find(OPEN)
        if at >= 0:
            self._calling = True
            self.held = whole[at:]
            return whole[:at]
        keep = _partial_open(whole)
        self.held = whole[len(whole) - keep:] if keep else ""
        return whole[: len(whole) - keep]


def _partial_open(text: str) -> int:
    """How many characters at the end of text could begin OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
