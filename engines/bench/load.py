"""The bench's load mode: N clients at once, each a real HTTP stream to a running duet server.

A level sends n streaming /v1/completions together, each greedy with end-of-sequence ignored,
from client processes of their own (one Python process sending 128 streams spread its sends
over 0.3-0.5 s and read the answers seconds late: the load generator must not be what is
measured). Every process opens its connections first and waits; all start at one moment.
Per level: aggregate tok/s (all clients' tokens over the wall time from the first request to
the last token), TTFT and inter-token latency p50/p99 (gaps between streamed chunks, pooled
over clients), the server's own TTFT and queue time, the peak batch and KV use seen on
/health, and the load generator's own spread of sends and CPU time."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import random
import statistics
import threading
import time

TOKEN_RANGE = (100, 10_000)  # token ids every benchmarked vocabulary has


class LoadFailed(RuntimeError):
    """Requests of a level failed (the first one's error is the message)."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ms(values: list[float], q: float) -> float | None:
    """The q-th percentile in ms; None without values (JSON has no NaN)."""
    return round(percentile(values, q) * 1000, 1) if values else None


def prompts_for(n: int, length: int, seed: int = 0,
                token_range: tuple[int, int] = TOKEN_RANGE) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*token_range) for _ in range(length)] for _ in range(n)]


# A streamed chunk that carries no new text: a completion's empty first or last chunk, the
# chat's opening role chunk and closing finish chunk. Matched as text (spaces removed): parsing
# every line in the client processes would cost more than the load they generate.
_EMPTY_CHUNKS = ('"text":""', '"content":""}', '"delta":{}')


async def _stream_rounds(client, url: str, body: dict, start_at: float,
                         rounds: int) -> list[dict]:
    """A client's requests one after the other: the first at start_at, each next one as soon as
    the one before ended (the steady state of clients that keep asking, not a single burst)."""
    results = [await _stream_one(client, url, body, start_at)]
    while len(results) < rounds and "error" not in results[-1]:
        results.append(await _stream_one(client, url, body, 0.0))
    return results


async def _stream_one(client, url: str, body: dict, start_at: float) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    await asyncio.sleep(max(0.0, start_at - time.time()))
    sent = time.time()
    chunks: list[float] = []
    tokens = prompt_tokens = 0
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
                prompt_tokens = last["usage"]["prompt_tokens"]
                server = last.get("metrics", {})
            elif not any(e in line.replace(" ", "") for e in _EMPTY_CHUNKS):
                chunks.append(time.time())
    return {"sent": sent, "chunks": chunks, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "server_ttft_s": server.get("ttft_ms", 0) / 1000,
            "server_queue_s": server.get("queue_ms", 0) / 1000,
            "peak_memory_bytes": server.get("peak_memory_bytes", 0)}


def _client_process(url: str, bodies: list[dict], headers: dict, ready, go, start_at,
                    out, rounds: int = 1) -> None:
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
            # One open connection per stream before the start, as an app's client pool keeps
            # them: connecting at the start spread the sends of 32 streams over 40-50 ms (an
            # H100 host, 2026-11-23).
            await asyncio.gather(*(client.get(url + "/health") for _ in bodies))
            ready.put(True)
            await asyncio.to_thread(go.wait)
            cpu = time.process_time()
            streams = await asyncio.gather(
                *(_stream_rounds(client, url, b, start_at.value, rounds) for b in bodies))
            return [r for stream in streams for r in stream], time.process_time() - cpu

    try:
        out.put(asyncio.run(main()))
    except Exception as exc:  # the parent must hear of it, not wait forever
        ready.put(True)
        out.put(([{"error": f"{type(exc).__name__}: {exc}"}], 0.0))


