"""Requests -> engine calls -> OpenAI objects. The one place that knows both sides."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import NamedTuple, Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import Engine, EngineError, RequestStats, Step, check_context

from .choices import Choice, merged
from .errors import APIError, bad_request, from_engine_error, wrong_task
from .logprobs import LogprobsFormat
from .protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from .registry import ModelRegistry
from .streaming import DONE, ResponseShape, sse
from .tool_calls import ToolUse

log = logging.getLogger("duet.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class GenerationObserver(Protocol):
    def observe_generation(self, model: str, engine: str, stats: RequestStats) -> None: ...


class GenerationService:
    def __init__(self, registry: ModelRegistry, observer: GenerationObserver | None = None):
        self.registry = registry
        self.observer = observer

    async def chat(self, req: ChatCompletionRequest):
        return await self._generate(req, chat_prompts(req, "messages"), "messages", chat=True,
                                    inline=False, tools=req.tool_use)

    async def completion(self, req: CompletionRequest):
        def prompts(engine: Engine) -> list[list[int]]:
            vocab = engine.tokenizer.vocab_size
            out = []
            for prompt in req.prompts():
                if isinstance(prompt, str):
                    out.append(engine.tokenize(prompt))
                    continue
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise bad_request(f"token id {bad[0]} is outside the vocabulary",
                                      param="prompt")
                out.append(list(prompt))
            return out

        # Token ids need only a range check: on the event loop, cheaper than a thread's round trip
        # (which 64 requests arriving at once would queue for). Text is encoded on a thread.
        return await self._generate(req, prompts, "prompt", chat=False,
                                    inline=not req.has_text_prompt())

    async def _generate(
        self,
        req: GenerationFields,
        prompts_of: Callable[[Engine], list[list[int]]],
        prompt_param: str,
        *,
        chat: bool,
        inline: bool,
        tools: ToolUse | None = None,
    ):
        started = await self.start(req, prompts_of, prompt_param, chat=chat, inline=inline,
                                   tools=tools)
        choices = started.choices
        shape = ResponseShape(chat=chat, model=started.model)
        if req.stream:
            return await self._stream_response(choices, shape, req, prompt_param)
        done = await collect_all(choices, prompt_param)
        return JSONResponse(shape.full([c.whole(shape, steps, stats)
                                        for c, (steps, stats) in zip(choices, done)],
                                       [stats for _, stats in done], req.n))

    async def start(
        self,
        req: GenerationFields,
        prompts_of: Callable[[Engine], list[list[int]]],
        prompt_param: str,
        *,
        chat: bool,
        inline: bool,
        tools: ToolUse | None = None,
    ) -> Started:
        """The request's choices, each a generation in its engine's batch: prompts made (on a
        thread unless inline), checked against the context, the worker asked. Their events are
        for the caller to read and close."""
        spec = self.registry.spec(req.model)
        if spec.task != "generate":
            raise wrong_task(spec.id, spec.task, ("generate",))
        try:
            worker = await self.registry.worker(spec.id, req.engine, req.keep_alive)
            engine = worker.engine
            prompts = (prompts_of(engine) if inline
                       else await asyncio.to_thread(prompts_of, engine))
            if not all(prompts):
                raise bad_request("the prompt is empty", param=prompt_param)
            runs = [(prompt, params) for prompt in prompts
                    for params in req.choice_params(self._max_tokens(req, len(prompt), engine))]
            vocab = engine.tokenizer.vocab_size
            outside = [t for t, _ in runs[0][1].logit_bias if t >= vocab]
            if outside:
                raise bad_request(f"token id {outside[0]} is outside the vocabulary (of "
                                  f"{vocab})", param="logit_bias")
        except EngineError as exc:
            raise from_engine_error(exc, prompt_param) from exc

        echoes = [None] * len(runs)
        if isinstance(req, CompletionRequest) and req.echo:
            texts = [p if isinstance(p, str) else engine.tokenizer.decode(p)
                     for p in req.prompts()]
            echoes = [(texts[i // req.n], prompt) for i, (prompt, _) in enumerate(runs)]
        choices = [
            Choice(i, self._observed(worker.generate(prompt, params), spec.id, engine.name),
                   None if params.logprobs is None else LogprobsFormat(chat, engine.tokenizer),
                   tools, echoes[i])
            for i, (prompt, params) in enumerate(runs)]
        return Started(spec.id, choices)

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

    async def _stream_response(self, choices: list[Choice], shape: ResponseShape,
                               req: GenerationFields, prompt_param: str) -> StreamingResponse:
        firsts = await first_events(choices, prompt_param)
        include_usage = req.include_usage

        async def body() -> AsyncIterator[str]:
            stats: dict[int, RequestStats] = {}
            try:
                if shape.chat:
                    for c in choices:
                        yield sse(shape.chunk(first=True, include_usage=include_usage,
                                              index=c.index))
                # A batch holds what arrived since the last look: one chunk carries it all.
                async with aclosing(merged(choices, firsts)) as arriving:
                    async for choice, batch in arriving:
                        for event in choice.chunks(shape, batch, include_usage):
                            yield event
                        if isinstance(batch[-1], RequestStats):
                            stats[choice.index] = batch[-1]
                if include_usage:
                    yield sse(shape.usage_chunk([stats[c.index] for c in choices], req.n))
            except (APIError, EngineError) as exc:  # the time limit, the device's memory
                err = exc if isinstance(exc, APIError) else from_engine_error(exc)
                log.warning("stream ended early: %s", err.message)
                yield sse(shape.error_event(err.message, err.type, err.code))
            except Exception as exc:
                log.exception("generation failed mid-stream")
                yield sse(shape.error_event(f"generation failed: {exc}"))
            finally:
                await close_all(choices)
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


class Started(NamedTuple):
    model: str  # the served model's id
    choices: list[Choice]


def chat_prompts(req: ChatShaped,
                 param: str) -> Callable[[Engine], list[list[int]]]:
    """The prompt of a chat-shaped request, through the engine's chat template; param: the
    request's field that a template failure is blamed on."""
    def prompts(engine: Engine) -> list[list[int]]:
        native = engine.tokenizer.template_takes_tools
        messages = req.template_messages(native)
        try:
            return [engine.apply_chat_template(messages,
                                               req.template_tools() if native else None)]
        except ValueError as exc:  # a model without a chat template
            raise bad_request(str(exc), param=param) from exc
        except Exception as exc:  # the template itself rejected the conversation
            raise bad_request(f"the chat template failed: {exc}", param=param) from exc

    return prompts


