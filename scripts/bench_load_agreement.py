#!/usr/bin/env python3
"""The bench's load mode (POST /bench with `clients`, what the /bench page and `duet bench
--clients` run) against scripts/bench_concurrency.py at the same client count, on one server,
taken in turn so that both see the same minutes of a noisy machine.

Starts `duet serve` without the prefix cache (or uses --url), optionally runs one POST /bench
sweep over --sweep with --references for the figures, then --repeats times: one POST /bench
level of --clients clients (the preset's prompts, each with its client line in front), then one
bench_concurrency.py level of as many clients on random token ids as long as the load mode's
prompts were (its median). Prints both medians and their ratio; writes JSON under docs/bench/.

  python scripts/bench_load_agreement.py --model dummy-llama-3.2-1b --clients 16 \\
      --max-tokens 128 --sweep 1,16,64 --references transformers \\
      --out docs/bench/load-agreement-llama-3.2-1b-h100.json
  python scripts/bench_load_agreement.py --model smollm2-135m-instruct --clients 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import run_level, start_server, write_result  # noqa: E402


def post_bench(url: str, body: dict) -> dict:
    import httpx

    resp = httpx.post(url + "/bench", json=body, timeout=3600)
    if resp.status_code != 200:
        raise SystemExit(f"POST /bench answered {resp.status_code}: {resp.text[:500]}")
    summary = resp.json()
    if summary.get("errors"):
        raise SystemExit(f"POST /bench failed: {summary['errors']}")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", default="torch")
    p.add_argument("--url", default=None, help="an already running server")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--preset", default="short", choices=["short", "long", "chat"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep", default="", help="first, one POST /bench sweep over these levels")
    p.add_argument("--references", default="", help="the sweep's references: transformers,mlx-lm")
    p.add_argument("--client-procs", type=int, default=4,
                   help="bench_concurrency.py's client processes (the load mode uses up to 4)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="the server's --max-batch (0: its default, as a user's server has)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--server-log", default="/tmp/duet-load-agreement-server.log")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    proc, url = (None, args.url) if args.url else start_server(args)
    base = {"model": args.model, "engines": [args.engine], "max_tokens": args.max_tokens,
            "preset": args.preset}
    try:
        sweep = None
        if args.sweep:
            sweep = post_bench(url, {**base, "clients": [int(c) for c in args.sweep.split(",")],
                                     "references": [r for r in args.references.split(",") if r]})
            for lv in sweep["levels"]:
                print(f"sweep: {lv['target']:<12} {lv['clients']:>3} clients "
                      f"{lv['aggregate_tok_s']:>10,.1f} tok/s", flush=True)
        bench_runs, script_runs = [], []
        for i in range(args.repeats):
            level = post_bench(url, {**base, "clients": [args.clients]})["levels"][0]
            bench_runs.append(level)
            prompt_tokens = int(bench_runs[0]["prompt_tokens_p50"])
            script_runs.append(run_level(url, args.model, args.clients, prompt_tokens,
                                         args.max_tokens, args.engine, args.client_procs))
            print(f"repeat {i + 1}: POST /bench {level['aggregate_tok_s']:,.1f} tok/s, "
                  f"bench_concurrency.py {script_runs[-1]['aggregate_tok_s']:,.1f} tok/s "
                  f"({prompt_tokens}-token prompts)", flush=True)
        import httpx

        health = httpx.get(url + "/health", timeout=10).json()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    bench_med = statistics.median(r["aggregate_tok_s"] for r in bench_runs)
    script_med = statistics.median(r["aggregate_tok_s"] for r in script_runs)
    ratio = bench_med / script_med
    print(f"\n| {args.clients} clients | aggregate tok/s (each run) | median | TTFT p50 ms | "
          f"ITL p50 ms |\n|---|---|---|---|---|")
    for name, runs, med in (("POST /bench load mode", bench_runs, bench_med),
                            ("bench_concurrency.py", script_runs, script_med)):
        each = ", ".join(f"{r['aggregate_tok_s']:,.1f}" for r in runs)
        ttft = [r["ttft_ms_p50"] for r in runs]
        itl = [r["itl_ms_p50"] or 0.0 for r in runs]
        ttft, itl = f"{min(ttft):,.0f}-{max(ttft):,.0f}", f"{min(itl):.1f}-{max(itl):.1f}"
        print(f"| {name} | {each} | {med:,.1f} | {ttft} | {itl} |")
    print(f"\nload mode / script: {ratio:.3f}x (agreement within 10%: "
          f"{'yes' if abs(ratio - 1) <= 0.10 else 'no'})")
    if args.out:
        result = {"date": dt.date.today().isoformat(), "command": " ".join(sys.argv),
                  "model": args.model, "engine": args.engine, "clients": args.clients,
                  "max_tokens": args.max_tokens, "server": health.get("engines"),
                  "bench_levels": bench_runs, "script_levels": script_runs,
                  "bench_median_tok_s": bench_med, "script_median_tok_s": script_med,
                  "ratio": round(ratio, 3), "sweep": sweep}
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
