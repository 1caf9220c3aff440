#!/usr/bin/env python3
"""Soak test: N concurrent clients for M minutes against a live duet, mixing streaming, plain,
cancelled and malformed requests, the OpenAI features apps use (structured output, forced tool
calls, logprobs, n, echoed prompt scores, penalties and bias, the Responses API, embeddings) and
the attacks that once hurt it: big classifications abandoned by their client, headers sent a
byte at a time, streams left mid-way. Greedy answers are checked against the ones each prompt
gets alone (a lost or mixed response is an error), structured output and tool arguments against
their schemas, and every 5xx is an error. RSS and queue depth are sampled over time and plotted. When the script started
the server itself, it ends with a shutdown under load: SIGTERM while requests are open, each of
which must end cleanly (complete, an error event and [DONE], or a JSON 503) with no traceback in
the server's log. Writes docs/soak.md, docs/soak.json and docs/soak.png.

  python scripts/soak.py                       # starts `duet serve` on the default model
  python scripts/soak.py --clients 16 --minutes 10 --url http://127.0.0.1:8000 --pid 1234

The server it starts serves the default model in float32 (float_registry: greedy answers are
compared exactly); one given with --url should too, or its greedy answers will differ by
rounding, not by being lost or mixed.
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
import statistics
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
EMBED_MODEL = "all-minilm-l6-v2"
TOPICS = ["rain", "cats", "bread", "music", "winter", "the sea", "trees", "chess", "coffee", "bees"]
KINDS = {"stream": 20, "plain": 20, "cancelled": 10, "malformed": 10, "classify": 4,
         "big-classification": 4, "slow-headers": 2, "grammar": 6, "tools": 5, "logprobs": 4,
         "n": 3, "echo-score": 3, "penalties": 3, "responses": 3, "embed": 3}
# Structured output that can close within GRAMMAR_TOKENS: nested in an array, an enum, bounds.
PLACE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "score": {"type": "integer", "minimum": 0, "maximum": 10},
    "tags": {"type": "array", "items": {"enum": ["warm", "cold", "old", "new"]}, "maxItems": 2}},
    "required": ["name", "score", "tags"], "additionalProperties": False}
GRAMMAR_TOKENS = 64
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
SHUTDOWN_GRACE_S = 2.0
# A classification of 64 inputs x 16 long labels: minutes of work that its client abandons.
BIG_CLASSIFICATION = {
    "model": MODEL, "input": [f"Review {i}: the {TOPICS[i % 10]} was fine, I suppose." for i in range(64)],
    "labels": [f"category {i}: " + "a rather long description of the category " * 1 for i in range(16)],
}
# Each malformed request and the status it must get.
MALFORMED = [
    ("bad-json", 400), ("bad-temperature", 400), ("unknown-model", 404), ("n=0", 400),
    ("too-large", 413), ("tool-without-function", 400), ("schema-that-cannot-be-followed", 400),
    ("max_tokens-as-text", 400),
]


def chat_body(rng: random.Random, max_tokens: int, stream: bool, topic: str | None = None,
              temperature: float | None = None) -> dict:
    topic = topic or rng.choice(TOPICS)
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": max_tokens,
            "temperature": rng.choice([0, 0.7]) if temperature is None else temperature,
            "stream": stream}


def mismatch(body: dict, text: str, expected: dict[str, str], kind: str = "") -> bool:
    """A greedy answer that differs from the one its prompt gets alone: lost or mixed. kind:
    which request of the topic's ("" plain chat, "grammar", "tools")."""
    if body["temperature"] != 0:
        return False
    topic = body["messages"][0]["content"].split("about ", 1)[1][:-1]
    key = f"{kind}:{topic}" if kind else topic
    return key in expected and text != expected[key]


