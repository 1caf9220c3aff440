"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info), so that clients which
count tokens on the server (lm-evaluation-harness finds a remote tokenizer this way) get the
served model's own tokens."""

from __future__ import annotations

import asyncio

from engines.base import Engine, EngineError

from .errors import bad_request, from_engine_error, wrong_task
from .protocol import DetokenizeRequest, TokenizeRequest
from .registry import ModelRegistry


class TokenizerService:
    def __init__(self, registry: ModelRegistry, default_model: str):
        self.registry = registry
        self.default_model = default_model

    async def _engine(self, model: str | None) -> Engine:
        spec = self.registry.spec(model or self.default_model)
        if spec.task != "generate":
            raise wrong_task(spec.id, spec.task, ("generate",))
        return (await self.registry.worker(spec.id)).engine

    async def tokenize(self, req: TokenizeRequest) -> dict:
        engine = await self._engine(req.model)
        tokenizer = engine.tokenizer

        def encode() -> list[int]:
            if req.prompt is not None:
                return (engine.tokenize(req.prompt) if req.add_special_tokens is not False
                        else tokenizer.encode(req.prompt))
            messages = [m.for_template(tokenizer.template_takes_tools) for m in req.messages]
            return tokenizer.apply_chat_template(messages, req.add_generation_prompt)

        try:
            ids = await asyncio.to_thread(encode)
        except EngineError as exc:
            raise from_engine_error(exc, "messages") from exc
        except ValueError as exc:  # a model without a chat template
            raise bad_request(str(exc), param="messages") from exc
        strs = None
        if req.return_token_strs:
            strs = [text for text, _ in tokenizer.token_names(ids)]
        return {"count": len(ids), "max_model_len": engine.info.context_length, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        engine = await self._engine(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (of {vocab})",
                              param="tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    async def info(self, model: str | None) -> dict:
        engine = await self._engine(model)
        return {**engine.tokenizer.describe(), "model_max_length": engine.info.context_length}
