#!/usr/bin/env python3
"""The HTTP side's own cost per streamed token, without a model: the real app (worker, engine
process, streaming, logprobs) over a scripted engine whose step takes --step-ms whatever its
rows, N streaming chat clients in processes of their own (the bench core's load mode).

For each feature and repeat, prints the aggregate tok/s, the HTTP process's CPU time per
streamed token (its own threads, not the engine's process, which is measured apart) and the
chunks a stream got per token (under 1: the server fell behind and sent several tokens a
chunk). With --py-spy FILE the HTTP process is sampled during the last feature's runs
(py-spy's raw collapsed stacks, for a flame graph or a grep). Writes JSON with --out.

  python scripts/profile_http.py --clients 16 --step-ms 2 --features none,logprobs
  python scripts/profile_http.py --clients 64 --step-ms 1 --py-spy /tmp/http.txt
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_features import ProcessShares

from engines.bench import load
from engines.fake import FakeEngine
from engines.memory import Estimate

FEATURES = {
    "none": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
}
MODELS = '[[models]]\nid = "scripted"\nsource = "path:/unused"\nengine = "torch"\n' \
         'context_length = 4096\n'


class ScriptedFactory:
    """Makes one FakeEngine that answers every prompt with ASCII text longer than any
    request asks for (one token a character)."""

    names = ("torch",)

    def __init__(self, step_s: float, max_batch: int):
        self.step_s, self.max_batch = step_s, max_batch

    def available(self, name):
        return name == "torch"

    def estimate(self, name, spec):
        return Estimate(1000, 1000, spec.context_length)

    def default_memory_budget(self):
        return 1 << 40

    def prepare(self, name):
        pass

    def create(self, name, spec, kv_cache_limit=None):
        reply = "The quick brown fox jumps over the lazy dog. " * 40
        return FakeEngine(name, reply=reply, context_length=spec.context_length,
                          token_delay_s=self.step_s, max_batch=self.max_batch)


def serve(port: int, models_file: str, step_s: float, max_batch: int) -> None:
    from server.app import create_app
    from server.settings import Settings
    from server.uvicorn_server import build_server

    settings = Settings(models_file=models_file, engine_process="on", host="127.0.0.1",
                        log_level="warning", max_queue=4 * max_batch)
    app = create_app(settings, ScriptedFactory(step_s, max_batch))
    build_server(app, settings, port=port).run()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--features", default="none,logprobs")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--py-spy", default=None, metavar="FILE")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    features = args.features.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        models_file = Path(tmp) / "models.toml"
        models_file.write_text(MODELS)
        ctx = mp.get_context("spawn")
        server = ctx.Process(target=serve, args=(args.port, str(models_file),
                                                 args.step_ms / 1000, args.clients))
        server.start()
        url = f"http://127.0.0.1:{args.port}"
        import httpx

        deadline = time.time() + 120
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                if time.time() > deadline:
                    raise SystemExit("the server did not start")
                time.sleep(0.2)
        prompts = [[{"role": "user", "content": f"client {i} says hello"}]
                   for i in range(args.clients)]
        # the engine loads on the first request
        load.run_level(url, "scripted", 2, 8, 8, None, 1, None, prompts[:2])
        shares = ProcessShares(server.pid)
        rows = []
        try:
            for repeat in range(args.repeats):
                for f in features:
                    spy = None
                    if args.py_spy and f == features[-1] and repeat == args.repeats - 1:
                        spy = subprocess.Popen(
                            [str(Path(sys.executable).with_name("py-spy")), "record",
                             "--pid", str(server.pid), "--format", "raw",
                             "--rate", "500", "--gil", "--nonblocking", "-o", args.py_spy],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(1.0)
                    r = shares.measure(lambda: load.run_level(
                        url, "scripted", args.clients, 8, args.max_tokens, None,
                        args.client_procs, FEATURES[f], prompts, rounds=args.rounds))
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
                        spy.wait(60)
                    tokens = args.clients * args.rounds * args.max_tokens
                    row = {"feature": f, "repeat": repeat,
                           "aggregate_tok_s": r["aggregate_tok_s"],
                           "http_us_per_token": 1e6 * r["http_cpu_s"] / tokens,
                           "http_sys_us_per_token": 1e6 * r["http_kernel_s"] / tokens,
                           "engine_us_per_token": 1e6 * (r["engine_cpu_s"] or float("nan"))
                           / tokens,
                           "itl_ms_p50": r["itl_ms_p50"]}
                    rows.append(row)
                    print(f"{f:10} {row['aggregate_tok_s']:9.0f} tok/s  HTTP process "
                          f"{row['http_us_per_token']:6.1f} us/token "
                          f"({row['http_sys_us_per_token']:.1f} in the "
                          f"kernel)  engine process "
                          f"{row['engine_us_per_token']:6.1f} us/token  ITL p50 "
                          f"{row['itl_ms_p50']:.2f} ms", flush=True)
        finally:
            server.terminate()
            server.join(30)

    print(f"\n{args.clients} clients, a {args.step_ms} ms step, {args.rounds} requests of "
          f"{args.max_tokens} tokens a client; medians of {args.repeats}")
    print("| feature | tok/s | HTTP process us/token | engine process us/token |")
    print("|---|---|---|---|")
    summary = {}
    for f in features:
        mine = [r for r in rows if r["feature"] == f]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("aggregate_tok_s", "http_us_per_token", "engine_us_per_token")}
        summary[f] = med
        print(f"| {f} | {med['aggregate_tok_s']:,.0f} | {med['http_us_per_token']:.1f} | "
              f"{med['engine_us_per_token']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": dt.date.today().isoformat(), "cpus": os.cpu_count(), "rows": rows,
            "summary": summary, "command": " ".join(sys.argv)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
