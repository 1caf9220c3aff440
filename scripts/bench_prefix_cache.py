#!/usr/bin/env python3
"""A chat's second turn with and without the prefix cache: time to first token (TTFT).

Starts `duet serve` on --model with the prefix cache on (or uses --url). Each repeat has a
system prompt of its own (about --system-tokens tokens of text, so nothing is cached before
it): turn 1 asks a question; turn 2 sends turn 1's messages, its answer and a new question.
"Warm" is turn 2 as sent, whose prompt starts with all of turn 1; "cold" is the same turn 2
with one word changed at the start of its system prompt, so no block of it is cached: the same
length, prefilled whole. Both come from the server's own `metrics.ttft_ms` (arrival to first
token) with `usage.prompt_tokens_details.cached_tokens`. The table gives medians over
--repeats; JSON under docs/bench/.

  python scripts/bench_prefix_cache.py --model smollm2-135m-instruct --engine torch
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import start_server  # noqa: E402

WORDS = ("river", "market", "engine", "garden", "signal", "harbor", "ledger", "canyon", "violet",
         "meadow", "copper", "lantern", "orbit", "thistle", "quarry", "saddle", "beacon", "walnut")


def system_prompt(seed: int, tokens: int) -> str:
    """Words in an order of this seed's: about one token a word for these common words."""
    rng = random.Random(seed)
    return "You answer briefly. Notes: " + " ".join(rng.choice(WORDS) for _ in range(tokens))


def ask(url: str, model: str, engine: str | None, messages: list[dict], max_tokens: int) -> dict:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            **({"engine": engine} if engine else {})}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    resp.raise_for_status()
    return resp.json()


def figures(answer: dict) -> dict:
    usage = answer["usage"]
    return {"ttft_ms": answer["metrics"]["ttft_ms"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def run(url: str, args) -> list[dict]:
    runs = []
    for r in range(args.repeats + 1):  # the first is a warm-up, not reported
        system = system_prompt(1000 + r, args.system_tokens)
        first = [{"role": "system", "content": system},
                 {"role": "user", "content": "Which of the notes comes first?"}]
        one = ask(url, args.model, args.engine, first, args.max_tokens)
        second = [*first, {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And which comes last?"}]
        warm = ask(url, args.model, args.engine, second, args.max_tokens)
        cold_messages = [{"role": "system", "content": "Answer" + system[len("You answer"):]},
                         *second[1:]]
        cold = ask(url, args.model, args.engine, cold_messages, args.max_tokens)
        if r:
            runs.append({"turn1": figures(one), "warm": figures(warm), "cold": figures(cold)})
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", default=None)
    p.add_argument("--url", default=None, help="an already running server")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--device-name", default="", help="for the JSON and the table's title")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--server-log", default="/tmp/duet-prefix-server.log")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    proc, url = (None, args.url) if args.url else start_server(args, prefix_cache=True)
    try:
        runs = run(url, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    def median(kind: str, key: str) -> float:
        return statistics.median(x[kind][key] for x in runs)

    rows = {kind: {key: median(kind, key) for key in ("ttft_ms", "prompt_tokens", "cached_tokens")}
            for kind in ("turn1", "warm", "cold")}
    ratio = rows["cold"]["ttft_ms"] / rows["warm"]["ttft_ms"]
    where = args.device_name or platform.processor() or platform.machine()
    print(f"{args.model} ({args.engine or 'default engine'}) on {where}: medians of "
          f"{args.repeats}")
    print(f"{'request':<28}{'prompt tokens':>15}{'cached':>10}{'TTFT ms':>12}")
    for name, kind in (("turn 1", "turn1"), ("turn 2, prefix cached", "warm"),
                       ("turn 2, cold", "cold")):
        row = rows[kind]
        print(f"{name:<28}{row['prompt_tokens']:>15.0f}{row['cached_tokens']:>10.0f}"
              f"{row['ttft_ms']:>12.1f}")
    print(f"turn 2's TTFT: {ratio:.1f}x shorter with the prefix cache")
    result = {"date": dt.date.today().isoformat(), "device": where, "model": args.model,
              "engine": args.engine, "system_tokens": args.system_tokens,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "medians": rows,
              "cold_over_warm_ttft": round(ratio, 2), "runs": runs}
    out = args.out or ROOT / "docs/bench" / f"prefix-cache-{args.model}-{args.engine or 'default'}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
