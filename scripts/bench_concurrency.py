#!/usr/bin/env python3
"""Concurrency sweep through the HTTP server: N clients at once, each streaming one completion.

Starts `duet serve` (or uses --url), and for each N in --clients sends N streaming
/v1/completions at once, each a distinct prompt of --prompt-tokens token ids and --max-tokens
new tokens (greedy, end-of-sequence ignored). Clients run in their own processes, apart from the
server's. Per level: aggregate tok/s (all clients' tokens over the wall time from the first
request to the last token), TTFT and inter-token latency p50/p99 (gaps between streamed chunks,
pooled over clients), the peak batch and KV use seen on /health. Then, optionally, the same
batches through transformers generate() (static cache + compile) and mlx-lm's BatchGenerator,
with the server stopped, or (--interleave) beside the idle server, one reference batch after
each of duet's runs. Prints a table; writes JSON under docs/bench/.

  python scripts/bench_concurrency.py --model dummy-llama-3.2-1b --clients 1,4,16,64 \\
      --reference transformers --out docs/bench/concurrency-llama-3.2-1b-h200.json
  python scripts/bench_concurrency.py --model smollm2-135m-instruct --clients 1,8 --max-tokens 64
  python scripts/bench_concurrency.py --model dummy-llama-3.2-1b --engine mlx --clients 16,32 \
      --repeats 7 --max-batch 32 --reference mlx-lm --interleave
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from engines.bench import load  # noqa: E402
from engines.bench.load import ms, percentile  # noqa: E402,F401  (the other scripts' too)

TOKEN_RANGE = list(load.TOKEN_RANGE)  # --max-token-id narrows it


def prompts_for(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return load.prompts_for(n, length, seed, token_range=tuple(TOKEN_RANGE))


def run_level(url: str, model: str, n: int, prompt_tokens: int, max_tokens: int,
              engine: str | None, procs: int, extra: dict | None = None,
              prompts: list | None = None, rounds: int = 1) -> dict:
    """One level of n clients: the bench core's load mode (engines/bench/load.py)."""
    prompts = prompts if prompts is not None else prompts_for(n, prompt_tokens, seed=n)
    try:
        return load.run_level(url, model, n, prompt_tokens, max_tokens, engine, procs, extra,
                              prompts, rounds=rounds)
    except load.LoadFailed as exc:
        raise SystemExit(str(exc)) from exc


def short_during_long(url: str, model: str, engine: str | None, long_tokens: int,
                      prompt_tokens: int) -> dict:
    """Three long generations, then, once all three stream, a 4-token one: how long each took
    (the long ones from their start, the short one from its own)."""
    import httpx

    def body(prompt, n, stream):
        return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": stream, **({"engine": engine} if engine else {})}

    prompts = prompts_for(4, prompt_tokens, seed=99)
    took: dict = {}
    streaming = threading.Semaphore(0)

    def long(i):
        started = time.time()
        with httpx.stream("POST", url + "/v1/completions", json=body(prompts[i], long_tokens,
                                                                      True), timeout=900) as resp:
            resp.raise_for_status()
            first = True
            for line in resp.iter_lines():
                if first and line.startswith("data: {"):
                    first = False
                    streaming.release()
        took[f"long{i}"] = time.time() - started

    longs = [threading.Thread(target=long, args=(i,)) for i in range(3)]
    for t in longs:
        t.start()
    for _ in longs:
        streaming.acquire()
    started = time.time()
    resp = httpx.post(url + "/v1/completions", json=body(prompts[3], 4, False), timeout=900)
    resp.raise_for_status()
    took["short"] = time.time() - started
    for t in longs:
        t.join()
    long_s = min(took[f"long{i}"] for i in range(3))
    return {"long_s": [round(took[f"long{i}"], 2) for i in range(3)],
            "short_s": round(took["short"], 2), "short_over_long": round(took["short"] / long_s, 3)}


# -- the server -------------------------------------------------------------------------------


def compiling(health: dict) -> bool:
    """Whether /health shows an engine still making its compiled step (a server without the
    field: none). One whose compiled step failed stops the benchmark: its eager steps are
    not what it measures."""
    failed = [f"{e.get('model')}: {e['compile_error']}" for e in health.get("engines", [])
              if e.get("compile_error")]
    if failed:
        raise SystemExit("the compiled step failed, the engine steps eagerly: "
                         + "; ".join(failed))
    return any(e.get("compiling") for e in health.get("engines", []))


