#!/usr/bin/env python3
"""Tensor parallelism through the server: one model on one GPU against the same model split over
N GPUs (`--tensor-parallel N`), in one run, and a model one GPU cannot hold.

For each configuration MODEL@RANKS it starts `duet serve --model MODEL --tensor-parallel RANKS`,
warms it up, then runs each client level --repeats times (N clients, each streaming one
completion of --max-tokens tokens after a --prompt-tokens prompt, greedy, end of sequence
ignored), and stops the server. Prints the median aggregate tok/s per configuration and level,
each split configuration's ratio to the same model on one GPU, and the bandwidth floor of a
batch-1 step: the weights one rank reads per token over its GPU's memory bandwidth (what no
batch-1 decode beats). Writes JSON under docs/bench/.

  python scripts/bench_tensor_parallel.py \\
      --configs dummy-llama-3.1-8b@1,dummy-llama-3.1-8b@2,dummy-llama-3.1-70b@2 --clients 1,64
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_concurrency import run_level, start_server, write_result  # noqa: E402

# Peak memory bandwidth by GPU name (vendors' figures, bytes/s): the floor's denominator.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def gpu() -> tuple[str, float | None]:
    """The first GPU's name and bandwidth, from nvidia-smi: this process keeps off the GPUs
    (a CUDA context would take memory a large model's rank needs)."""
    import subprocess

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "cpu", None
    name = f"{len(names)}x {names[0]}" if names else "cpu"
    return name, next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def rank_weight_bytes(model_id: str, ranks: int) -> int:
    """Bytes of weights one rank reads a decode step in bf16: its share of every layer, the
    whole vocabulary projection and norms (the embedding is only looked up)."""
    from engines.models.config import load_models_file
    from engines.models.sources import resolve_model_dir

    spec = next(s for s in load_models_file(ROOT / "models.toml") if s.id == model_id)
    cfg = json.loads((resolve_model_dir(spec) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * (layers * per_layer // ranks + cfg["vocab_size"] * h)


def parse_config(config: str) -> tuple[str, int, dict[str, str]]:
    """MODEL@RANKS[+NAME=VALUE...]: a model, its ranks, and environment variables for its
    server (an A/B of a switch such as DUET_TP_FUSED_NORMS=1 in one run)."""
    head, *env = config.split("+")
    model, _, ranks = head.partition("@")
    return model, int(ranks or 1), dict(e.split("=", 1) for e in env)


def run_config(args, config: str, levels: list[int]) -> dict:
    model, ranks, env = parse_config(config)
    serve = argparse.Namespace(**{**vars(args), "model": model,
                                  "serve_args": ["--tensor-parallel", str(ranks), *args.serve_args],
                                  "engine": "torch",
                                  "server_log": f"{args.server_log}-{config}.log"})
    ready = []
    for start in range(args.starts):  # the ones before the last fill the compile caches
        started = time.time()
        proc, url = start_server(serve, env=env)
        ready.append(round(time.time() - started, 1))
        if start < args.starts - 1:
            proc.terminate()
            proc.wait(120)
    out = {"config": config, "model": model, "ranks": ranks, "env": env,
           "ready_s": ready[-1], "earlier_starts_ready_s": ready[:-1], "levels": {}}
    try:
        import httpx

        health = httpx.get(url + "/health", timeout=10).json()
        out["health"] = health
        for n in levels:  # a short warm-up round per level: the first batch of a size is cold
            run_level(url, model, n, args.prompt_tokens, 16, "torch", args.client_procs)
        for n in levels:
            runs = [run_level(url, model, n, args.prompt_tokens, args.max_tokens, "torch",
                              args.client_procs) for _ in range(args.repeats)]
            tok_s = [r["aggregate_tok_s"] for r in runs]
            out["levels"][n] = {"aggregate_tok_s": statistics.median(tok_s), "runs": tok_s,
                                "per_client_decode_tok_s_p50": statistics.median(
                                    r["per_client_decode_tok_s_p50"] for r in runs),
                                "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in runs),
                                "step_ms_at_peak_batch": statistics.median(
                                    r["step_ms_at_peak_batch"] or 0 for r in runs),
                                "engine_step_ms_at_peak_batch": statistics.median(
                                    r["engine_step_ms_at_peak_batch"] or 0 for r in runs),
                                # Every figure of the median run (where a level's time goes:
                                # the server's TTFT and queueing, the clients' spread).
                                "median_run": sorted(runs, key=lambda r: r["aggregate_tok_s"])[
                                    len(runs) // 2]}
            print(f"{config} {n:>3} clients: {statistics.median(tok_s):,.0f} tok/s "
                  f"({', '.join(f'{t:,.0f}' for t in tok_s)})", flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="dummy-llama-3.1-8b@1,dummy-llama-3.1-8b@2",
                        help="MODEL@RANKS[+NAME=VALUE...], comma-separated, run in this order "
                             "(NAME=VALUE: an environment variable of that server)")
    parser.add_argument("--clients", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--server-log", default="/tmp/duet-bench-server",
                        help="each configuration's server log: this, then -MODEL@RANKS.log")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--starts", type=int, default=1,
                        help="start each server this many times and measure the last: the "
                             "starts before fill Inductor's cache, as a server's second or third "
                             "start finds it (the ranks share it: each sees its GPU as cuda:0)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    name, bandwidth = gpu()
    out = args.out or ROOT / "docs" / "bench" / f"tensor-parallel-{dt.date.today()}.json"
    results = []
    for config in args.configs.split(","):
        results.append(run_config(args, config, levels))
        floor = bandwidth and rank_weight_bytes(results[-1]["model"],
                                                results[-1]["ranks"]) / bandwidth
        results[-1]["batch1_floor_tok_s"] = round(1 / floor, 1) if floor else None
        # Written after each configuration too: a run cut short keeps what it measured.
        write_result(out, summary(args, name, results))
    one: dict[str, dict] = {}
    for r in results:  # each model's first run on one GPU is the baseline
        if r["ranks"] == 1:
            one.setdefault(r["model"], r)
    print(f"\n{name}, {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, "
          f"medians of {args.repeats}")
    print(f"{'configuration':<28} {'ready s':>8} " + " ".join(f"{n:>10}" for n in levels)
          + "   vs one GPU      batch-1 floor")
    for r in results:
        base = one.get(r["model"]) if r["ranks"] > 1 else None
        r["vs_one_gpu"] = {n: round(r["levels"][n]["aggregate_tok_s"]
                                    / base["levels"][n]["aggregate_tok_s"], 3)
                           for n in levels} if base else None
        ratios = (" ".join(f"{v:.2f}x" for v in r["vs_one_gpu"].values())
                  if base else "-")
        print(f"{r['config']:<28} {r['ready_s']:>8} "
              + " ".join(f"{r['levels'][n]['aggregate_tok_s']:>10,.0f}" for n in levels)
              + f"   {ratios:<15} {r['batch1_floor_tok_s'] or '-'}")
    write_result(out, summary(args, name, results))
    return 0


def summary(args, device: str, results: list[dict]) -> dict:
    return {"date": dt.date.today().isoformat(), "device": device,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "max_batch": args.max_batch,
            "command": " ".join(sys.argv), "results": results}


if __name__ == "__main__":
    sys.exit(main())
