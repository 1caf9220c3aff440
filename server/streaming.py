"""OpenAI response objects and their SSE framing, for chat and text completions alike."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import orjson

from engines.base import RequestStats


def to_json(payload: dict | str) -> str:
    """A chunk as JSON text. orjson: a chunk with logprobs took 18 us with json.dumps, 1.3 with
    orjson, and 64 streams of them kept the event loop behind the engine. numpy's scalars
    (which json.dumps took where they subclass float) are written as numbers."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else to_json(payload)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
_SLOT = "\u0001"  # where a chunk's text goes: JSON escapes it, no model id or text field holds it


def usage(stats: RequestStats | list[RequestStats], n: int = 1) -> dict:
    """Every choice's completion tokens; each prompt's tokens once, however many of its `n`
    choices there are (choices come prompt-major: every n-th is a new prompt's first)."""
    every = stats if isinstance(stats, list) else [stats]
    prompt = sum(s.prompt_tokens for s in every[::n])
    cached = sum(s.cached_tokens for s in every[::n])
    completion = sum(s.completion_tokens for s in every)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def metrics(stats: RequestStats) -> dict:
    return {
        "engine": stats.engine,
        "device": stats.device,
        "queue_ms": round(stats.queue_s * 1000, 3),
        "ttft_ms": round(stats.ttft_s * 1000, 3),
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
        "peak_memory_bytes": stats.peak_memory_bytes,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "total_ms": round(stats.total_s * 1000, 3),
    }


def finish_reason(stats: RequestStats, called: bool = False) -> str:
    # A cancelled request has no reader; report it as OpenAI's closest reason.
    if stats.finish_reason == "cancelled":
        return "length"
    return "tool_calls" if called and stats.finish_reason == "stop" else stats.finish_reason


@dataclass
class ResponseShape:
    """Builds the objects of one response: same id and creation time in every chunk."""

    chat: bool
    model: str

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_events: dict[tuple[bool, int], tuple[str, str]] = {}

    def _base(self, chunk: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str | None, stats: RequestStats,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason(stats, bool(tool_calls)))
        return choice

    def full(self, choices: list[dict], stats: list[RequestStats], n: int = 1) -> dict:
        """The whole response. Its metrics are the first choice's (each choice is a sequence of
        its own in the batch; they ran together)."""
        return {
            **self._base(False), "choices": choices, "usage": usage(stats, n),
            "metrics": metrics(stats[0]),
        }

    def chunk(self, text: str | None = None, *, first: bool = False, stats: RequestStats | None = None,
              include_usage: bool = False, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None, called: bool = False,
              index: int = 0) -> dict:
        """index: the choice's; tool_calls: calls this chunk carries (OpenAI's delta entries,
        each with its own index); called: the choice made calls (its last chunk's finish_reason
        says so)."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs,
                      finish_reason=finish_reason(stats, called) if stats else None)
        out = {**self._base(True), "choices": [choice]}
        if include_usage:
            out["usage"] = None  # as OpenAI does: only the trailing chunk carries usage
        if stats is not None:
            out["metrics"] = metrics(stats)
        return out

    def text_event(self, text: str, include_usage: bool = False, index: int = 0) -> str:
        """sse(self.chunk(text, include_usage=..., index=...)), the same bytes, from a template
        made once per response and choice: a busy stream sends thousands of these a second,
        and only the text changes between them."""
        key = (include_usage, index)
        template = self._text_events.get(key)
        if template is None:
            whole = to_json(self.chunk(_SLOT, include_usage=include_usage, index=index))
            before, _, after = whole.partition(to_json(_SLOT))
            template = self._text_events[key] = ("data: " + before, after + "\n\n")
        return template[0] + to_json(text) + template[1]

    def usage_chunk(self, stats: list[RequestStats], n: int = 1) -> dict:
        return {**self._base(True), "choices": [], "usage": usage(stats, n),
                "metrics": metrics(stats[0])}

    @staticmethod
    def error_event(message: str, type_: str = "server_error", code: str | None = None) -> dict:
        return {"error": {"message": message, "type": type_, "param": None, "code": code}}
