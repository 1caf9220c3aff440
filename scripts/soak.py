#!/usr/bin/env python3
"""Soak test: N concurrent clients for M minutes against a live duet, mixing streaming, plain,
cancelled and malformed requests with the attacks that once hurt it: big classifications
abandoned by their client, headers sent a byte at a time, streams left mid-way. Greedy answers
are checked against the ones each prompt gets alone (a lost or mixed response is an error), and
so is every 5xx. RSS and queue depth are sampled over time and plotted. When the script started
the server itself, it ends with a shutdown under load: SIGTERM while requests are open, each of
which must end cleanly (complete, an error event and [DONE], or a JSON 503) with no traceback in
the server's log. Writes docs/soak.md, docs/soak.json and docs/soak.png.

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
KINDS = {"stream": 30, "plain": 30, "cancelled": 15, "malformed": 12, "classify": 5,
         "big-classification": 5, "slow-headers": 3}
SHUTDOWN_GRACE_S = 2.0
# A classification of 64 inputs x 16 long labels: minutes of work that its client abandons.
BIG_CLASSIFICATION = {
    "model": MODEL, "input": [f"Review {i}: the {TOPICS[i % 10]} was fine, I suppose." for i in range(64)],
    "labels": [f"category {i}: " + "a rather long description of the category " * 1 for i in range(16)],
}
# Each malformed request and the status it must get.
MALFORMED = [
    ("bad-json", 400), ("bad-temperature", 400), ("unknown-model", 404), ("n=2", 400),
    ("too-large", 413), ("tools", 400),
]


def chat_body(rng: random.Random, max_tokens: int, stream: bool, topic: str | None = None,
              temperature: float | None = None) -> dict:
    topic = topic or rng.choice(TOPICS)
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": max_tokens,
            "temperature": rng.choice([0, 0.7]) if temperature is None else temperature,
            "stream": stream}


def mismatch(body: dict, text: str, expected: dict[str, str]) -> bool:
    """A greedy answer that differs from the one its prompt gets alone: lost or mixed."""
    if body["temperature"] != 0:
        return False
    topic = body["messages"][0]["content"][len("Tell me about "):-1]
    return topic in expected and text != expected[topic]


def stream_text(lines: list[str]) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines if line.startswith('data: {"id'))


async def slow_headers(url: str, rng: random.Random) -> str | None:
    """Trickle a request's headers a byte every 0.5 s; the server must close the connection
    (with a 408) within its header timeout. Returns an error kind, or None."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"GET /v1/models HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"z" * 200
    started = time.monotonic()
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.5)
            except TimeoutError:
                if time.monotonic() - started > 60:
                    return "slow-headers:never-closed"
                continue
            if data.startswith(b"HTTP/1.1 408") or not data:
                return None
            return f"slow-headers:{data[:12]!r}"
    except (ConnectionError, OSError):
        return None  # closed on us mid-write: what should happen
    finally:
        writer.close()
    return "slow-headers:all-sent"