def start_server(args, *, prefix_cache: bool = False,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """prefix_cache off by default: repeats send the same prompts, and the references prefill
    every one. env: more environment variables for the server."""
    import httpx

    port = args.port
    limits = ["--max-batch", str(args.max_batch), "--max-queue", "256"] if args.max_batch else []
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
           *limits, "--max-connections", "1024", *([] if prefix_cache else ["--no-prefix-cache"]),
           *args.serve_args]
    if args.engine:
        cmd += ["--engine", args.engine]
    log = open(args.server_log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {args.server_log}")
        try:
            health = httpx.get(url + "/health", timeout=2)
            # Measured once the compiled step serves: until then the engine steps eagerly.
            if health.status_code == 200 and not compiling(health.json()):
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"the server did not start in {args.start_timeout} s: see {args.server_log}")


# -- references --------------------------------------------------------------------------------


def load_references(args) -> dict:
    """Each reference system set up once: name -> system (run_batch(prompts, max_tokens) gives
    the seconds to give every prompt max_tokens, prefill included)."""
    from engines.models.config import load_models_file
    from engines.models.sources import resolve_model_dir

    spec = next(s for s in load_models_file(ROOT / "models.toml") if s.id == args.model)
    path = resolve_model_dir(spec)
    systems = {}
    for name in args.reference:
        if name == "transformers":
            from engines.bench.systems import HFStaticCompile

            system = HFStaticCompile(args.device)
        else:
            from engines.bench.systems import MLXLMGenerate

            system = MLXLMGenerate()
        system.setup(path, args.dtype, args.prompt_tokens + args.max_tokens)
        systems[name] = system
    return systems


def reference_tok_s(n: int, max_tokens: int, times: list[float]) -> float:
    return round(n * max_tokens / statistics.median(times), 1)


