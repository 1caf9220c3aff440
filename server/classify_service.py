"""Classification requests -> one call on the engine's worker -> the response object.

The call queues on the same worker thread as generation, so it waits its turn behind earlier
requests and never interleaves with them."""

from __future__ import annotations

from functools import partial

from fastapi.responses import JSONResponse

from engines.base import ClassifyParams, Engine, EngineError, StopCheck, UnsupportedModel
from engines.models.config import ModelSpec

from .classify_protocol import ClassificationRequest, classification_response
from .errors import bad_request, echo, from_engine_error, wrong_task
from .registry import ModelRegistry
from .settings import Settings

_ZERO_SHOT_ONLY = ("labels", "instruction", "calibrate", "label_scoring")


def _classify(params: ClassifyParams, engine: Engine, should_stop: StopCheck):
    # A module-level function: a job's function travels to the engine's process by pickle.
    return engine.classify(params, should_stop)


class ClassificationService:
    def __init__(self, registry: ModelRegistry, settings: Settings):
        self.registry = registry
        self.settings = settings

    async def classify(self, req: ClassificationRequest) -> JSONResponse:
        spec = self.registry.spec(req.model)
        params = self._params(req, spec)
        try:
            worker = await self.registry.worker(spec.id, req.engine)
            result = await worker.call("classification", partial(_classify, params))
        except UnsupportedModel as exc:
            raise bad_request(f"model '{spec.id}': {exc}", param="model") from exc
        except EngineError as exc:
            raise from_engine_error(exc, "input") from exc
        return JSONResponse(classification_response(spec.id, result))

    def _params(self, req: ClassificationRequest, spec: ModelSpec) -> ClassifyParams:
        if spec.task not in ("generate", "classify"):
            raise wrong_task(spec.id, spec.task, ("generate", "classify"))
        inputs = self._inputs(req)
        if spec.task == "classify":
            for name in _ZERO_SHOT_ONLY:
                if getattr(req, name) is not None:
                    raise bad_request(
                        f"model '{spec.id}' is a classifier with its own labels; '{name}' is "
                        f"for zero-shot classification with a generation model", param=name,
                    )
            if req.engine == "mlx":
                raise bad_request(f"classify model '{spec.id}' runs on the torch engine only",
                                  param="engine")
            return ClassifyParams(inputs=inputs)
        if req.labels is None:
            raise bad_request(
                f"model '{spec.id}' is a generation model: zero-shot classification needs "
                f"'labels'", param="labels",
            )
        return ClassifyParams(
            inputs=inputs,
            labels=self._labels(req.labels),
            instruction=(req.instruction or "").strip() or None,
            calibrate=True if req.calibrate is None else req.calibrate,
            label_scoring=req.label_scoring or "sum",
        )

    def _inputs(self, req: ClassificationRequest) -> tuple[str, ...]:
        texts = req.texts()
        if not texts:
            raise bad_request("input must not be empty", param="input")
        cap = self.settings.max_classification_inputs
        if len(texts) > cap:
            raise bad_request(f"at most {cap} inputs per request (got {len(texts)}; the limit is "
                              f"DUET_MAX_CLASSIFICATION_INPUTS)", param="input",
                              code="classification_limit_exceeded")
        for i, text in enumerate(texts):
            if not text.strip():
                where = "input" if isinstance(req.input, str) else f"input[{i}]"
                raise bad_request("an input text must not be empty", param=where)
        return tuple(texts)

    def _labels(self, labels: list[str]) -> tuple[str, ...]:
        cap, longest = self.settings.max_classification_labels, self.settings.max_label_chars
        if len(labels) < 2:
            raise bad_request("give at least 2 labels to choose from", param="labels")
        if len(labels) > cap:
            raise bad_request(f"at most {cap} labels per request (got {len(labels)}; the limit is "
                              f"DUET_MAX_CLASSIFICATION_LABELS)", param="labels",
                              code="classification_limit_exceeded")
        seen: dict[str, int] = {}
        out = []
        for i, raw in enumerate(labels):
            label = raw.strip()
            if not label:
                raise bad_request("a label must not be empty", param=f"labels[{i}]")
            if len(label) > longest:
                raise bad_request(f"a label may have at most {longest} characters (the limit "
                                  f"is DUET_MAX_LABEL_CHARS)", param=f"labels[{i}]",
                                  code="classification_limit_exceeded")
            key = label.casefold()
            if key in seen:
                raise bad_request(f"label '{echo(label)}' repeats labels[{seen[key]}]",
                                  param=f"labels[{i}]")
            seen[key] = i
            out.append(label)
        return tuple(out)
