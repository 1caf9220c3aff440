#!/usr/bin/env python3
"""A batch's grammar masks computed each way duet could compute them: N rows of one JSON schema
(bench_features' grammar or grammar-bounded) walk the schema together, each taking a random
allowed token a step (what random weights pick under the mask), and each way of computing the
N masks of a step walks the same tokens from cold caches:

  - llguidance's executor (its default threads, or 1, 2, 4) over copies of one prepared matcher
    (what a prepared grammar's requests were), over copies of as many matchers prepared apart
    as the executor has threads (duet's PreparedGrammars), or over a matcher a row
  - K Python threads, each computing its share on an executor of one thread

Each way also times taking in the step's tokens (one matcher after another, or llguidance's
consume_token_par). Prints the median and p90 of a step's masks per way, and whether every way gave the same masks;
writes JSON with --out.

  python scripts/bench_grammar_masks.py --feature grammar --rows 64
  python scripts/bench_grammar_masks.py --feature grammar-bounded --rows 64 --steps 48 \\
      --tokenizer .benchmodel/llama-3.2-1b-default-tokenizer
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np
from bench_features import FEATURES

from engines.grammar import (
    PreparedGrammars,
    default_lineages,
    json_schema_grammar,
    mask_words,
)
from engines.tokenizer import ChatTokenizer


def default_tokenizer_dir() -> Path:
    from engines.models.config import load_models_file
    from engines.models.sources import resolve_model_dir

    return resolve_model_dir(load_models_file(ROOT / "models.toml")[0])


def walk(grammar: str, tok: ChatTokenizer, rows: int, steps: int, compute,
         lineages: int, parallel_intake: bool = False) -> tuple[list[float], list[float], int]:
    """Each step's time in compute(todo, out), in taking in the step's tokens (one matcher
    after another on this thread, or in one consume_token_par call), and a digest of every
    mask. The rows copy
    `lineages` matchers prepared apart, in turn (engines/grammar.py's PreparedGrammars), each
    prepared afresh: caches as cold for every way."""
    vocab = tok.grammar_vocabulary()
    kept = PreparedGrammars(vocab, lineages=lineages)
    matchers = [kept.state(grammar, tok.eos_token_ids).matcher for _ in range(rows)]
    out = np.zeros((rows, mask_words(vocab.vocab_size)), dtype=np.int32)
    rng, times, intake, digest = random.Random(0), [], [], 0
    if parallel_intake:
        from llguidance import LLExecutor

        consumer = LLExecutor()
    for _ in range(steps):
        todo = [(m, i) for i, m in enumerate(matchers)]
        start = time.perf_counter()
        compute(todo, out)
        times.append(time.perf_counter() - start)
        digest = hash((digest, out.tobytes()))
        bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")[:, :vocab.vocab_size]
        picked = [int(rng.choice(np.flatnonzero(bits[i]))) for i in range(rows)]
        start = time.perf_counter()
        if parallel_intake:
            consumer.consume_token_par(list(zip(matchers, picked)))
        else:
            for m, token in zip(matchers, picked):
                m.consume_token(token)
        intake.append(time.perf_counter() - start)
    return times, intake, digest


def executor(threads: int | None):
    from llguidance import LLExecutor

    ex = LLExecutor(num_threads=threads)
    return lambda todo, out: ex.unsafe_compute_mask_ptr(todo, out.ctypes.data,
                                                        out.shape[1] * 4, out.shape[0])


def shards(k: int):
    from llguidance import LLExecutor

    executors, pool = [LLExecutor(num_threads=1) for _ in range(k)], ThreadPoolExecutor(k)

    def run(todo, out):
        for f in [pool.submit(executors[j].unsafe_compute_mask_ptr, todo[j::k],
                              out.ctypes.data, out.shape[1] * 4, out.shape[0])
                  for j in range(k)]:
            f.result()

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--feature", default="grammar", choices=("grammar", "grammar-bounded"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a model directory (default: the default model's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tok = ChatTokenizer(args.tokenizer or default_tokenizer_dir())
    schema = FEATURES[args.feature]["response_format"]["json_schema"]["schema"]
    grammar = json_schema_grammar(schema)
    k = default_lineages()
    ways = [("executor, default threads", executor(None), 1),
            *[(f"executor, {n} thread{'s' * (n > 1)}", executor(n), 1) for n in (1, 2, 4)],
            *[(f"{j} threads x a 1-thread executor", shards(j), 1) for j in (2, 4)],
            (f"executor, default threads; {k} matcher{'s' * (k > 1)} apart (duet)",
             executor(None), k),
            ("executor, default threads; a matcher a row", executor(None), args.rows),
            ("executor, 1 thread; a matcher a row", executor(1), args.rows),
            ("executor, default threads; one matcher; tokens taken in in parallel",
             executor(None), 1, True),
            (f"executor, default threads; {k} apart; tokens taken in in parallel",
             executor(None), k, True)]
    print(f"{args.feature}: {args.rows} rows, {args.steps} steps, {os.cpu_count()} CPUs; "
          "a step's masks, ms")
    print("| way | masks, median | p90 | taking in the tokens, median |")
    print("|---|---|---|---|")
    rows, digests = [], set()
    for name, compute, lineages, *par in ways:
        times, intake, digest = walk(grammar, tok, args.rows, args.steps, compute, lineages,
                                     *par)
        digests.add(digest)
        median, p90 = statistics.median(times), sorted(times)[int(0.9 * len(times))]
        took = statistics.median(intake)
        rows.append({"way": name, "median_ms": 1e3 * median, "p90_ms": 1e3 * p90,
                     "intake_median_ms": 1e3 * took})
        print(f"| {name} | {1e3 * median:.3f} | {1e3 * p90:.3f} | {1e3 * took:.3f} |",
              flush=True)
    same = len(digests) == 1
    print(f"every way gave the same masks: {same}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "cpus": os.cpu_count(),
            "feature": args.feature, "rows_n": args.rows, "steps": args.steps,
            "rows": rows, "same_masks": same, "command": " ".join(sys.argv)}, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
