"""What a sentence-transformers model directory says beyond its encoder: how token states are
pooled into one vector (1_Pooling/config.json), whether that vector is normalised (a
Normalize module in modules.json), and how many tokens an input keeps
(sentence_bert_config.json).

A plain Hugging Face BERT directory (no modules.json) is read as sentence-transformers reads
one: mean pooling, no normalisation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .base import UnsupportedModel

Pooling = Literal["mean", "cls"]
_MODULES = ("Transformer", "Pooling", "Normalize")
# sentence-transformers' pooling flags, and the mode each one turns on.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceConfig:
    pooling: Pooling
    normalize: bool
    max_tokens: int  # an input keeps this many tokens, special tokens included
    lower_case: bool = False  # sentence_bert_config's do_lower_case: texts lowercased first


def _json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pooling_mode(config: dict) -> Pooling:
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers
        modes = [config["pooling_mode"].removesuffix("_token").removesuffix("_tokens")]
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    if modes == ["cls"] or modes == ["mean"]:
        return modes[0]
    raise UnsupportedModel(f"pooling {' + '.join(modes) or 'none'} is not supported (an embed "
                           "model pools by 'mean' or 'cls')")


def read_sentence_config(model_dir: Path, max_positions: int) -> SentenceConfig:
    model_dir = Path(model_dir)
    modules = _json(model_dir / "modules.json")
    pooling: Pooling = "mean"
    normalize = False
    for module in modules or []:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULES:
            raise UnsupportedModel(f"the sentence-transformers module '{kind}' (modules.json) is "
                                   f"not supported (only {', '.join(_MODULES)})")
        if kind == "Pooling":
            config = _json(model_dir / module.get("path", "") / "config.json")
            if config is None:
                raise UnsupportedModel(f"{module.get('path')}/config.json is missing")
            pooling = _pooling_mode(config)
        normalize = normalize or kind == "Normalize"
    bert = _json(model_dir / "sentence_bert_config.json") or {}
    longest = bert.get("max_seq_length") or max_positions
    return SentenceConfig(pooling=pooling, normalize=normalize,
                          max_tokens=min(int(longest), max_positions),
                          lower_case=bool(bert.get("do_lower_case", False)))
