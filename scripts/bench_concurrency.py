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
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


TOKEN_RANGE = [100, 10_000]  # token ids every benchmarked vocabulary has


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def prompts_for(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(n)]


# -- the load: clients in worker processes -------------------------------------------------


# A streamed chunk that carries no new text: a completion's empty first or last chunk, the
# chat's opening role chunk and closing finish chunk. Matched as text (spaces removed): parsing every line in the client
# processes would cost more than the load they generate.
_EMPTY_CHUNKS = ('"text":""', '"content":""}', '"delta":{}')


async def _stream_one(client, url: str, body: dict, start_at: float) -> dict:
    import httpx  # noqa: F401

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    await asyncio.sleep(max(0.0, start_at - time.time()))
    sent = time.time()
    chunks: list[float] = []
    tokens = 0
    server: dict = {}
    async with client.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code} {await resp.aread()!r}"[:300]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"usage"' in line and '"choices":[]' in line.replace(" ", ""):
                last = json.loads(line[6:])
                tokens = last["usage"]["completion_tokens"]
                server = last.get("metrics", {})
            elif not any(e in line.replace(" ", "") for e in _EMPTY_CHUNKS):
                chunks.append(time.time())
    return {"sent": sent, "chunks": chunks, "tokens": tokens,
            "server_ttft_s": server.get("ttft_ms", 0) / 1000,
            "server_queue_s": server.get("queue_ms", 0) / 1000}


def _client_process(url: str, bodies: list[dict], start_at: float, out) -> None:
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            # One open connection per stream before the start, as an app's client pool keeps
            # them: connecting at the start spread the sends of 32 streams over 40-50 ms (an
            # H100 host, 2026-11-23), time the in-process references never pay.
            await asyncio.gather(*(client.get(url + "/health") for _ in bodies))
            return await asyncio.gather(*(_stream_one(client, url, b, start_at) for b in bodies))

    out.put(asyncio.run(main()))


def run_level(url: str, model: str, n: int, prompt_tokens: int, max_tokens: int,
              engine: str | None, procs: int, extra: dict | None = None,
              prompts: list | None = None) -> dict:
    """One level of n clients. extra: more fields for every request body; prompts: n prompts
    (token-id lists, or chat message lists, which send the requests to the chat endpoint)
    instead of prompt_tokens random ids."""
    prompts = prompts if prompts is not None else prompts_for(n, prompt_tokens, seed=n)
    bodies = [{"model": model, ("messages" if isinstance(p[0], dict) else "prompt"): p,
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True},
               **({"engine": engine} if engine else {}), **(extra or {})}
              for p in prompts]
    procs = max(1, min(procs, n))
    out = mp.Queue()
    start_at = time.time() + 1.5  # every process connected and waiting by then
    workers = [mp.Process(target=_client_process, args=(url, bodies[i::procs], start_at, out))
               for i in range(procs)]
    seen = {"batch": 0, "kv_used": 0}
    stop = threading.Event()

    def watch():
        import httpx

        while not stop.is_set():
            try:
                state = httpx.get(url + "/health", timeout=2).json()["engines"]
                for e in state:
                    if e.get("batch", 0) >= seen["batch"]:
                        seen["step_ms"] = e.get("step_ms")
                        seen["engine_step_ms"] = e.get("engine_step_ms")
                    seen["batch"] = max(seen["batch"], e.get("batch", 0))
                    seen["kv_used"] = max(seen["kv_used"], e.get("kv_cache_used_bytes", 0))
                    seen["kv_size"] = e.get("kv_cache_bytes", 0)
            except Exception:
                pass
            time.sleep(0.2)  # more often perturbs a small CPU's run

    watcher = threading.Thread(target=watch, daemon=True)
    for w in workers:
        w.start()
    watcher.start()
    results = []
    for _ in workers:
        results += out.get()
    for w in workers:
        w.join()
    stop.set()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{len(errors)} of {n} requests failed: {errors[0]}")
    first_sent = min(r["sent"] for r in results)
    last = max(r["chunks"][-1] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["chunks"][0] - r["sent"] for r in results]
    gaps = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    decode = [(r["tokens"] - 1) / (r["chunks"][-1] - r["chunks"][0]) for r in results
              if r["tokens"] > 1 and r["chunks"][-1] > r["chunks"][0]]
    return {
        "clients": n, "tokens": tokens, "wall_s": round(last - first_sent, 3),
        "aggregate_tok_s": round(tokens / (last - first_sent), 1),
        "per_client_decode_tok_s_p50": round(statistics.median(decode), 1) if decode else None,
        "ttft_ms_p50": ms(ttfts, 50), "ttft_ms_p99": ms(ttfts, 99),
        # Where TTFT goes: the server's own count (from the request's arrival at its engine
        # worker), the part of it spent waiting to be scheduled, and the clients' spread.
        "server_ttft_ms_p50": ms([r["server_ttft_s"] for r in results], 50),
        "server_ttft_ms_p99": ms([r["server_ttft_s"] for r in results], 99),
        "server_queue_ms_p50": ms([r["server_queue_s"] for r in results], 50),
        "sent_spread_ms": round((max(r["sent"] for r in results) - first_sent) * 1000, 1),
        "itl_ms_p50": round(percentile(gaps, 50) * 1000, 2),
        "itl_ms_p99": round(percentile(gaps, 99) * 1000, 2),
        "peak_batch": seen["batch"], "peak_kv_used_bytes": seen["kv_used"],
        "kv_cache_bytes": seen.get("kv_size", 0),
        "step_ms_at_peak_batch": seen.get("step_ms"),
        "engine_step_ms_at_peak_batch": seen.get("engine_step_ms"),
    }


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


def start_server(args, *, prefix_cache: bool = False) -> tuple[subprocess.Popen, str]:
    """prefix_cache off by default: repeats send the same prompts, and the references prefill
    every one."""
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
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {args.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
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
                  f" ms (engine {r['engine_step_ms_at_peak_batch']})", flush=True)
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
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