def reference_runs(args, levels: list[int]) -> dict:
    """Aggregate new tok/s of the references on batches of the same prompts (prefill included,
    as the server's aggregate includes it): the median of --ref-repeats timed runs after one
    warm-up batch of each size."""
    out = {}
    for name, system in load_references(args).items():
        runs = {}
        for n in levels:
            prompts = prompts_for(n, args.prompt_tokens, seed=n)
            system.run_batch(prompts, args.max_tokens)  # compile and warm up at this size
            times = [system.run_batch(prompts, args.max_tokens) for _ in range(args.ref_repeats)]
            runs[n] = reference_tok_s(n, args.max_tokens, times)
            print(f"{name} batch {n}: {runs[n]} tok/s", flush=True)
        system.teardown()
        out[name] = runs
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--url", default=None, help="an already running server")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per level (the lower median is reported)")
    parser.add_argument("--max-batch", type=int, default=64,
                        help="the server's --max-batch (0: the server's default, and its "
                        "default --max-queue too)")
    parser.add_argument("--client-procs", type=int, default=8,
                        help="client processes (default 8: with 4, 16 httpx streams a process "
                        "added ~100 ms to the TTFT of 64 clients on an H200 host)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--server-log", default="/tmp/duet-bench-server.log")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--reference", default="", help="transformers,mlx-lm")
    parser.add_argument("--ref-repeats", type=int, default=3)
    parser.add_argument("--interleave", action="store_true",
                        help="run the references in the bench's own process beside the idle "
                        "server, one batch after each of duet's runs (same levels, same "
                        "repeats): on a noisy machine both see the same minutes")
    parser.add_argument("--ref-clients", default=None,
                        help="the levels the references run (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None)
    parser.add_argument("--short-during-long", type=int, default=0, metavar="TOKENS",
                        help="also time a 4-token request sent while three of TOKENS run")
    parser.add_argument("--max-token-id", type=int, default=TOKEN_RANGE[1],
                        help="prompts use ids below this (a small test vocabulary)")
    args = parser.parse_args()
    TOKEN_RANGE[:] = [min(TOKEN_RANGE[0], args.max_token_id // 2), args.max_token_id]
    args.reference = [r for r in args.reference.split(",") if r]
    levels = [int(c) for c in args.clients.split(",")]

    ref_levels = [int(c) for c in args.ref_clients.split(",")] if args.ref_clients else levels
    interleaved = load_references(args) if args.interleave else {}
    ref_times: dict[str, dict[int, list[float]]] = {name: {} for name in interleaved}
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        import httpx

        info = httpx.get(url + "/health").json()
        rows = []
        for n in levels:
            # One unmeasured round first, as the references get one per batch: MLX's CUDA
            # backend compiles kernels for each new shape (a batch size, a prefill group) the
            # first time it meets it.
            run_level(url, args.model, n, args.prompt_tokens, min(args.max_tokens, 16),
                      args.engine, args.client_procs)
            prompts = prompts_for(n, args.prompt_tokens, seed=n)
            beside = interleaved if n in ref_levels else {}
            for system in beside.values():
                system.run_batch(prompts, args.max_tokens)  # warm up at this size
            runs = []
            for _ in range(args.repeats):
                runs.append(run_level(url, args.model, n, args.prompt_tokens, args.max_tokens,
                                      args.engine, args.client_procs))
                # The server idles meanwhile: the reference's batch runs beside it, in turn.
                for name, system in beside.items():
                    ref_times[name].setdefault(n, []).append(
                        system.run_batch(prompts, args.max_tokens))
            in_order = [r["aggregate_tok_s"] for r in runs]  # pairs with the references' runs
            runs.sort(key=lambda r: r["aggregate_tok_s"])
            # The lower median: with an even count the worse of the middle two, never the best.
            rows.append({**runs[(len(runs) - 1) // 2],
                         "runs": [r["aggregate_tok_s"] for r in runs], "runs_in_order": in_order})
            r = rows[-1]
            print(f"{n:4} clients: {r['aggregate_tok_s']:9.1f} tok/s  TTFT p50 "
                  f"{r['ttft_ms_p50']:8.1f} ms p99 {r['ttft_ms_p99']:8.1f} (server "
                  f"{r['server_ttft_ms_p50']:.1f}, queued {r['server_queue_ms_p50']:.1f}, sent over "
                  f"{r['sent_spread_ms']:.1f})  ITL p50 "
                  f"{r['itl_ms_p50']:6.2f} ms p99 {r['itl_ms_p99']:7.2f}  batch {r['peak_batch']:3}"
                  f"  KV {r['peak_kv_used_bytes'] / 2**20:7.1f} MiB  step {r['step_ms_at_peak_batch']}"
                  f" ms (engine {r['engine_step_ms_at_peak_batch']})  gc {r['gc_pause_ms']} ms"
                  f" ({r['gc_oldest_collections']} oldest)", flush=True)
        latency = None
        if args.short_during_long:
            latency = short_during_long(url, args.model, args.engine, args.short_during_long,
                                        args.prompt_tokens)
            print(f"a 4-token request during three of {args.short_during_long} tokens: "
                  f"{latency['short_s']} s against {latency['long_s']} s "
                  f"({latency['short_over_long']:.0%})", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if interleaved:
        references = {name: {n: reference_tok_s(n, args.max_tokens, times)
                             for n, times in by_level.items()}
                      for name, by_level in ref_times.items()}
        for system in interleaved.values():
            system.teardown()
    else:
        references = reference_runs(args, ref_levels) if args.reference else {}
    result = {
        "date": dt.date.today().isoformat(), "model": args.model, "engine": args.engine,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "server": info.get("engines"), "levels": rows, "references": references,
        "short_during_long": latency,
        "reference_runs_s": ref_times if interleaved else None,
        "command": " ".join(sys.argv),
    }
    base = rows[0]["aggregate_tok_s"]
    print("\n| clients | duet tok/s | x 1 client | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "peak batch | peak KV MiB |" + "".join(f" {k} tok/s | duet / {k} |" for k in references))
    for r in rows:
        refs = "".join(
            f" {references[k].get(r['clients'], float('nan')):,.0f} | "
            f"{r['aggregate_tok_s'] / references[k][r['clients']]:.2f}x |"
            if r["clients"] in references[k] else " - | - |" for k in references)
        print(f"| {r['clients']} | {r['aggregate_tok_s']:,.0f} | {r['aggregate_tok_s'] / base:.1f}x "
              f"| {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} / "
              f"{r['itl_ms_p99']:.1f} | {r['peak_batch']} | "
              f"{r['peak_kv_used_bytes'] / 2**20:.0f} |{refs}")
    if args.out:
        write_result(args.out, result)
    return 0


def write_result(out: str | Path, result: dict) -> None:
    """A benchmark's JSON under docs/bench/ (or wherever --out says), its folder made."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
