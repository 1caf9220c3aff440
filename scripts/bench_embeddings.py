#!/usr/bin/env python3
"""Embedding check and speed: all-MiniLM-L6-v2 on duet's engines against sentence-transformers.

For each engine: the largest cosine deviation from sentence-transformers (loaded offline from
the same extracted directory) over a set of texts of every length, one past the 256 tokens the
model keeps; then texts a second for a batch of short texts (one request of --batch texts,
repeated, the best and the median run).

  python scripts/bench_embeddings.py --engines torch,mlx --batch 64 --repeats 5

--torch-threads sets torch's intra-op threads (default: torch's own choice, one per core). On
a CPU that other processes keep busy, one thread can be several times faster than two, whose
OpenMP barriers wait on a descheduled partner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "all-minilm-l6-v2"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "small",
         "cats", "sleep", "on", "warm", "mats", "near", "an", "open", "window", "in", "the",
         "late", "afternoon", "sun")


def texts(n: int, seed: int, lo: int, hi: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(lo, hi))) for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="torch,mlx")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)

    import numpy as np

    from engines.base import EmbedParams
    from engines.factory import create_engine
    from engines.models.config import load_models_file
    from engines.models.sources import resolve_model_dir

    spec = next(s for s in load_models_file(ROOT / "models.toml") if s.id == MODEL)
    model_dir = resolve_model_dir(spec)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    check = (texts(24, 1, 1, 40) + ["Où est la bibliothèque ? 图书馆在哪里？ 🙂", "x",
                                    " ".join(WORDS * 12)])
    want = reference.encode(check, convert_to_numpy=True).astype(np.float64)
    batch = texts(args.batch, 2, 5, 15)
    for name in args.engines.split(","):
        engine = create_engine(name, model_dir, context_length=spec.context_length,
                               dtype=spec.dtype, task="embed")
        got = engine.embed(EmbedParams(tuple(check))).vectors.astype(np.float64)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        runs = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            result = engine.embed(EmbedParams(tuple(batch)))
            runs.append(time.perf_counter() - started)
        print(f"{name}: max 1-cosine vs sentence-transformers {float((1 - cos).max()):.2e} over "
              f"{len(check)} texts; {args.batch} short texts ({sum(result.tokens)} tokens): "
              f"best {args.batch / min(runs):.1f} texts/s, median "
              f"{args.batch / statistics.median(runs):.1f} texts/s")
    started = time.perf_counter()
    for _ in range(args.repeats):
        reference.encode(batch, batch_size=args.batch)
    print(f"sentence-transformers (torch): mean {args.batch * args.repeats / (time.perf_counter() - started):.1f} texts/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