def grammar_body(rng: random.Random, stream: bool, topic: str | None = None,
                 temperature: float | None = None) -> dict:
    body = chat_body(rng, GRAMMAR_TOKENS, stream, topic, temperature)
    about = body["messages"][0]["content"][len("Tell me about "):]
    body["messages"][0]["content"] = f"Describe a place, as JSON, about {about}"
    body["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "place", "strict": True, "schema": PLACE}}
    return body


def tools_body(rng: random.Random, topic: str | None = None,
               temperature: float | None = None) -> dict:
    body = chat_body(rng, 48, False, topic, temperature)
    about = body["messages"][0]["content"][len("Tell me about "):]
    body["messages"][0]["content"] = f"Which city is best to ask about {about}"
    body["tools"], body["tool_choice"] = [WEATHER_TOOL], "required"
    return body


def valid(instance, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def tool_arguments(message: dict) -> str | None:
    """The forced call's arguments, when they parse and fit the tool's schema."""
    calls = message.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "get_weather":
        return None
    try:
        args = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        return None
    return calls[0]["function"]["arguments"] if valid(
        args, WEATHER_TOOL["function"]["parameters"]) else None


async def streamed(client: httpx.AsyncClient, path: str, body: dict
                   ) -> tuple[httpx.Response, list[str]]:
    """A streamed answer and its non-empty lines."""
    async with client.stream("POST", path, json=body) as resp:
        return resp, [line async for line in resp.aiter_lines() if line]


def chunk_choices(lines: list[str]) -> list[dict]:
    """Each streamed chat chunk's choice (the usage chunk, which has none, left out)."""
    return [json.loads(line[6:])["choices"][0] for line in lines
            if line.startswith('data: {"id') and '"choices":[{' in line]


def stream_text(lines: list[str]) -> str:
    return "".join(c["delta"].get("content") or "" for c in chunk_choices(lines))


def stream_finish(lines: list[str]) -> str | None:
    return next((c["finish_reason"] for c in reversed(chunk_choices(lines))
                 if c.get("finish_reason")), None)


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
        self.examples: dict[str, list] = defaultdict(list)  # a few of each error, to look at

    def fail(self, error: str, detail=None) -> None:
        self.errors[error] += 1
        if detail is not None and len(self.examples[error]) < 3:
            self.examples[error].append(detail)

    def ok(self, kind: str, seconds: float) -> None:
        self.served[kind] += 1
        self.latency[kind].append(seconds)


async def post_ok(client: httpx.AsyncClient, stats: Stats, kind: str, path: str,
                  body: dict) -> dict | None:
    """The answer's JSON; None once a status other than 200 is counted as kind's error."""
    resp = await client.post(path, json=body)
    if resp.status_code != 200:
        stats.fail(f"{kind}:{resp.status_code}")
        return None
    return resp.json()


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Stats, max_tokens: int,
                      expected: dict[str, str], kind: str | None = None):
    kind = kind or rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    start = time.perf_counter()
    try:
        if kind == "plain":
            body = chat_body(rng, max_tokens, False)
            resp = await client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200 or not resp.json()["choices"][0]["message"]["content"]:
                stats.fail(f"plain:{resp.status_code}")
                return
            text = resp.json()["choices"][0]["message"]["content"]
            if mismatch(body, text, expected):
                stats.fail("plain:mixed-or-lost", {"body": body, "text": text})
                return
        elif kind == "stream":
            body = chat_body(rng, max_tokens, True)
            resp, lines = await streamed(client, "/v1/chat/completions", body)
            if resp.status_code != 200 or lines[-1] != "data: [DONE]" or any('"error"' in l for l in lines):
                stats.fail(f"stream:{resp.status_code}:{lines[-1][:40] if lines else ''}")
                return
            if mismatch(body, stream_text(lines), expected):
                stats.fail("stream:mixed-or-lost", {"body": body, "text": stream_text(lines)})
                return
        elif kind == "grammar":
            stream = rng.random() < 0.5
            body = grammar_body(rng, stream)
            if stream:
                resp, lines = await streamed(client, "/v1/chat/completions", body)
                if resp.status_code != 200 or lines[-1] != "data: [DONE]":
                    stats.fail(f"grammar:{resp.status_code}")
                    return
                text, finish = stream_text(lines), stream_finish(lines)
            else:
                out = await post_ok(client, stats, "grammar", "/v1/chat/completions", body)
                if out is None:
                    return
                choice = out["choices"][0]
                text, finish = choice["message"]["content"], choice["finish_reason"]
            if finish == "stop":  # cut by max_tokens, it cannot be whole
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError:
                    parsed = None
                if parsed is None or not valid(parsed, PLACE):
                    stats.fail("grammar:invalid-json", {"body": body, "text": text})
                    return
            if mismatch(body, text, expected, "grammar"):
                stats.fail("grammar:mixed-or-lost", {"body": body, "text": text})
                return
        elif kind == "tools":
            body = tools_body(rng)
            out = await post_ok(client, stats, "tools", "/v1/chat/completions", body)
            if out is None:
                return
            choice = out["choices"][0]
            if choice["finish_reason"] == "tool_calls":
                args = tool_arguments(choice["message"])
                if args is None:
                    stats.fail("tools:invalid-call", {"body": body, "message": choice["message"]})
                    return
                if mismatch(body, args, expected, "tools"):
                    stats.fail("tools:mixed-or-lost", {"body": body, "arguments": args})
                    return
            elif choice["finish_reason"] != "length":
                stats.fail(f"tools:finish-{choice['finish_reason']}",
                           {"body": body, "message": choice["message"]})
                return
        elif kind == "logprobs":
            body = {**chat_body(rng, max_tokens, False, temperature=0), "logprobs": True,
                    "top_logprobs": 3}
            out = await post_ok(client, stats, "logprobs", "/v1/chat/completions", body)
            if out is None:
                return
            entries = out["choices"][0]["logprobs"]["content"]
            # Greedy: each token is its own likeliest alternative.
            if len(entries) != out["usage"]["completion_tokens"] or any(
                    len(e["top_logprobs"]) != 3 or e["logprob"] < e["top_logprobs"][0]["logprob"]
                    - 1e-4 for e in entries):
                stats.fail("logprobs:wrong", {"body": body, "out": out})
                return
            if mismatch(body, out["choices"][0]["message"]["content"], expected):
                stats.fail("logprobs:mixed-or-lost",
                           {"body": body, "text": out["choices"][0]["message"]["content"]})
                return
        elif kind == "n":
            body = {**chat_body(rng, max_tokens, rng.random() < 0.5, temperature=0.8), "n": 2,
                    "seed": rng.randrange(1000)}
            if body["stream"]:
                resp, lines = await streamed(client, "/v1/chat/completions", body)
                indexes = {c["index"] for c in chunk_choices(lines)}
            else:
                resp = await client.post("/v1/chat/completions", json=body)
                indexes = {c["index"] for c in resp.json().get("choices", [])} \
                    if resp.status_code == 200 else set()
            if resp.status_code != 200 or indexes != {0, 1}:
                stats.fail(f"n:{resp.status_code}:{sorted(indexes)}")
                return
        elif kind == "echo-score":
            topic = rng.choice(TOPICS)
            body = {"model": MODEL, "prompt": f"The best thing about {topic} is",
                    "max_tokens": 0, "echo": True, "logprobs": 1}
            out = await post_ok(client, stats, "echo-score", "/v1/completions", body)
            if out is None:
                return
            scores = out["choices"][0]["logprobs"]["token_logprobs"]
            if (len(scores) != out["usage"]["prompt_tokens"] or scores[0] is not None
                    or any(x is None or x > 0 for x in scores[1:])
                    or out["choices"][0]["text"] != body["prompt"]):
                stats.fail("echo-score:wrong")
                return
        elif kind == "penalties":
            body = {**chat_body(rng, max_tokens, False), "presence_penalty": 0.5,
                    "frequency_penalty": 0.5, "logit_bias": {"28": -100, "29": 2}}
            if await post_ok(client, stats, "penalties", "/v1/chat/completions", body) is None:
                return
        elif kind == "responses":
            body = {"model": MODEL, "input": f"Tell me about {rng.choice(TOPICS)}.",
                    "max_output_tokens": max_tokens, "temperature": 0, "stream": True}
            resp, lines = await streamed(client, "/v1/responses", body)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            if resp.status_code != 200 or not events or events[-1]["type"] not in (
                    "response.completed", "response.incomplete"):
                stats.fail(f"responses:{resp.status_code}")
                return
            text = events[-1]["response"]["output"][0]["content"][0]["text"]
            topic = body["input"][len("Tell me about "):-1]
            if text != expected.get(topic, text):
                stats.fail("responses:mixed-or-lost", {"body": body, "text": text})
                return
        elif kind == "embed":
            texts = [f"I love {rng.choice(TOPICS)}", f"{rng.choice(TOPICS)} in the morning"]
            resp = await client.post("/v1/embeddings", json={"model": EMBED_MODEL,
                                                               "input": texts})
            data = resp.json().get("data", []) if resp.status_code == 200 else []
            if len(data) != 2 or any(
                    len(d["embedding"]) != 384
                    or abs(sum(x * x for x in d["embedding"]) - 1) > 1e-3 for d in data):
                stats.fail(f"embed:{resp.status_code}")
                return
        elif kind == "classify":
            body = {"model": MODEL, "input": [f"I love {rng.choice(TOPICS)}!"],
                    "labels": ["positive", "negative"]}
            resp = await client.post("/v1/classifications", json=body)
            if resp.status_code != 200 or resp.json()["data"][0]["label"] not in body["labels"]:
                stats.fail(f"classify:{resp.status_code}")
                return
        elif kind == "big-classification":
            try:  # abandoned after 1 to 3 s: the engine must stop, not work on for minutes
                resp = await client.post("/v1/classifications", json=BIG_CLASSIFICATION,
                                         timeout=rng.uniform(1.0, 3.0))
                if resp.status_code >= 500:
                    stats.fail(f"big-classification:{resp.status_code}")
                    return
            except httpx.TimeoutException:
                pass
        elif kind == "slow-headers":
            error = await slow_headers(str(client.base_url), rng)
            if error:
                stats.fail(error)
                return
        elif kind == "cancelled":
            if rng.random() < 0.5:  # leave mid-stream after the first chunks
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat_body(rng, 256, True)) as resp:
                    if resp.status_code >= 500:
                        stats.fail(f"cancelled:{resp.status_code}")
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
            elif name == "n=0":
                body["n"] = 0
            elif name == "too-large":
                body["messages"][0]["content"] = "x" * (1024 * 1024 + 1)
            elif name == "tool-without-function":
                body["tools"] = [{"type": "function"}]
            elif name == "schema-that-cannot-be-followed":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}}
            elif name == "max_tokens-as-text":
                body["max_tokens"] = str(max_tokens)
            kw = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            resp = await client.post("/v1/chat/completions", **kw)
            err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith(
                "application/json") else {}
            if resp.status_code != expected or set(err) != {"message", "type", "param", "code"}:
                stats.fail(f"malformed-{name}:{resp.status_code}")
                return
    except Exception as exc:  # a client-side failure is an error of its own kind
        stats.fail(f"{kind}:{type(exc).__name__}")
        return
    stats.ok(kind, time.perf_counter() - start)