class Stats:
    def __init__(self):
        self.served: Counter = Counter()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter = Counter()

    def ok(self, kind: str, seconds: float) -> None:
        self.served[kind] += 1
        self.latency[kind].append(seconds)


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Stats, max_tokens: int,
                      expected: dict[str, str], kind: str | None = None):
    kind = kind or rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    start = time.perf_counter()
    try:
        if kind == "plain":
            body = chat_body(rng, max_tokens, False)
            resp = await client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200 or not resp.json()["choices"][0]["message"]["content"]:
                stats.errors[f"plain:{resp.status_code}"] += 1
                return
            if mismatch(body, resp.json()["choices"][0]["message"]["content"], expected):
                stats.errors["plain:mixed-or-lost"] += 1
                return
        elif kind == "stream":
            body = chat_body(rng, max_tokens, True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = [line async for line in resp.aiter_lines() if line]
            if resp.status_code != 200 or lines[-1] != "data: [DONE]" or any('"error"' in l for l in lines):
                stats.errors[f"stream:{resp.status_code}:{lines[-1][:40] if lines else ''}"] += 1
                return
            if mismatch(body, stream_text(lines), expected):
                stats.errors["stream:mixed-or-lost"] += 1
                return
        elif kind == "classify":
            body = {"model": MODEL, "input": [f"I love {rng.choice(TOPICS)}!"],
                    "labels": ["positive", "negative"]}
            resp = await client.post("/v1/classifications", json=body)
            if resp.status_code != 200 or resp.json()["data"][0]["label"] not in body["labels"]:
                stats.errors[f"classify:{resp.status_code}"] += 1
                return
        elif kind == "big-classification":
            try:  # abandoned after 1 to 3 s: the engine must stop, not work on for minutes
                resp = await client.post("/v1/classifications", json=BIG_CLASSIFICATION,
                                         timeout=rng.uniform(1.0, 3.0))
                if resp.status_code >= 500:
                    stats.errors[f"big-classification:{resp.status_code}"] += 1
                    return
            except httpx.TimeoutException:
                pass
        elif kind == "slow-headers":
            error = await slow_headers(str(client.base_url), rng)
            if error:
                stats.errors[error] += 1
                return
        elif kind == "cancelled":
            if rng.random() < 0.5:  # leave mid-stream after the first chunks
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat_body(rng, 256, True)) as resp:
                    if resp.status_code >= 500:
                        stats.errors[f"cancelled:{resp.status_code}"] += 1
                        return
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


async def client_loop(url: str, seed: int, until: float, stats: Stats, max_tokens: int,
                      expected: dict[str, str]):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < until:
            await one_request(client, rng, stats, max_tokens, expected)


