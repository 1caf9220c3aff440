"""Fine-tuned classifiers: a *ForSequenceClassification checkpoint (BERT, DistilBERT, RoBERTa
and kin) run through transformers, with the labels of its id2label."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from ..base import (
    ClassificationResult,
    ClassifyParams,
    EngineInfo,
    InputClassification,
    LabelScore,
    RequestStats,
    StopCheck,
    UnsupportedModel,
    check_context,
    check_stop,
)
from ..classify import Pacer
from ..device import choose_device, choose_dtype, memory_meter, torch_dtype

log = logging.getLogger("duet.engines.torch")


class SequenceClassifierEngine:
    name = "torch"

    def __init__(self, model_dir: str | Path, *, context_length: int, dtype: str = "auto",
                 device: str = "auto", **_ignored):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        archs = cfg.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise UnsupportedModel(
                f"{model_dir} is not a sequence-classification checkpoint (architectures: "
                f"{archs or 'none'}); a classify model needs a *ForSequenceClassification one"
            )
        if cfg.get("problem_type") == "multi_label_classification":
            raise UnsupportedModel("multi-label classifiers are not supported (labels must be exclusive)")
        self.device = choose_device(device)
        self.dtype = choose_dtype(dtype, self.device)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), dtype=torch_dtype(self.dtype)
        ).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        id2label = self.model.config.id2label
        self.labels = tuple(str(id2label[i]) for i in range(self.model.config.num_labels))
        limit = getattr(self.model.config, "max_position_embeddings", None) or context_length
        self.context_length = min(context_length, limit)
        self.meter = memory_meter(self.device)
        self.info = EngineInfo(
            engine=self.name, device=self.device, dtype=self.dtype,
            context_length=self.context_length, backend_version=f"torch {torch.__version__}",
            extra={"task": "classify", "labels": ",".join(self.labels)},
        )
        log.info("sequence classifier %s loaded on %s with labels %s", model_dir, self.device, self.labels)

    @torch.inference_mode()
    def classify(self, params: ClassifyParams, should_stop: StopCheck | None = None
                 ) -> ClassificationResult:
        start = time.perf_counter()
        self.meter.reset()
        texts = list(params.inputs)
        lengths = [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
        for n in lengths:
            check_context(n, 0, self.context_length)
        results = []
        pacer = Pacer()
        # A few inputs at a time, so that a stop is heard between two batches.
        for a, b in pacer.row_groups(len(texts), max(lengths)):
            check_stop(should_stop)
            enc = self.tokenizer(texts[a:b], padding=True, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with pacer.piece(int(enc["attention_mask"].sum())):
                logits = self.model(**enc).logits.float()
            for row in torch.log_softmax(logits, dim=-1).cpu().tolist():
                best = max(range(len(row)), key=row.__getitem__)
                scores = tuple(LabelScore(l, math.exp(lp), lp) for l, lp in zip(self.labels, row))
                results.append(InputClassification(self.labels[best], scores))
        self.meter.sample()
        total = time.perf_counter() - start
        tokens = int(sum(lengths))
        stats = RequestStats(
            prompt_tokens=tokens, completion_tokens=0, ttft_s=total,
            prefill_tokens_per_s=tokens / total if total > 0 else 0.0, decode_tokens_per_s=0.0,
            peak_memory_bytes=self.meter.peak_bytes(), kv_cache_bytes=0,
            engine=self.name, device=self.device, finish_reason="stop", total_s=total,
        )
        return ClassificationResult(tuple(results), stats)

    def close(self) -> None:
        self.model = None