async def client_loop(url: str, seed: int, until: float, stats: Stats, max_tokens: int,
                      expected: dict[str, str]):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < until:
            await one_request(client, rng, stats, max_tokens, expected)


async def expected_answers(url: str, max_tokens: int) -> dict[str, str]:
    """Each topic's greedy answers, asked alone: plain chat, structured output (by topic
    "grammar:TOPIC") and the forced tool call's arguments ("tools:TOPIC")."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for topic in TOPICS:
            body = chat_body(random.Random(0), max_tokens, False, topic, 0)
            resp = await client.post("/v1/chat/completions", json=body)
            out[topic] = resp.json()["choices"][0]["message"]["content"]
            body = grammar_body(random.Random(0), False, topic, 0)
            resp = await client.post("/v1/chat/completions", json=body)
            out[f"grammar:{topic}"] = resp.json()["choices"][0]["message"]["content"]
            resp = await client.post("/v1/chat/completions",
                                     json=tools_body(random.Random(0), topic, 0))
            args = tool_arguments(resp.json()["choices"][0]["message"])
            if args is not None:
                out[f"tools:{topic}"] = args
    return out


async def sample_server(url: str, process: psutil.Process) -> dict:
    """The server's RSS, queue depth and the KV pool's bytes in use or kept by the prefix
    cache. The pool is allocated untouched (torch.empty) and the prefix cache fills what is
    free, so the pages it has written join the RSS over a run: that is the budget's reserved
    memory being used, not a leak, and it is taken off the growth that the soak judges."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        text = (await client.get("/metrics")).text
        engines = (await client.get("/health")).json().get("engines", [])
    depth = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("duet_engine_queue_depth{"))
    # Held blocks that are also cached count twice: an upper bound on the pages written.
    kv = sum((e.get("kv_cache_used_tokens", 0) + e.get("prefix_cache_tokens", 0))
             * e["kv_cache_bytes"] // max(1, e["kv_cache_tokens"])
             for e in engines if e.get("kv_cache_tokens"))
    return {"rss": process.memory_info().rss, "queue_depth": depth, "kv_bytes": kv}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def float_registry(path: Path) -> Path:
    """The repository's registry with the default model served in float32 from its float
    weights. Served by default (bfloat16 activations, int4 weights) a greedy answer depends on
    what else shares its batch and on how its prompt was prefilled (a cached prefix), by one
    rounding step that may flip a near-tie; in float32 it must not, so a different answer is
    a lost or mixed one (tests/e2e/conftest.py's float_models_file does the same)."""
    text = (ROOT / "models.toml").read_text()
    start = text.index(f'id = "{MODEL}"\n')
    table, rest = text[start:].split("\n\n", 1)
    table = table.replace('dtype = "auto"', 'dtype = "float32"') + '\nquantize = "none"'
    path.write_text(text[:start] + table + "\n\n" + rest)
    return path