async def expected_answers(url: str, max_tokens: int) -> dict[str, str]:
    """Each topic's greedy answer, asked alone."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for topic in TOPICS:
            body = chat_body(random.Random(0), max_tokens, False, topic, 0)
            resp = await client.post("/v1/chat/completions", json=body)
            out[topic] = resp.json()["choices"][0]["message"]["content"]
    return out


async def sample_server(url: str, process: psutil.Process) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    depth = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("duet_engine_queue_depth{"))
    return {"rss": process.memory_info().rss, "queue_depth": depth}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                             "--shutdown-timeout", str(SHUTDOWN_GRACE_S)],
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
    expected = await expected_answers(url, max_tokens)
    warm = Stats()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        rng = random.Random(0)
        for kind in KINDS:  # every kind, so lazy allocations happen before the baseline
            if kind != "slow-headers":
                await one_request(client, rng, warm, max_tokens, expected, kind)
    await asyncio.sleep(2)  # let the abandoned classification reach its next piece
    rss_start = process.memory_info().rss
    stats = Stats()
    samples = [{"t": 0.0, **await sample_server(url, process)}]
    started = time.monotonic()
    until = started + minutes * 60

    async def sample_memory():
        while time.monotonic() < until:
            await asyncio.sleep(10)
            samples.append({"t": round(time.monotonic() - started, 1),
                            **await sample_server(url, process)})

    await asyncio.gather(sample_memory(), *(client_loop(url, seed, until, stats, max_tokens,
                                                        expected)
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
        "samples": samples,
        "max_queue_depth": max(x["queue_depth"] for x in samples),
        "health_after": health,
    }


async def shutdown_under_load(url: str, proc: subprocess.Popen, log_path: Path,
                              requests: int, max_tokens: int) -> dict:
    """SIGTERM while `requests` long generations are open (a stream running, the rest waiting).
    Each must end cleanly: complete, a stream's error event then [DONE], or a JSON 503."""
    outcomes: Counter = Counter()
    rng = random.Random(99)

    async def one(i: int, client: httpx.AsyncClient):
        body = chat_body(rng, max_tokens, stream=i % 2 == 0)
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = [line async for line in resp.aiter_lines() if line]
        except httpx.HTTPError as exc:
            outcomes[f"lost:{type(exc).__name__}"] += 1
            return
        if resp.status_code == 503 and '"server_shutting_down"' in lines[0]:
            outcomes["503 before starting"] += 1
        elif resp.status_code == 200 and body["stream"] and lines[-1] == "data: [DONE]":
            ended = "server_shutting_down" in lines[-2]
            outcomes["stream ended: error event + [DONE]" if ended else "stream complete"] += 1
        elif resp.status_code == 200 and not body["stream"]:
            outcomes["plain complete"] += 1
        else:
            outcomes[f"bad:{resp.status_code}:{(lines or [''])[-1][:40]}"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(one(0, client))]  # a stream, first: it will be running
        await asyncio.sleep(1)
        tasks += [asyncio.create_task(one(i, client)) for i in range(1, requests)]
        await asyncio.sleep(2)
        sent = time.monotonic()
        proc.terminate()
        await asyncio.gather(*tasks)
    proc.wait(SHUTDOWN_GRACE_S + 30)
    log = log_path.read_text()
    return {"requests": requests, "grace_s": SHUTDOWN_GRACE_S, "outcomes": dict(outcomes),
            "exit_s": round(time.monotonic() - sent, 2), "exit_code": proc.returncode,
            "tracebacks_in_log": log.count("Traceback")}


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
        f"| largest queue depth sampled | {r['max_queue_depth']:.0f} |",
        f"| /health afterwards | {r['health_after']} |",
        "", "| kind | n | p50 latency (s) | p99 latency (s) |", "|---|---|---|---|",
    ]
    for kind, v in sorted(r["latency_s"].items()):
        lines.append(f"| {kind} | {v['n']} | {v['p50']} | {v['p99']} |")
    shut = r.get("shutdown")
    if shut:
        lines += ["", (f"Shutdown under load: SIGTERM with {shut['requests']} requests open and a "
                       f"{shut['grace_s']:g} s grace period; the server exited after "
                       f"{shut['exit_s']} s (code {shut['exit_code']}), with "
                       f"{shut['tracebacks_in_log']} tracebacks in its log."), "",
                  "| outcome | requests |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(shut["outcomes"].items())]
    lines += ["", "![RSS and queue depth over the soak](soak.png)", "",
              ("Kinds: `plain` and `stream` are ordinary chat requests (latency includes the "
               "wait behind other clients on the one engine); a greedy one must give exactly "
               "the text its prompt gets alone, else it counts as lost or mixed; `cancelled` "
               "leaves a stream after its first chunks or gives up on a plain request after 0.2 "
               "to 1 s; `malformed` sends bad JSON, a bad field, an unknown model, `n=2`, `tools` "
               "or a body over 1 MiB and must get the right status in the OpenAI error shape; "
               "`classify` is a small classification; `big-classification` sends 64 inputs x 16 "
               "long labels (minutes of work) and leaves after 1 to 3 s; `slow-headers` sends "
               "its headers a byte every 0.5 s and must see the connection closed with a 408. "
               "Any 5xx is an error. Raw figures: `docs/soak.json`."), ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x["t"] / 60 for x in r["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    rss = [x["rss"] / 2**20 for x in r["samples"]]
    ax1.plot(t, rss, color="tab:blue")
    ax1.set_ylabel("server RSS (MiB)")
    ax1.set_ylim(0, max(rss) * 1.2)
    ax2.step(t, [x["queue_depth"] for x in r["samples"]], where="post", color="tab:orange")
    ax2.set_ylabel("queue depth")
    ax2.set_xlabel("minutes")
    fig.suptitle(f"duet soak: {r['clients']} clients, {r['minutes']} min, {r['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
        if proc is not None:
            # Long generations, so that the grace period ends with one still streaming.
            result["shutdown"] = asyncio.run(shutdown_under_load(
                url, proc, log_path, args.clients, 512))
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "soak.md").write_text(report_md(result))
    plot(result, out / "soak.png")
    print(report_md(result))
    shut = result.get("shutdown", {})
    clean_shutdown = not shut or (shut["tracebacks_in_log"] == 0 and not any(
        k.startswith(("bad", "lost")) for k in shut["outcomes"]))
    ok = (not result["errors"] and result["rss_growth_pct"] < 5 and result["health_after"] == 200
          and clean_shutdown)
    print("PASS" if ok else "FAIL: errors or memory growth, see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
