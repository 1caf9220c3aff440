#!/usr/bin/env python3
"""Cold and warm starts: seconds from `duet serve` to a /health that answers 200, and to one
that shows no engine compiling (the server answers eagerly while its compiled step is made;
--stream measures a stream through that time).

Every start gets the same --cache-dir (a new empty one unless given): duet's converted models
and compiled-step cache, Inductor's and Triton's caches all live under it. The first start is
then cold (nothing compiled yet on this machine) and the next ones warm. Each start's log is
kept, and the engine's own timings are read from it (load, graph capture, warm-up). --profile
runs the same sequence of starts as engine loads in-process instead (a dummy model only),
logging Dynamo's phases and Inductor's cache counters, optionally under cProfile.

  python scripts/bench_start.py --model dummy-llama-3.2-1b --starts 3 \
      --out docs/bench/start-llama-3.2-1b-h100.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench_concurrency import compiling as shows_compiling  # noqa: E402

TIMINGS = {  # what the engine logs -> the figure's name
    "load_s": re.compile(r"engine loaded .* in ([\d.]+)s"),
    "graphs_s": re.compile(r"captured \d+ decode graphs .* in ([\d.]+)s"),
    "warm_up_s": re.compile(r"warm-up took ([\d.]+)s"),
    "compile_cache": re.compile(r"(compiled: .* tuning runs)"),
}


def cache_env(cache: Path) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "DUET_CACHE_DIR": str(cache / "duet"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton")}


class StreamWatch:
    """Streams completions, one after another, from the moment the server is ready, and keeps
    each chunk's time: the server answers eagerly while its compiled step is made, and a
    stream must go on through the switch without a stall."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.times: list[list[float]] = []  # per request, each chunk's perf_counter
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        body = {"model": self.model, "prompt": "w5 w6 w7 w8", "max_tokens": 256,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.Client(timeout=60) as client:
                while not self._stop.is_set():
                    times: list[float] = []
                    self.times.append(times)
                    with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                times.append(time.perf_counter())
                            if self._stop.is_set():
                                break
        except Exception as exc:  # noqa: BLE001  reported in the row
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def summary(self, started: float, compiled: float) -> dict:
        """Tokens a second before and after the compiled step arrived, and the longest gap
        between two chunks of one stream before, and across the switch (within 1 s of it)."""
        def rate(lo: float, hi: float) -> float | None:
            n = sum(lo <= t < hi for ts in self.times for t in ts)
            return round(n / (hi - lo), 1) if hi > lo and n else None

        def gap(lo: float, hi: float) -> float | None:
            gaps = [b - a for ts in self.times for a, b in itertools.pairwise(ts) if lo <= b < hi]
            return round(max(gaps) * 1000, 1) if gaps else None

        first = min((ts[0] for ts in self.times if ts), default=None)
        last = max((ts[-1] for ts in self.times if ts), default=None)
        if first is None:
            return {"stream_error": self.error or "no tokens"}
        return {"stream_tok_s_compiling": rate(first, compiled),
                "stream_tok_s_after": rate(compiled, last),
                "stream_max_gap_ms_compiling": gap(first, compiled),
                "stream_max_gap_ms_switch": gap(compiled - 1, compiled + 1),
                **({"stream_error": self.error} if self.error else {})}


def compiling(url: str) -> bool:
    import httpx

    return shows_compiling(httpx.get(url + "/health", timeout=2).json())


def one_start(args, cache: Path, log_path: Path) -> dict:
    import httpx

    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model,
           "--port", str(args.port), *args.serve_args]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=cache_env(cache))
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited: see {log_path}")
                if time.perf_counter() - started > args.start_timeout:
                    raise SystemExit(f"no /health in {args.start_timeout} s: see {log_path}")
                try:
                    if httpx.get(f"http://127.0.0.1:{args.port}/health",
                                 timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            ready = time.perf_counter() - started
            url = f"http://127.0.0.1:{args.port}"
            watch = StreamWatch(url, args.model) if args.stream else None
            while compiling(url):
                if time.perf_counter() - started > args.start_timeout:
                    raise SystemExit(f"still compiling after {args.start_timeout} s: "
                                     f"see {log_path}")
                time.sleep(0.1)
            compiled = time.perf_counter()
            if watch is not None:
                time.sleep(2)  # the stream after the switch
                watch.stop()
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    row = {"ready_s": round(ready, 1), "compiled_s": round(compiled - started, 1)}
    if watch is not None:
        row.update(watch.summary(started, compiled))
    for line in log_path.read_text().splitlines():
        for name, pattern in TIMINGS.items():
            if m := pattern.search(line):
                row[name] = m.group(1) if name == "compile_cache" else float(m.group(1))
    return row


PROFILE_CHILD = """
import cProfile, logging, pstats, sys, tempfile, time
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(name)s: %(message)s")
torch._logging.set_logs(dynamo=logging.INFO)
# which kernels are tuned ("= Do coordinate descent tuning for <kernel> =")
logging.getLogger("torch._inductor.runtime.coordinate_descent_tuner").setLevel(logging.DEBUG)
from engines.models.dummy import write_dummy_model
from engines.torch_engine import TorchEngine
shape = sys.argv[1]
d = write_dummy_model(shape, Path(tempfile.mkdtemp()) / shape)
started, wall = time.perf_counter(), time.time()
prof = cProfile.Profile() if sys.argv[2] == "cprofile" else None
if prof:
    prof.enable()
TorchEngine(d, context_length=2048).wait_compiled()
print(f"engine ready in {time.perf_counter() - started:.1f} s")
if prof:
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(45)
from torch._dynamo.utils import counters
for group in ("inductor", "aot_autograd", "stats"):
    print(group, dict(counters[group]))
import glob, json, os
found = glob.glob(os.environ["TORCHINDUCTOR_CACHE_DIR"] + "/**/*.best_config", recursive=True)
fresh = [f for f in found if os.path.getmtime(f) > wall]
print(f"best configs: {len(found)}, written this start: {len(fresh)}")
for f in fresh[:3]:
    print(f, open(f).read())
"""


def one_profile(args, cache: Path, log_path: Path) -> dict:
    shape = args.model.removeprefix("dummy-")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        subprocess.run([sys.executable, "-c", PROFILE_CHILD, shape, args.profile], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, env=cache_env(cache), check=True)
    return {"ready_s": round(time.perf_counter() - started, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy-llama-3.2-1b")
    p.add_argument("--starts", type=int, default=3, help="the first is cold")
    p.add_argument("--cache-dir", type=Path, help="default: a new empty one (a cold first start)")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "duet-starts")
    p.add_argument("--profile", choices=["phases", "cprofile"],
                   help="engine loads in-process (a dummy model): the phases Dynamo logs, and "
                        "with cprofile where the time went")
    p.add_argument("--stream", action="store_true",
                   help="stream completions from the moment /health answers until 2 s after "
                        "the compiled step arrived: the tokens a second and the longest gap")
    p.add_argument("--out", type=Path)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()

    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="duet-start-cache-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    device = device_name() if args.out else ""
    for i in range(args.starts):
        # Cold: nothing compiled yet under the cache (a --cache-dir given empty is cold too).
        kind = "warm" if (cache / "inductor").exists() else "cold"
        log_path = args.log_dir / f"start-{i}.log"
        row = (one_profile if args.profile else one_start)(args, cache, log_path)
        rows.append({"start": i, "kind": kind, **row})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            write_out(args, rows, device)
    if args.cache_dir is None:
        shutil.rmtree(cache, ignore_errors=True)

    print(f"\n{'start':>5} {'kind':>5} {'ready s':>8} {'compiled s':>10} {'load s':>7} "
          f"{'graphs s':>9}  compiled step")
    for r in rows:
        print(f"{r['start']:>5} {r['kind']:>5} {r['ready_s']:>8} {r.get('compiled_s', '-'):>10} "
              f"{r.get('load_s', '-'):>7} {r.get('graphs_s', '-'):>9}  "
              f"{r.get('compile_cache', '-')}")
    return 0


def device_name() -> str:
    """The GPU's name from the driver, else the CPU's: without importing torch, which takes
    seconds on a host without Python bytecode (a run under a time limit lost its file so)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True)
        return found.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return platform.processor() or platform.machine()


def write_out(args, rows: list[dict], device: str) -> None:
    """The starts so far, rewritten after each: a run stopped midway keeps what it measured."""
    from importlib.metadata import version

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": dt.date.today().isoformat(), "device": device, "torch": version("torch"),
        "model": args.model, "serve_args": args.serve_args, "starts": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