def start_server(log_path: Path, engine: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")
    registry = float_registry(log_path.with_suffix(".models.toml"))
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                             "--config", str(registry), "--engine", engine,
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


def memory_growth(samples: list[dict]) -> dict:
    """The RSS growth a leak would show: each sample's RSS less the KV pool's pages written
    since the start (their high-water mark so far), the median of the run's last fifth against
    its first fifth's (one sample moves by tens of MiB with the work in flight)."""
    fifth = max(1, len(samples) // 5)
    high, net = samples[0]["kv_bytes"], []
    for x in samples:
        high = max(high, x["kv_bytes"])
        net.append(x["rss"] - (high - samples[0]["kv_bytes"]))
    early, late = statistics.median(net[:fifth]), statistics.median(net[-fifth:])
    return {"kv_pool_touched_bytes": high - samples[0]["kv_bytes"],
            "rss_growth_beyond_kv_pct": round(100 * (late - early) / early, 2)}


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
        answer = await client.get("/health")
    health = answer.status_code
    engine = next((e["engine"] for e in answer.json().get("engines", [])
                   if e["model"] == MODEL), "unknown")
    served_all = [x for kind in ("plain", "stream") for x in stats.latency[kind]]
    return {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores "
                   f"(shared with other work; latencies are noisy)",
        "model": MODEL, "engine": engine, "clients": clients, "minutes": minutes,
        "max_tokens": max_tokens,
        "elapsed_s": round(elapsed, 1),
        "requests": sum(stats.served.values()) + sum(stats.errors.values()),
        "served": dict(stats.served),
        "errors": dict(stats.errors),
        "error_examples": dict(stats.examples),
        "expected": expected,
        "latency_s": {
            kind: {"p50": round(percentile(v, 0.5), 3), "p99": round(percentile(v, 0.99), 3),
                   "n": len(v)}
            for kind, v in [*stats.latency.items(), ("plain+stream", served_all)] if v
        },
        "throughput_rps": round(sum(stats.served.values()) / elapsed, 2),
        "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
        "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
        **memory_growth(samples),
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
            resp, lines = await streamed(client, "/v1/chat/completions", body)
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
        (f"`scripts/soak.py`, {r['date']}, {r['machine']}; model {r['model']} on the "
         f"{r.get('engine', 'torch')} engine (float32; and {EMBED_MODEL} for embeddings), {r['clients']} concurrent clients for {r['minutes']} min, "
         f"max_tokens {r['max_tokens']}."),
        "", "| | |", "|---|---|",
        f"| requests | {r['requests']} ({r['throughput_rps']} answered per second) |",
        f"| served by kind | {', '.join(f'{k} {v}' for k, v in sorted(r['served'].items()))} |",
        f"| errors by kind | {', '.join(f'{k} {v}' for k, v in sorted(r['errors'].items())) or 'none'} |",
        f"| server RSS after warm-up | {mib(r['rss_start_bytes'])} |",
        f"| server RSS at the end | {mib(r['rss_end_bytes'])} ({r['rss_growth_pct']:+.2f}%) |",
        f"| KV pool written since (in use or prefix-cached, at most) | "
        f"{mib(r['kv_pool_touched_bytes'])} |",
        f"| RSS growth beyond the KV pool's (medians of the last fifth against the first) | "
        f"{r['rss_growth_beyond_kv_pct']:+.2f}% |",
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
               "to 1 s; `malformed` sends bad JSON, a bad field, an unknown model, `n=0`, a tool "
               "without its function, a schema that cannot be followed, `max_tokens` as text or "
               "a body over 1 MiB and must get the right status in the OpenAI error shape; "
               "`grammar` asks for a `json_schema` (an object with a bounded string, a bounded "
               "integer and an array of enums; plain or streamed), whose output must parse and "
               "validate when it ends with `stop`, and a greedy one equal what it gets alone; "
               "`tools` forces a call of a function, whose arguments must fit its schema (and "
               "equal, greedy, what they are alone); `logprobs` asks for 3 alternatives a token "
               "(one entry per token, the greedy token the likeliest) and the plain answer; "
               "`n` asks for two seeded choices (both indexes must come); `echo-score` scores a "
               "prompt with `echo` and `max_tokens` 0 (one score a token, the first null); "
               "`penalties` adds presence and frequency penalties and a `logit_bias`; "
               "`responses` streams `/v1/responses` (greedy: the plain chat answer); `embed` "
               "embeds two texts with the embedding model (384 numbers of norm 1 each); "
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
    ax1.plot(t, rss, color="tab:blue", label="server RSS")
    ax1.plot(t, [x.get("kv_bytes", 0) / 2**20 for x in r["samples"]], color="tab:green",
             label="KV pool in use or prefix-cached")
    ax1.legend(loc="lower right")
    ax1.set_ylabel("MiB")
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
    parser.add_argument("--engine", choices=["auto", "torch", "mlx"], default="auto",
                        help="the engine of the server it starts, for the default model")
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
        proc, url = start_server(log_path, args.engine)
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
    ok = (not result["errors"] and result["rss_growth_beyond_kv_pct"] < 5
          and result["health_after"] == 200
          and clean_shutdown)
    print("PASS" if ok else "FAIL: errors or memory growth, see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
