"""POST /v1/embeddings: the request body and the response object, in OpenAI's shapes.

What depends on the model (its dimension, its vocabulary) or on the server's limits is checked
by the service, which knows both."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import Field

from engines.base import EmbeddingResult

from .protocol import EngineChoice, Strict, Text
from .streaming import metrics


class EmbeddingRequest(Strict):
    model: Text = Field(min_length=1, max_length=256)
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="a text, a list of texts, a text's token ids, or a list of those"
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (default): lists of numbers; base64: each vector's "
                          "little-endian float32 bytes in base64"
    )
    dimensions: int | None = Field(
        None, ge=1, description="keep the first this many dimensions (then length 1 again)"
    )
    user: Text | None = None  # OpenAI's end-user id: accepted, not used
    engine: EngineChoice | None = Field(None, description="the engine that serves this request")

    def _one_input(self) -> bool:
        x = self.input
        return isinstance(x, str) or (bool(x) and isinstance(x[0], int))

    def inputs(self) -> list[str | list[int]]:
        return [self.input] if self._one_input() else list(self.input)

    def input_param(self, i: int) -> str:
        """The field that names input i in an error: 'input' when there is one, else
        'input[i]'."""
        return "input" if self._one_input() else f"input[{i}]"


def shortened(vectors: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """OpenAI's `dimensions`: the first that many numbers of each vector, scaled back to
    length 1 when the model's vectors have length 1 (otherwise left as they are)."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    if not normalized:
        return np.ascontiguousarray(cut)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


def encoded(vector: np.ndarray, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_response(model: str, result: EmbeddingResult, encoding_format: str | None,
                       dimensions: int | None) -> dict:
    vectors = shortened(np.asarray(result.vectors, dtype=np.float32), dimensions,
                        result.normalized)
    stats = result.stats
    tokens = sum(result.tokens)
    n = len(result.tokens)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v, encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "metrics": {
            **metrics(stats),
            "embeddings_per_s": round(n / stats.total_s, 2) if stats.total_s > 0 else 0.0,
        },
    }
