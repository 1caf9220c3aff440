#!/usr/bin/env python3
"""How soon a stop takes effect: the largest classification the default limits allow (256
inputs x 32 labels of 100 characters) is started on each engine, its stop flag set after a few
seconds, and the time from the flag to the engine giving the thread back is measured. A
client that leaves, or a request past its time limit, waits exactly this long for its engine.

Prints a table and writes its own section of docs/benchmarks.md.

  .venv/bin/python scripts/bench_stop.py --engines torch,mlx
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_engines import model_dir  # noqa: E402

from engines.base import Cancelled, ClassifyParams  # noqa: E402
from engines.bench import report  # noqa: E402

LABELS = tuple(f"label {i:02d} " + "about something rather specific, " * 3 for i in range(32))
BIG = ClassifyParams(
    inputs=tuple(f"Text {i}: the weather was fine and the trains ran on time." for i in range(256)),
    labels=tuple(label[:100] for label in LABELS),
    instruction="Which label fits the text best?",
)


def stop_latency(engine, after_s: float) -> float:
    """Seconds from setting the stop flag, after_s into the classification, to its end."""
    flag = threading.Event()
    ended: dict = {}

    def run():
        try:
            engine.classify(BIG, flag.is_set)
            ended["how"] = "finished"
        except Cancelled:
            ended["how"] = "cancelled"
        ended["at"] = time.perf_counter()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(after_s)
    flagged = time.perf_counter()
    flag.set()
    thread.join()
    if ended["how"] != "cancelled":
        raise SystemExit(f"the classification finished before {after_s} s: not a stop")
    return ended["at"] - flagged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="torch,mlx")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--md", type=Path, default=ROOT / "docs/benchmarks.md")
    args = p.parse_args(argv)
    from engines.factory import create_engine

    rows = []
    for name in args.engines.split(","):
        engine = create_engine(name, model_dir("default", Path()), context_length=2048,
                               **({"device": "cpu"} if name == "torch" else {}))
        # Stops at different points: inside a prefill, inside a batch of label continuations.
        latencies = [stop_latency(engine, 1.0 + 0.7 * i) for i in range(args.repeats)]
        engine.close()
        rows.append((name, engine.info.dtype, statistics.median(latencies), max(latencies)))
        print(f"{name:6} stop latency median {rows[-1][2]:.3f} s, max {rows[-1][3]:.3f} s")
    versions = report.versions()
    md = [
        f"### Stopping a classification, default model on {report.device_name('cpu')}, "
        f"{dt.date.today().isoformat()}", "",
        "`.venv/bin/python scripts/bench_stop.py " + " ".join(argv or sys.argv[1:]) + "`", "",
        f"The largest classification the default limits allow (256 inputs x 32 labels of 100 "
        f"characters) is stopped {args.repeats} times, 1 to {1 + 0.7 * (args.repeats - 1):.1f} s "
        "in; the figure is the time from the stop flag to the engine thread being free. "
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", "",
        "| engine | dtype | median (s) | max (s) |", "|---|---|---|---|",
    ]
    md += [f"| {n} | {d} | {m:.3f} | {x:.3f} |" for n, d, m, x in rows]
    report.write_marked_section(args.md, "stop-latency-cpu", "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
