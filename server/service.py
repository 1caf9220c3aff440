"""Requests -> engine calls -> OpenAI objects. The one place that knows both sides."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import Engine, EngineError, RequestStats, Step, check_context

from .errors import APIError, bad_request, from_engine_error
from .protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from .registry import ModelRegistry
from .streaming import DONE, ResponseShape, sse

log = logging.getLogger("duet.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GenerationObserver(Protocol):
    def observe_generation(self, model: str, engine: str, stats: RequestStats) -> None: ...


class GenerationService:
    def __init__(self, registry: ModelRegistry, observer: GenerationObserver | None = None):
        self.registry = registry
        self.observer = observer

    async def chat(self, req: ChatCompletionRequest):
        messages = req.template_messages()

        def prompt(engine: Engine) -> list[int]:
            try:
                return engine.apply_chat_template(messages)
            except ValueError as exc:  # a model without a chat template
                raise bad_request(str(exc), param="messages") from exc
            except Exception as exc:  # the template itself rejected the conversation
                raise bad_request(f"the chat template failed: {exc}", param="messages") from exc

        return await self._generate(req, prompt, "messages", chat=True, inline=False)

    async def completion(self, req: CompletionRequest):
        def prompt(engine: Engine) -> list[int]:
            if isinstance(req.prompt, str):
                return engine.tokenize(req.prompt)
            vocab = engine.tokenizer.vocab_size
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary", param="prompt")
            return list(req.prompt)

        # Token ids need only a range check: on the event loop, cheaper than a thread's round trip
        # (which 64 requests arriving at once would queue for). Text is encoded on a thread.
        return await self._generate(req, prompt, "prompt", chat=False,
                                    inline=not isinstance(req.prompt, str))

    async def _generate(
        self,
        req: GenerationFields,
        prompt_of: Callable[[Engine], list[int]],
        prompt_param: str,
        *,
        chat: bool,
        inline: bool,
    ):
        spec = self.registry.spec(req.model)
        if spec.task != "generate":
            raise bad_request(f"model '{spec.id}' is a {spec.task} model", param="model")
        try:
            worker = await self.registry.worker(spec.id, req.engine)
            engine = worker.engine
            prompt_ids = (prompt_of(engine) if inline
                          else await asyncio.to_thread(prompt_of, engine))
            if not prompt_ids:
                raise bad_request("the prompt is empty", param=prompt_param)
            params = req.to_sampling_params(self._max_tokens(req, len(prompt_ids), engine))
        except EngineError as exc:
            raise from_engine_error(exc, prompt_param) from exc

        events = self._observed(
            worker.generate(prompt_ids, params),
            spec.id, engine.name,
        )
        shape = ResponseShape(chat=chat, model=spec.id)
        if req.stream:
            return await self._stream_response(events, shape, req.include_usage, prompt_param)
        text, stats = await _collect(events, prompt_param)
        return JSONResponse(shape.full(text, stats))

    async def _observed(self, events: AsyncIterator, model: str, engine: str) -> AsyncIterator:
        try:
            async for batch in events:
                if isinstance(batch[-1], RequestStats) and self.observer is not None:
                    self.observer.observe_generation(model, engine, batch[-1])
                yield batch
        finally:
            await events.aclose()  # an early exit must reach the worker, which stops the engine

    @staticmethod
    def _max_tokens(req: GenerationFields, prompt_tokens: int, engine: Engine) -> int:
        context = engine.info.context_length
        asked = req.requested_max_tokens()
        if asked is None:
            # OpenAI's default: as many as the context leaves, at least one.
            check_context(prompt_tokens, 1, context)
            return context - prompt_tokens
        check_context(prompt_tokens, asked, context)
        return asked

    async def _stream_response(
        self, events: AsyncIterator, shape: ResponseShape, include_usage: bool, prompt_param: str
    ) -> StreamingResponse:
        # Wait for the first event so a failure before any token is an HTTP error, not a 200.
        try:
            first = await anext(events)
        except EngineError as exc:
            raise from_engine_error(exc, prompt_param) from exc
        except APIError:
            raise
        except Exception as exc:
            log.exception("generation failed before its first token")
            raise APIError(500, f"generation failed: {exc}", type="server_error") from exc

        async def body() -> AsyncIterator[str]:
            try:
                if shape.chat:
                    yield sse(shape.chunk(first=True, include_usage=include_usage))
                batch: list = first
                while True:
                    # A batch holds what arrived since the last look: one chunk carries it all.
                    text = "".join(e.text for e in batch if isinstance(e, Step))
                    if text:
                        yield shape.text_event(text, include_usage)
                    if isinstance(batch[-1], RequestStats):
                        yield sse(shape.chunk(stats=batch[-1], include_usage=include_usage))
                        if include_usage:
                            yield sse(shape.usage_chunk(batch[-1]))
                        break
                    batch = await anext(events)
            except APIError as exc:  # e.g. the time limit
                log.warning("stream ended early: %s", exc.message)
                yield sse(shape.error_event(exc.message, exc.type, exc.code))
            except Exception as exc:
                log.exception("generation failed mid-stream")
                yield sse(shape.error_event(f"generation failed: {exc}"))
            finally:
                await events.aclose()
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _collect(events: AsyncIterator, prompt_param: str) -> tuple[str, RequestStats]:
    parts: list[str] = []
    try:
        async for batch in events:
            for event in batch:
                if isinstance(event, Step):
                    parts.append(event.text)
                else:
                    return "".join(parts), event
    except EngineError as exc:
        raise from_engine_error(exc, prompt_param) from exc
    except APIError:
        raise
    except Exception as exc:
        log.exception("generation failed")
        raise APIError(500, f"generation failed: {exc}", type="server_error") from exc
    finally:
        await events.aclose()  # frees the worker's slot now, not when garbage is collected
    raise APIError(500, "the engine ended without statistics", type="server_error")
