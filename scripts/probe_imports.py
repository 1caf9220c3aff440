#!/usr/bin/env python3
"""What an engine process's start spends importing: each set of imports in a fresh
interpreter, timed from its start to its end (medians of --rounds), and which of the heavy
modules each set brought in (torch's compiler, transformers' model code, scikit-learn...).

  python scripts/probe_imports.py --rounds 3 --out docs/bench/engine-process-imports-h100.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "triton", "transformers",
         "transformers.models.auto.tokenization_auto", "transformers.generation", "sklearn",
         "scipy")
SETS = {
    "torch": "import torch",
    "torch, CUDA started": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
    "the torch engine's modules": "import engines.torch_engine.engine",
    "... and torch's compiler": "import engines.torch_engine.engine, torch._dynamo",
    "the engine process's imports (factory.import_backend)":
        "from engines.factory import import_backend; import_backend('torch')",
    "the engine's modules and AutoTokenizer":
        "import engines.torch_engine.engine; from transformers import AutoTokenizer",
    "the engine's modules and transformers' generic tokenizer class":
        "import engines.torch_engine.engine; from transformers import PreTrainedTokenizerFast",
    "AutoTokenizer alone": "from transformers import AutoTokenizer",
    "the server's modules": "import server.cli, server.app",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cuda", action="store_true", help="leave out the set that starts CUDA")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    probe = ("; import json, sys; print(json.dumps(sorted(m for m in %r if m in sys.modules)))"
             % (HEAVY,))
    times: dict[str, list[float]] = {}
    brought: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for name, code in SETS.items():
            if args.no_cuda and "cuda" in code:
                continue
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", code + probe], capture_output=True,
                                  text=True, cwd=ROOT)
            times.setdefault(name, []).append(round(time.perf_counter() - started, 2))
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
            brought[name] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [{"imports": name, "median_s": statistics.median(ts), "runs_s": ts,
             "brought": brought[name]} for name, ts in times.items()]
    width = max(len(r["imports"]) for r in rows)
    print(f"{'imports':<{width}}  median s  brought in")
    for r in rows:
        print(f"{r['imports']:<{width}}  {r['median_s']:8.2f}  {', '.join(r['brought'])}")
    if args.out:
        args.out.write_text(json.dumps({
            "date": dt.date.today().isoformat(), "host": platform.node(),
            "python": platform.python_version(), "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
