"""POST /v1/classifications: the request body and the response object.

Cross-field rules that depend on the model (zero-shot needs labels, a classifier checkpoint
takes none) or on the server's limits are checked by the service, which knows both."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from engines.base import ClassificationResult

from .protocol import EngineChoice, Strict, Text
from .streaming import metrics, usage


class ClassificationRequest(Strict):
    model: Text = Field(min_length=1, max_length=256)
    input: Text | list[Text] = Field(description="one text, or a list of texts, to classify")
    labels: list[Text] | None = Field(
        None, description="zero-shot: the labels to choose from (a classify model has its own)"
    )
    instruction: Text | None = Field(
        None, max_length=4000, description="zero-shot: what to do, e.g. 'What is the topic?'"
    )
    calibrate: bool | None = Field(
        None, description="zero-shot: remove label-order and prior biases (default true)"
    )
    label_scoring: Literal["sum", "mean"] | None = Field(
        None, description="zero-shot: a label's score is the sum (default) or mean of its "
                          "tokens' log-probabilities",
    )
    engine: EngineChoice | None = Field(None, description="the engine that serves this request")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def classification_response(model: str, result: ClassificationResult) -> dict:
    stats = result.stats
    n = len(result.results)
    return {
        "id": "clf-" + uuid.uuid4().hex,
        "object": "classification",
        "created": int(time.time()),
        "model": model,
        "data": [
            {
                "index": i,
                "label": r.label,
                "scores": [
                    {"label": s.label, "probability": s.probability, "logprob": s.logprob}
                    for s in r.scores
                ],
            }
            for i, r in enumerate(result.results)
        ],
        "usage": usage(stats),
        "metrics": {
            **metrics(stats),
            "classifications_per_s": round(n / stats.total_s, 2) if stats.total_s > 0 else 0.0,
        },
    }