class _HealthWatch:
    """The peak batch, KV use and resident memory /health shows for the benchmarked engine
    while a level runs (polled every 0.2 s: more often perturbs a small CPU's run). The memory
    is the resident set of the process the engine runs in, the same measure for every engine
    (their own meters differ: a CPU process's RSS, a CUDA or MLX allocator's peak); its first
    sample is taken before the level starts."""

    def __init__(self, url: str, headers: dict, model: str | None = None,
                 engine: str | None = None):
        self.seen = {"batch": 0, "kv_used": 0, "rss_start": None, "rss_peak": None}
        self._url, self._headers = url, headers
        self._model, self._engine = model, engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        import httpx

        # One client for every poll: httpx.get() builds a TLS context each call (29 ms of CPU
        # on this 2-core machine), which, five times a second inside the server (POST /bench),
        # took the GIL from its event loop and cost the load mode 10% of what it measured.
        self._client = httpx.Client(timeout=2, headers=self._headers)
        self._poll()
        self.seen["rss_start"] = self.seen["rss_peak"]
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self._poll()  # a last sample: the level's end is within its time
        self._client.close()

    def _mine(self, state: dict) -> bool:
        return ((self._engine is None or state.get("engine") == self._engine)
                and (self._model is None or state.get("model") == self._model))

    def _poll(self) -> None:
        seen = self.seen
        try:
            state = self._client.get(self._url + "/health").json()["engines"]
        except Exception:  # noqa: BLE001  a missed poll is a missed sample, no more
            return
        for e in filter(self._mine, state):
            if e.get("batch", 0) >= seen["batch"]:
                seen["step_ms"] = e.get("step_ms")
                seen["engine_step_ms"] = e.get("engine_step_ms")
            seen["batch"] = max(seen["batch"], e.get("batch", 0))
            seen["kv_used"] = max(seen["kv_used"], e.get("kv_cache_used_bytes", 0))
            seen["kv_size"] = e.get("kv_cache_bytes", 0)
            if e.get("gc_pause_ms") is not None:  # the level's share: last poll less first
                seen.setdefault("gc_start", (e["gc_pause_ms"], e["gc_oldest_collections"]))
                seen["gc_end"] = (e["gc_pause_ms"], e["gc_oldest_collections"])
            if e.get("process_rss_bytes") is not None:
                seen["rss_peak"] = max(seen["rss_peak"] or 0, e["process_rss_bytes"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(0.2)


def run_level(url: str, model: str, n: int, prompt_tokens: int, max_tokens: int,
              engine: str | None = None, procs: int = 4, extra: dict | None = None,
              prompts: list | None = None, headers: dict | None = None,
              token_range: tuple[int, int] = TOKEN_RANGE,
              ready_timeout_s: float = 120.0, rounds: int = 1) -> dict:
    """One level of n clients. extra: more fields for every request body; prompts: n prompts
    (token-id lists or texts, or chat message lists, which go to the chat endpoint) instead of
    prompt_tokens random ids; rounds: requests each client sends one after the other (one: a
    burst of n at once, whose start and tail weigh on a short level). Raises LoadFailed when
    any request fails."""
    prompts = prompts if prompts is not None else prompts_for(n, prompt_tokens, seed=n,
                                                              token_range=token_range)
    bodies = [{"model": model,
               ("messages" if isinstance(p, list) and p and isinstance(p[0], dict)
                else "prompt"): p,
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True},
               **({"engine": engine} if engine else {}), **(extra or {})}
              for p in prompts]
    headers = headers or {}
    procs = max(1, min(procs, n))
    # spawn: the caller may be a server with threads of its own, which fork would copy mid-way
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    workers = [ctx.Process(target=_client_process,
                           args=(url, bodies[i::procs], headers, ready, go, start_at, out,
                                 rounds),
                           daemon=True)
               for i in range(procs)]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ready.get(timeout=ready_timeout_s)
        with _HealthWatch(url, headers, model, engine) as watch:
            start_at.value = time.time() + 0.05
            go.set()
            results, client_cpu = [], 0.0
            for _ in workers:
                got, cpu = out.get()
                results += got
                client_cpu += cpu
    finally:
        go.set()
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise LoadFailed(f"{len(errors)} of {n * rounds} requests failed: {errors[0]}")
    return summarize_level(n, results, watch.seen, client_cpu)


# Every figure of a level, in the order summarize_level gives them.
LEVEL_KEYS = (
    "clients", "tokens", "prompt_tokens_p50", "wall_s", "aggregate_tok_s", "per_client_decode_tok_s_p50",
    "ttft_ms_p50", "ttft_ms_p99", "server_ttft_ms_p50", "server_ttft_ms_p99",
    "server_queue_ms_p50", "sent_spread_ms", "client_cpu_share", "itl_ms_p50", "itl_ms_p99",
    "peak_batch", "peak_kv_used_bytes", "rss_start_bytes", "rss_peak_bytes",
    "rss_peak_delta_bytes", "engine_peak_memory_bytes", "kv_cache_bytes",
    "step_ms_at_peak_batch", "engine_step_ms_at_peak_batch", "gc_pause_ms",
    "gc_oldest_collections",
)


def summarize_level(n: int, results: list[dict], seen: dict, client_cpu_s: float) -> dict:
    first_sent = min(r["sent"] for r in results)
    last = max(r["chunks"][-1] if r["chunks"] else r["sent"] for r in results)
    wall = max(last - first_sent, 1e-9)
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    gaps = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    decode = [(r["tokens"] - 1) / (r["chunks"][-1] - r["chunks"][0]) for r in results
              if r["tokens"] > 1 and len(r["chunks"]) > 1 and r["chunks"][-1] > r["chunks"][0]]
    return {
        "clients": n, "tokens": tokens,
        "prompt_tokens_p50": statistics.median(r.get("prompt_tokens", 0) for r in results),
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 1),
        "per_client_decode_tok_s_p50": round(statistics.median(decode), 1) if decode else None,
        "ttft_ms_p50": ms(ttfts, 50), "ttft_ms_p99": ms(ttfts, 99),
        # Where TTFT goes: the server's own count (from the request's arrival at its engine
        # worker), the part of it spent waiting to be scheduled, and the clients' spread.
        "server_ttft_ms_p50": ms([r["server_ttft_s"] for r in results], 50),
        "server_ttft_ms_p99": ms([r["server_ttft_s"] for r in results], 99),
        "server_queue_ms_p50": ms([r["server_queue_s"] for r in results], 50),
        "sent_spread_ms": round((max(r["sent"] for r in results) - first_sent) * 1000, 1),
        # The load generator's own CPU time over the level's wall time (all its processes):
        # near the client processes' count means it, not the server, set the pace.
        "client_cpu_share": round(client_cpu_s / wall, 3),
        # None where no stream had two chunks (a fast server may send a short answer whole)
        "itl_ms_p50": round(percentile(gaps, 50) * 1000, 2) if gaps else None,
        "itl_ms_p99": round(percentile(gaps, 99) * 1000, 2) if gaps else None,
        "peak_batch": seen["batch"], "peak_kv_used_bytes": seen["kv_used"],
        # Memory, comparable across engines: the engine process's resident set, its peak over
        # the level (sampled) less what it held as the level began. Beside it each engine's own
        # meter, the largest any request reported (what it measures differs: see the target's
        # memory_measure).
        "rss_start_bytes": seen.get("rss_start"), "rss_peak_bytes": seen.get("rss_peak"),
        "rss_peak_delta_bytes": (seen["rss_peak"] - seen["rss_start"]
                                 if seen.get("rss_start") is not None
                                 and seen.get("rss_peak") is not None else None),
        "engine_peak_memory_bytes": max((r.get("peak_memory_bytes", 0) for r in results),
                                        default=0),
        "kv_cache_bytes": seen.get("kv_size", 0),
        "step_ms_at_peak_batch": seen.get("step_ms"),
        "engine_step_ms_at_peak_batch": seen.get("engine_step_ms"),
        # The engine process's garbage collections during the level (the server's own, for an
        # engine in its process): time they stopped its Python threads, and the long ones.
        **_gc_share(seen),
    }


def _gc_share(seen: dict) -> dict:
    if "gc_start" not in seen:
        return {"gc_pause_ms": None, "gc_oldest_collections": None}
    (pause0, oldest0), (pause1, oldest1) = seen["gc_start"], seen["gc_end"]
    return {"gc_pause_ms": round(pause1 - pause0, 3), "gc_oldest_collections": oldest1 - oldest0}


def reference_level(n: int, tokens: int, seconds: float) -> dict:
    """A reference's level (one batch of the same prompts, no HTTP) in a server level's shape:
    what it has no counterpart for (latencies, the server's batch and memory) is None."""
    figures = dict.fromkeys(LEVEL_KEYS)
    return {**figures, "clients": n, "tokens": tokens, "wall_s": round(seconds, 3),
            "aggregate_tok_s": round(tokens / max(seconds, 1e-9), 1)}
