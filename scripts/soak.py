#!/usr/bin/env python3
"""Soak test: N concurrent clients for M minutes against a live duet, mixing streaming, plain,
cancelled and malformed requests. Reports requests served, errors by kind, p50/p99 latency and
the server's resident memory after warm-up and at the end; writes docs/soak.md and
docs/soak.json.

  python scripts/soak.py                       # starts `duet serve` on the default model
  python scripts/soak.py --clients 16 --minutes 10 --url http://127.0.0.1:8000 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TOPICS = ["rain", "cats", "bread", "music", "winter", "the sea", "trees", "chess", "coffee", "bees"]
KINDS = {"stream": 35, "plain": 35, "cancelled": 15, "malformed": 15}
# Each malformed request and the status it must get.
MALFORMED = [
    ("bad-json", 400), ("bad-temperature", 400), ("unknown-model", 404), ("n=2", 400),
    ("too-large", 413), ("tools", 400),
]


def chat_body(rng: random.Random, max_tokens: int, stream: bool) -> dict:
    topic = rng.choice(TOPICS)
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]), "stream": stream}


class Stats:
    def __init__(self):
        self.served: Counter = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter = Counter()

    def ok(self, kind: str, seconds: float) -> None:
        self.served[kind] += 1
        self.latency[kind].append(seconds)


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Stats, max_tokens: int):
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    start = time.perf_counter()
    try:
        if kind == "plain":
            resp = await client.post("/v1/chat/completions", json=chat_body(rng, max_tokens, False))
            if resp.status_code != 200 or not resp.json()["choices"][0]["message"]["content"]:
                stats.errors[f"plain:{resp.status_code}"] += 1
                return
        elif kind == "stream":
            async with client.stream("POST", "/v1/chat/completions",
                                     json=chat_body(rng, max_tokens, True)) as resp:
                lines = [line async for line in resp.aiter_lines() if line]
            if resp.status_code != 200 or lines[-1] != "data: [DONE]" or any('"error"' in l for l in lines):
                stats.errors[f"stream:{resp.status_code}:{lines[-1][:40] if lines else ''}"] += 1
                return
        elif kind == "cancelled":
            if rng.random() < 0.5:  # leave mid-stream after the first chunks
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat_body(rng, 256, True)) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += bool(line)
                        if seen >= 3:
                            break
            else:  # give up on a plain request before it is answered
                try:
                    await client.post("/v1/chat/completions", json=chat_body(rng, 256, False),
                                      timeout=rng.uniform(0.2, 1.0))
                except httpx.TimeoutException:
                    pass
        else:
            name, expected = rng.choice(MALFORMED)
            body: dict | bytes = chat_body(rng, max_tokens, False)
            if name == "bad-json":
                body = b'{"model": "' + MODEL.encode() + b'", "messages": ['
            elif name == "bad-temperature":
                body["temperature"] = 7
            elif name == "unknown-model":
                body["model"] = "no-such-model"
            elif name == "n=2":
                body["n"] = 2
            elif name == "too-large":
                body["messages"][0]["content"] = "x" * (1024 * 1024 + 1)
            elif name == "tools":
                body["tools"] = [{"type": "function", "function": {"name": "f"}}]
            kw = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            resp = await client.post("/v1/chat/completions", **kw)
            err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith(
                "application/json") else {}
            if resp.status_code != expected or set(err) != {"message", "type", "param", "code"}:
                stats.errors[f"malformed-{name}:{resp.status_code}"] += 1
                return
    except Exception as exc:  # a client-side failure is an error of its own kind
        stats.errors[f"{kind}:{type(exc).__name__}"] += 1
        return
    stats.ok(kind, time.perf_counter() - start)


async def client_loop(url: str, seed: int, until: float, stats: Stats, max_tokens: int):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < until:
            await one_request(client, rng, stats, max_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def soak(url: str, pid: int, clients: int, minutes: float, max_tokens: int) -> dict:
    process = psutil.Process(pid)
    warm = Stats()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        rng = random.Random(0)
        for _ in range(8):  # every kind, so lazy allocations happen before the baseline
            await one_request(client, rng, warm, max_tokens)
    rss_start = process.memory_info().rss
    stats = Stats()
    samples = [(0.0, rss_start)]
    started = time.monotonic()
    until = started + minutes * 60

    async def sample_memory():
        while time.monotonic() < until:
            await asyncio.sleep(15)
            samples.append((round(time.monotonic() - started, 1), process.memory_info().rss))

    await asyncio.gather(sample_memory(), *(client_loop(url, seed, until, stats, max_tokens)
                                           for seed in range(1, clients + 1)))
    elapsed = time.monotonic() - started
    await asyncio.sleep(1)  # let cancelled generations reach their next step
    rss_end = process.memory_info().rss
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        health = (await client.get("/health")).status_code
    served_all = [x for kind in ("plain", "stream") for x in stats.latency[kind]]
    return {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores "
                   f"(shared with other work; latencies are noisy)",
        "model": MODEL, "clients": clients, "minutes": minutes, "max_tokens": max_tokens,
        "elapsed_s": round(elapsed, 1),
        "requests": sum(stats.served.values()) + sum(stats.errors.values()),
        "served": dict(stats.served),
        "errors": dict(stats.errors),
        "latency_s": {
            kind: {"p50": round(percentile(v, 0.5), 3), "p99": round(percentile(v, 0.99), 3),
                   "n": len(v)}
            for kind, v in [*stats.latency.items(), ("plain+stream", served_all)] if v
        },
        "throughput_rps": round(sum(stats.served.values()) / elapsed, 2),
        "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
        "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
        "rss_samples": samples,
        "health_after": health,
    }


def report_md(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    lines = [
        "# Soak test", "",
        (f"`scripts/soak.py`, {r['date']}, {r['machine']}; model {r['model']} on the torch "
         f"engine, {r['clients']} concurrent clients for {r['minutes']} min, "
         f"max_tokens {r['max_tokens']}."),
        "", "| | |", "|---|---|",
        f"| requests | {r['requests']} ({r['throughput_rps']} answered per second) |",
        f"| served by kind | {', '.join(f'{k} {v}' for k, v in sorted(r['served'].items()))} |",
        f"| errors by kind | {', '.join(f'{k} {v}' for k, v in sorted(r['errors'].items())) or 'none'} |",
        f"| server RSS after warm-up | {mib(r['rss_start_bytes'])} |",
        f"| server RSS at the end | {mib(r['rss_end_bytes'])} ({r['rss_growth_pct']:+.2f}%) |",
        f"| /health afterwards | {r['health_after']} |",
        "", "| kind | n | p50 latency (s) | p99 latency (s) |", "|---|---|---|---|",
    ]
    for kind, v in sorted(r["latency_s"].items()):
        lines.append(f"| {kind} | {v['n']} | {v['p50']} | {v['p99']} |")
    lines += ["", ("Kinds: `plain` and `stream` are ordinary chat requests (latency includes the "
              "wait behind other clients on the one engine); `cancelled` leaves a stream after its "
              "first chunks or gives up on a plain request after 0.2 to 1 s; `malformed` sends bad "
              "JSON, a bad field, an unknown model, `n=2`, `tools` or a body over 1 MiB and must "
              "get the right status in the OpenAI error shape. Raw figures: `docs/soak.json`."), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=2.5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--pid", type=int, help="its process id, for memory (with --url)")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="where soak.md/json go")
    args = parser.parse_args()
    proc = None
    if args.url:
        if not args.pid:
            parser.error("--url needs --pid, to read the server's memory")
        url, pid = args.url, args.pid
    else:
        log_path = Path(tempfile.gettempdir()) / "duet-soak-server.log"
        proc, url = start_server(log_path)
        pid = proc.pid
        print(f"server {url} (pid {pid}, log {log_path})")
    try:
        result = asyncio.run(soak(url, pid, args.clients, args.minutes, args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "soak.md").write_text(report_md(result))
    print(report_md(result))
    ok = not result["errors"] and result["rss_growth_pct"] < 5 and result["health_after"] == 200
    print("PASS" if ok else "FAIL: errors or memory growth, see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
