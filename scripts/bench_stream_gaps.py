#!/usr/bin/env python3
"""How long running streams stall while prompt-scoring work arrives: a zero-shot classification
and an echoed prompt's log-probabilities (lm-eval's loglikelihood request).

Starts `duet serve` on --model (or uses --url), opens --streams streaming completions (greedy,
end-of-sequence ignored, long enough to outlast the run) and, once all stream, sends one
classification of --inputs texts x --labels labels and one /v1/completions with echo, logprobs
and max_tokens 0 over a --echo-tokens prompt; each is abandoned after --abandon-s (a client
timeout, as an impatient caller does) or finishes first. Per stream it records the time of every
chunk; the table gives the median gap between two chunks before the scoring work arrived, and
the longest gap while it ran (from its send until it ended, plus a second). Writes JSON under
docs/bench/.

  python scripts/bench_stream_gaps.py --model smollm2-135m-instruct --engine torch
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import prompts_for, start_server  # noqa: E402

WORDS = ("calm", "storm", "river", "price", "vote", "match", "recipe", "engine", "poem", "tax",
         "goal", "virus", "court", "stock", "album", "orbit")


def classification_body(model: str, engine: str | None, inputs: int, labels: int) -> dict:
    texts = [f"Report {i}: the {WORDS[i % len(WORDS)]} and the {WORDS[(i * 7) % len(WORDS)]} "
             f"were in the news again today." for i in range(inputs)]
    return {"model": model, "input": texts, "labels": list(WORDS[:labels]),
            **({"engine": engine} if engine else {})}


def echo_body(model: str, engine: str | None, tokens: int) -> dict:
    return {"model": model, "prompt": prompts_for(1, tokens, seed=7)[0], "max_tokens": 0,
            "echo": True, "logprobs": 1, **({"engine": engine} if engine else {})}


def run(url: str, args) -> dict:
    import httpx

    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    streaming = threading.Semaphore(0)
    done = threading.Event()
    failed: list[str] = []

    def stream(i: int, prompt: list[int]) -> None:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.stream_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                **({"engine": args.engine} if args.engine else {})}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as resp:
                if resp.status_code != 200:
                    resp.read()
                    failed.append(f"stream {i}: {resp.status_code} {resp.text}")
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        if not stamps[i]:
                            streaming.release()
                        stamps[i].append(time.perf_counter())
                    if done.is_set():
                        return
        finally:
            if not stamps[i]:
                streaming.release()

    prompts = prompts_for(args.streams, 32, seed=3)
    threads = [threading.Thread(target=stream, args=(i, p), daemon=True)
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for _ in threads:
        streaming.acquire()
    if failed:
        raise SystemExit("\n".join(failed))
    time.sleep(args.settle_s + args.abandon_s + 1)  # a window as long as each work's before it
    works = {}
    for name, path, body in (
        ("classification", "/v1/classifications",
         classification_body(args.model, args.engine, args.inputs, args.labels)),
        ("echo", "/v1/completions", echo_body(args.model, args.engine, args.echo_tokens)),
    ):
        if name not in args.work:
            continue
        sent = time.perf_counter()
        try:
            status = httpx.post(url + path, json=body, timeout=args.abandon_s).status_code
        except httpx.TimeoutException:
            status = "abandoned"
        ended = time.perf_counter()
        time.sleep(1.0)  # a stop is heard at the engine's next piece of work
        until = time.perf_counter()
        before = [b - a for s in stamps for a, b in itertools.pairwise(s) if b < sent]
        longest, at = max(_longest_gap(s, sent, until) for s in stamps)
        # The same for as long a window just before: what the streams see with no such work.
        quiet, _ = max(_longest_gap(s, sent - (until - sent), sent) for s in stamps)
        works[name] = {"status": status, "seconds": round(ended - sent, 2),
                       "median_gap_before_ms": round(statistics.median(before) * 1000, 1),
                       "longest_gap_before_ms": round(quiet * 1000, 1),
                       "longest_gap_ms": round(longest * 1000, 1),
                       "longest_gap_from_s": round(at - sent, 2)}
        time.sleep(args.settle_s + args.abandon_s + 1)
    done.set()
    return works


def _longest_gap(times: list[float], start: float, end: float) -> tuple[float, float]:
    """The longest time without a chunk within [start, end], and when it began."""
    inside = [start, *(t for t in times if start < t < end), end]
    return max((b - a, a) for a, b in itertools.pairwise(inside))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", default=None)
    p.add_argument("--url", default=None, help="an already running server")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=1500)
    p.add_argument("--inputs", type=int, default=128)
    p.add_argument("--labels", type=int, default=16)
    p.add_argument("--echo-tokens", type=int, default=1024)
    p.add_argument("--work", default="classification,echo")
    p.add_argument("--abandon-s", type=float, default=4.0)
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--server-log", default="/tmp/duet-gaps-server.log")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        works = run(url, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"{args.streams} streams on {args.model} ({args.engine or 'default engine'})")
    print(f"{'':<34}{'gap before it, ms':>22}{'gap while it ran, ms':>22}")
    print(f"{'work':<16}{'status':>10}{'took s':>8}{'median':>11}{'longest':>11}"
          f"{'longest':>11}{'at s':>11}")
    for name, w in works.items():
        print(f"{name:<16}{w['status']!s:>10}{w['seconds']:>8}{w['median_gap_before_ms']:>11}"
              f"{w['longest_gap_before_ms']:>11}{w['longest_gap_ms']:>11}"
              f"{w['longest_gap_from_s']:>11}")
    result = {"date": dt.date.today().isoformat(), "machine": platform.processor() or
              platform.machine(), "model": args.model, "engine": args.engine,
              "streams": args.streams, "inputs": args.inputs, "labels": args.labels,
              "echo_tokens": args.echo_tokens, "abandon_s": args.abandon_s, "works": works}
    out = args.out or ROOT / "docs/bench" / f"stream-gaps-{args.model}-{args.engine or 'default'}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
