"""Embedding requests -> one call on the embed model's worker -> OpenAI's list of embeddings.

The call queues on the engine's worker thread like a classification: concurrent requests wait
their turn and never interleave. Inputs longer than the model takes are truncated, as
sentence-transformers truncates them (engines/embed_tokenizer.py)."""

from __future__ import annotations

import asyncio
from functools import partial

from fastapi.responses import JSONResponse

from engines.base import Embedder, EmbedParams, EngineError, StopCheck, UnsupportedModel

from .embed_protocol import EmbeddingRequest, embedding_response
from .errors import bad_request, from_engine_error, wrong_task
from .registry import ModelRegistry
from .settings import Settings


def _embed(params: EmbedParams, engine: Embedder, should_stop: StopCheck):
    return engine.embed(params, should_stop)


def _response(model: str, req: EmbeddingRequest, result) -> JSONResponse:
    # On a thread: thousands of vectors take a while to turn into JSON.
    return JSONResponse(embedding_response(model, result, req.encoding_format, req.dimensions))


class EmbeddingService:
    def __init__(self, registry: ModelRegistry, settings: Settings):
        self.registry = registry
        self.settings = settings

    async def embed(self, req: EmbeddingRequest) -> JSONResponse:
        spec = self.registry.spec(req.model)
        if spec.task != "embed":
            raise wrong_task(spec.id, spec.task, ("embed",))
        inputs = self._inputs(req)
        try:
            worker = await self.registry.worker(spec.id, req.engine)
            engine: Embedder = worker.engine
            self._check_against(engine, req, inputs)
            result = await worker.call("embedding", partial(_embed, EmbedParams(inputs)))
        except UnsupportedModel as exc:
            raise bad_request(f"model '{spec.id}': {exc}", param="model") from exc
        except EngineError as exc:
            raise from_engine_error(exc, "input") from exc
        return await asyncio.to_thread(_response, spec.id, req, result)

    def _inputs(self, req: EmbeddingRequest) -> tuple[str | tuple[int, ...], ...]:
        inputs = req.inputs()
        if not inputs:
            raise bad_request("input must not be empty", param="input")
        cap = self.settings.max_embedding_inputs
        if len(inputs) > cap:
            raise bad_request(f"at most {cap} inputs per request (got {len(inputs)}; the limit is "
                              f"DUET_MAX_EMBEDDING_INPUTS)", param="input",
                              code="embedding_limit_exceeded")
        for i, x in enumerate(inputs):
            if not x:  # OpenAI refuses an empty string too
                kind = "text" if isinstance(x, str) else "list of token ids"
                raise bad_request(f"an input {kind} must not be empty", param=req.input_param(i))
        return tuple(x if isinstance(x, str) else tuple(x) for x in inputs)

    @staticmethod
    def _check_against(engine: Embedder, req: EmbeddingRequest, inputs) -> None:
        """What only the loaded model can tell: its vocabulary and its dimension."""
        if req.dimensions is not None and req.dimensions > engine.dimension:
            raise bad_request(f"dimensions may be at most {engine.dimension}, this model's "
                              f"(got {req.dimensions})", param="dimensions")
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                continue
            bad = next((t for t in x if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary (of "
                                  f"{engine.vocab_size})", param=req.input_param(i))
