"""POST /v1/responses: OpenAI's Responses API on the chat machinery. The request renders
through the chat template like a chat request (server/responses_protocol.py); its one
choice's progress (Choice.advance: shown text, held-back calls) becomes the response's output
items: a message with one output_text part when there is text (or nothing at all), then a
function_call item per call. A stream sends the same as Responses events, each with its
sequence_number, as `event:` and `data:` SSE lines; the non-streamed answer is built by the same
code from one batch, so a stream's deltas always add up to the answer's text.

Nothing is stored: a response's id names no stored object (GET and DELETE answer 404).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import RequestStats

from .choices import Choice, Progress, merged
from .errors import APIError, echo
from .responses_protocol import ResponsesRequest
from .service import (
    SSE_HEADERS,
    GenerationService,
    chat_prompts,
    close_all,
    collect_all,
    first_events,
)
from .streaming import metrics, to_json

log = logging.getLogger("duet.server")

PROMPT_PARAM = "input"


def not_stored(response_id: str) -> APIError:
    return APIError(
        404, f"duet stores no responses, so there is no response '{echo(response_id)}' to read, "
        "cancel or delete: each POST /v1/responses carries its whole conversation in 'input'",
        param="response_id", code="response_not_found")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(stats: RequestStats) -> dict:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def status_of(stats: RequestStats) -> str:
    # A cancelled generation has no reader; like a cut one it did not end by itself.
    return "completed" if stats.finish_reason == "stop" else "incomplete"


class ResponseObject:
    """The response being made: its id and time, the request's settings it echoes, its output
    items, and the numbered SSE events that report it."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.sequence = 0

    def whole(self, status: str, stats: RequestStats | None = None,
              error: dict | None = None) -> dict:
        req = self.req
        out = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "metadata": req.metadata or {}, "model": self.model,
            "output": list(self.output), "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False, "temperature": req.temperature,
            "text": req.text_echo(), "tool_choice": req.tool_choice_echo(),
            "tools": req.tools_echo(), "top_logprobs": req.top_logprobs or 0,
            "top_p": req.top_p, "truncation": "disabled",
            "usage": usage(stats) if stats is not None else None, "user": req.user,
        }
        if status == "completed":
            out["completed_at"] = int(time.time())
        if stats is not None:
            out["metrics"] = metrics(stats)  # duet's, as in chat
        return out

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(payload)}\n\n"


