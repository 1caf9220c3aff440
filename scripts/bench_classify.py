#!/usr/bin/env python3
"""Zero-shot classification benchmark: accuracy and classifications per second for one batch
of 64 short labelled sentiment sentences (tests/data/), on each engine, default model.

Prints a table, writes docs/bench/classify-<model>-<device>.json and its own section of
docs/benchmarks.md. Each engine classifies the batch as one request (`--repeats` times;
medians are quoted).

  python scripts/bench_classify.py --engines torch,mlx
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_engines import model_dir  # noqa: E402

from engines.base import ClassifyParams  # noqa: E402
from engines.bench import report  # noqa: E402

DATA = [ROOT / "tests/data/sentiment.jsonl", ROOT / "tests/data/sentiment_dev.jsonl"]
INSTRUCTION = "What is the sentiment of the text?"
LABELS = ("positive", "negative")


def load_rows() -> list[dict]:
    return [json.loads(line) for path in DATA for line in path.read_text().splitlines() if line]


def bench_engine(name: str, model_dir: Path, rows: list[dict], repeats: int, calibrate: bool) -> dict:
    from engines.factory import create_engine

    engine = create_engine(name, model_dir, context_length=2048, **({"device": "cpu"} if name == "torch" else {}))
    params = ClassifyParams(inputs=tuple(r["text"] for r in rows), labels=LABELS,
                            instruction=INSTRUCTION, calibrate=calibrate)
    runs = []
    for _ in range(repeats):
        result = engine.classify(params)
        correct = sum(r.label == row["label"] for r, row in zip(result.results, rows))
        runs.append({"seconds": result.stats.total_s, "accuracy": correct / len(rows),
                     "prompt_tokens": result.stats.prompt_tokens,
                     "peak_memory_bytes": result.stats.peak_memory_bytes})
    engine.close()
    secs = [r["seconds"] for r in runs]
    return {
        "engine": name, "device": engine.info.device, "dtype": engine.info.dtype,
        "calibrate": calibrate, "inputs": len(rows), "accuracy": runs[0]["accuracy"],
        "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
        "classifications_per_s": len(rows) / statistics.median(secs),
        "prompt_tokens": runs[0]["prompt_tokens"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs), "runs": runs,
    }


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [
        f"### Zero-shot classification, default model on {meta['device']}, {meta['date']}", "",
        f"`{meta['command']}`", "",
        f"One request of {meta['inputs']} short sentiment sentences (tests/data/, written for "
        f"the project), labels {', '.join(LABELS)}, instruction \"{INSTRUCTION}\". Medians of "
        f"{meta['repeats']} runs. Versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ". The machine's 2 CPU "
        "cores were shared with other jobs while this ran, so times are noisy; the ratio "
        "between rows is the more telling figure.", "",
        "| engine | dtype | calibrate | accuracy | classifications/s | median s | range s | prompt tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['dtype']} | {'yes' if r['calibrate'] else 'no'} | "
            f"{r['accuracy']:.1%} | {r['classifications_per_s']:.2f} | {r['median_s']:.2f} | "
            f"{r['min_s']:.2f}-{r['max_s']:.2f} | {r['prompt_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="torch,mlx")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-uncalibrated", action="store_true", help="skip the calibrate=false rows")
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs/bench")
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md")
    args = p.parse_args(argv)
    rows = load_rows()
    results = []
    for name in args.engines.split(","):
        for calibrate in (True,) if args.no_uncalibrated else (True, False):
            r = bench_engine(name, model_dir("default", Path()), rows, args.repeats, calibrate)
            results.append(r)
            print(f"{r['engine']:6} calibrate={str(calibrate):5} accuracy {r['accuracy']:.1%}  "
                  f"{r['classifications_per_s']:.2f} classifications/s (median {r['median_s']:.2f}s)")
    meta = {
        "date": dt.date.today().isoformat(), "device": report.device_name("cpu"),
        "versions": report.versions(), "inputs": len(rows), "repeats": args.repeats,
        "command": "python scripts/bench_classify.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "classify-default-cpu.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2))
    report.write_marked_section(args.md, "classify-default-cpu", markdown(meta, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
