#!/usr/bin/env python3
"""What llguidance's vocabulary slices do to a grammar mask's time on this CPU: the default
model's vocabulary built with llguidance's default slices and with duet's
(engines/grammar.vocabulary_slices), bench_features.py's grammar schemas (a list of objects
whose "name" is a string, unbounded or at most 24 characters), the mask at each of a valid
document's first 300 positions, advancing by its tokens. Means, medians and p90s in
microseconds (the median of 3 fresh matchers' means), and whether the two vocabularies gave the
same masks everywhere. Prints a table and writes JSON under docs/bench/.

  python scripts/bench_grammar_slices.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

FEATURES = ("grammar", "grammar-bounded")


def document() -> str:
    """A valid document for both schemas: names of 0 to 23 characters, one with a quote."""
    names = ['abcdefghij klmnopqrstuvw'[: (7 * i) % 24] for i in range(40)]
    names[5] = 'say \\"hi\\"'
    return '{"items": [' + ", ".join(f'{{"name": "{n}", "score": {i}}}'
                                     for i, n in enumerate(names))


def masks(vocab, grammar: str, ids: list[int]) -> tuple[list[float], list]:
    from llguidance import LLMatcher

    matcher, times, bits = LLMatcher(vocab, grammar), [], []
    for t in ids:
        started = time.perf_counter()
        bits.append(matcher.compute_bitmask())
        times.append(time.perf_counter() - started)
        if not matcher.consume_token(t):
            raise RuntimeError("the document left its grammar")
    return times[1:], bits  # the first mask is the grammar's start, built once


def main() -> int:
    import llguidance.hf
    import numpy as np
    from bench_features import FEATURES as FIELDS
    from bench_grammar import default_tokenizer_dir
    from transformers import AutoTokenizer

    from engines.grammar import json_schema_grammar, vocabulary_slices

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="default: the default model's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    ids = tok.encode(document(), add_special_tokens=False)[:300]
    vocabularies = {}
    for name, slices in (("llguidance's default", None), ("duet's", vocabulary_slices())):
        started = time.perf_counter()
        vocabularies[name] = (llguidance.hf.from_tokenizer(tok, slices=slices),
                              time.perf_counter() - started)
    rows = []
    for feature in FEATURES:
        grammar = json_schema_grammar(FIELDS[feature]["response_format"]["json_schema"]["schema"])
        seen = {}
        for name, (vocab, built) in vocabularies.items():
            runs = [masks(vocab, grammar, ids) for _ in range(3)]
            seen[name] = runs[0][1]
            means = [statistics.mean(t) for t, _ in runs]
            times = sorted(runs[0][0])
            rows.append({"schema": feature, "slices": name, "vocabulary_build_ms": round(built * 1e3),
                         "mean_us": round(statistics.median(means) * 1e6, 1),
                         "median_us": round(statistics.median(times) * 1e6, 1),
                         "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1)})
        a, b = seen.values()
        same = all(np.array_equal(x, y) for x, y in zip(a, b))
        for row in rows[-2:]:
            row["same_masks"] = same
    cpu = platform.processor() or platform.machine()
    print(f"{len(ids)} positions, {tok.name_or_path}, {cpu}")
    print(f"{'schema':16} {'slices':22} {'build ms':>9} {'mean us':>8} {'median':>7} {'p90':>7} "
          "same masks")
    for r in rows:
        print(f"{r['schema']:16} {r['slices']:22} {r['vocabulary_build_ms']:>9} "
              f"{r['mean_us']:>8} {r['median_us']:>7} {r['p90_us']:>7} {r['same_masks']}")
    out = Path(args.out or ROOT / f"docs/bench/grammar-slices-{dt.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": str(dt.date.today()), "positions": len(ids),
                               "command": "python scripts/bench_grammar_slices.py",
                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