class OutputItems:
    """The output items as a choice's progress comes in, and the events that report each
    change. The message opens at the first shown text (at the end when there is neither text
    nor a call: an empty answer is an empty message); the calls follow it, whole. Whitespace
    at the end of the text so far waits for more text: before a call it is dropped."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.message: dict | None = None
        self.index = -1  # the message's place in the output
        self.text = ""
        self.blank = ""  # trailing whitespace not sent yet
        self.logprobs: list[dict] = []  # every token's entries, shown text or not
        self.sent = 0  # of those, how many deltas carried
        self.stats: RequestStats | None = None

    def add(self, progress: Progress) -> list[str]:
        events = []
        if progress.logprobs:
            self.logprobs += progress.logprobs["content"]
        if progress.text:
            events += self._say(progress.text)
        stats = progress.stats
        if stats is None:
            return events
        self.stats = stats
        if progress.rest:
            events += self._say(progress.rest)
        if not progress.calls:  # whitespace before a call is dropped, at the end it is text
            events += self._emit(self.blank) if self.blank else []
            events += self._open() if self.message is None else []
        if self.message is not None:
            events += self._close(status_of(stats))
        for call in progress.calls:
            events += self._call(call)
        return events

    def _open(self) -> list[str]:
        r = self.response
        self.message = {"type": "message", "id": _id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []}
        self.index = len(r.output)
        r.output.append(self.message)
        return [r.event("response.output_item.added", output_index=self.index,
                        item=self.message),
                r.event("response.content_part.added", item_id=self.message["id"],
                        output_index=self.index, content_index=0, part=self._part(""))]

    def _say(self, text: str) -> list[str]:
        """Shown text, its trailing whitespace held until more text follows."""
        text = self.blank + text
        shown = text.rstrip()
        self.blank = text[len(shown):]
        return self._emit(shown) if shown else []

    def _emit(self, text: str) -> list[str]:
        events = self._open() if self.message is None else []
        self.text += text
        entries, self.sent = self.logprobs[self.sent:], len(self.logprobs)
        events.append(self.response.event(
            "response.output_text.delta", item_id=self.message["id"], output_index=self.index,
            content_index=0, delta=text, logprobs=entries))
        return events

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprobs if text else []}

    def _close(self, status: str) -> list[str]:
        r, message = self.response, self.message
        part = self._part(self.text)
        message.update(status=status, content=[part])
        where = {"item_id": message["id"], "output_index": self.index, "content_index": 0}
        return [r.event("response.output_text.done", **where, text=self.text,
                        logprobs=self.logprobs),
                r.event("response.content_part.done", **where, part=part),
                r.event("response.output_item.done", output_index=self.index, item=message)]

    def _call(self, call: dict) -> list[str]:
        r = self.response
        function = call["function"]
        item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                "name": function["name"], "arguments": "", "status": "in_progress"}
        index = len(r.output)
        r.output.append(item)
        events = [r.event("response.output_item.added", output_index=index, item=dict(item))]
        item.update(arguments=function["arguments"], status="completed")
        where = {"item_id": item["id"], "output_index": index}
        return events + [
            r.event("response.function_call_arguments.delta", **where,
                    delta=function["arguments"]),
            r.event("response.function_call_arguments.done", **where,
                    arguments=function["arguments"], name=function["name"]),
            r.event("response.output_item.done", output_index=index, item=item)]


async def create_response(service: GenerationService, req: ResponsesRequest):
    started = await service.start(req, chat_prompts(req, PROMPT_PARAM), PROMPT_PARAM,
                                  chat=True, inline=False, tools=req.tool_use)
    response = ResponseObject(req, started.model)
    (choice,) = started.choices
    if req.stream:
        firsts = await first_events(started.choices, PROMPT_PARAM)
        return StreamingResponse(_events(response, choice, firsts[0]),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    ((steps, stats),) = await collect_all(started.choices, PROMPT_PARAM)
    items = OutputItems(response)
    items.add(choice.advance([*steps, stats]))  # the stream's events, unsent
    return JSONResponse(response.whole(status_of(stats), stats))


async def _events(response: ResponseObject, choice: Choice, first: list) -> AsyncIterator[str]:
    items = OutputItems(response)
    try:
        yield response.event("response.created", response=response.whole("in_progress"))
        yield response.event("response.in_progress", response=response.whole("in_progress"))
        async with aclosing(merged([choice], [first])) as arriving:
            async for _, batch in arriving:
                for event in items.add(choice.advance(batch)):
                    yield event
        stats = items.stats
        if stats is None:
            raise APIError(500, "the engine ended without statistics", type="server_error")
        status = status_of(stats)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield response.event(kind, response=response.whole(status, stats))
    except APIError as exc:  # e.g. the time limit
        log.warning("response stream ended early: %s", exc.message)
        for event in _failed(response, exc.message, exc.code):
            yield event
    except Exception as exc:
        log.exception("generation failed mid-stream")
        for event in _failed(response, f"generation failed: {exc}", None):
            yield event
    finally:
        await close_all([choice])


def _failed(response: ResponseObject, message: str, code: str | None) -> list[str]:
    """An `error` event, then response.failed with the response as it stood."""
    return [response.event("error", code=code or "server_error", message=message, param=None),
            response.event("response.failed", response=response.whole(
                "failed", error={"code": "server_error", "message": message}))]