class ChatShaped(Protocol):
    """What a request that renders through the chat template offers (chat's, Responses')."""

    def template_messages(self, native_tools: bool) -> list[dict]: ...

    def template_tools(self) -> list[dict] | None: ...


async def first_events(choices: list[Choice], prompt_param: str) -> list[list]:
    """Each choice's first batch of events, waited for before a stream's 200 so that a failure
    before any token is an HTTP error; on a failure every choice is closed."""
    try:
        return [await anext(c.events) for c in choices]
    except BaseException as exc:
        await close_all(choices)
        if isinstance(exc, EngineError):
            raise from_engine_error(exc, prompt_param) from exc
        if isinstance(exc, APIError) or not isinstance(exc, Exception):
            raise
        log.exception("generation failed before its first token")
        raise APIError(500, f"generation failed: {exc}", type="server_error") from exc


async def collect_all(choices: list[Choice],
                      prompt_param: str) -> list[tuple[list[Step], RequestStats]]:
    """Every choice's steps and stats, read together; one failure ends the others now."""
    tasks = [asyncio.create_task(_collect(c.events, prompt_param)) for c in choices]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:  # one failed: the others leave the batch now, not at their end
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def close_all(choices: list[Choice]) -> None:
    """Every choice's generation ends: a finished one's close is a no-op, an unfinished one
    leaves the batch at the engine's next step."""
    for choice in choices:
        await choice.events.aclose()


async def _collect(events: AsyncIterator, prompt_param: str) -> tuple[list[Step], RequestStats]:
    steps: list[Step] = []
    try:
        async for batch in events:
            for event in batch:
                if isinstance(event, Step):
                    steps.append(event)
                else:
                    return steps, event
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
