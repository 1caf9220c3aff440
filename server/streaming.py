"""OpenAI response objects and their SSE framing, for chat and text completions alike."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from engines.base import RequestStats


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
_SLOT = "\u0001"  # where a chunk's text goes: JSON escapes it, no model id or text field holds it


def usage(stats: RequestStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


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


def finish_reason(stats: RequestStats) -> str:
    # A cancelled request has no reader; report it as OpenAI's closest reason.
    return "length" if stats.finish_reason == "cancelled" else stats.finish_reason


@dataclass
class ResponseShape:
    """Builds the objects of one response: same id and creation time in every chunk."""

    chat: bool
    model: str

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_events: dict[bool, tuple[str, str]] = {}

    def _base(self, chunk: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, stats: RequestStats) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason(stats))
        return {
            **self._base(False), "choices": [choice], "usage": usage(stats),
            "metrics": metrics(stats),
        }

    def chunk(self, text: str | None = None, *, first: bool = False, stats: RequestStats | None = None,
              include_usage: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason(stats) if stats else None)
        out = {**self._base(True), "choices": [choice]}
        if include_usage:
            out["usage"] = None  # as OpenAI does: only the trailing chunk carries usage
        if stats is not None:
            out["metrics"] = metrics(stats)
        return out

    def text_event(self, text: str, include_usage: bool = False) -> str:
        """sse(self.chunk(text, include_usage=...)), the same bytes, from a template made once
        per response: a busy stream sends thousands of these a second, and only the text
        changes between them."""
        template = self._text_events.get(include_usage)
        if template is None:
            whole = json.dumps(self.chunk(_SLOT, include_usage=include_usage), ensure_ascii=False)
            before, _, after = whole.partition(json.dumps(_SLOT))
            template = self._text_events[include_usage] = ("data: " + before, after + "\n\n")
        return template[0] + json.dumps(text, ensure_ascii=False) + template[1]

    def usage_chunk(self, stats: RequestStats) -> dict:
        return {**self._base(True), "choices": [], "usage": usage(stats), "metrics": metrics(stats)}

    @staticmethod
    def error_event(message: str, type_: str = "server_error", code: str | None = None) -> dict:
        return {"error": {"message": message, "type": type_, "param": None, "code": code}}
