#!/usr/bin/env python3
"""What each per-request feature costs decode: N streaming chat clients at once, all asking
for the same feature, against the same N asking for none.

Starts `duet serve` once (or uses --url); for each client count and each repeat, runs every
feature in turn (so a slow spell of the machine hits them all alike): N clients each stream one
chat completion of --max-tokens tokens (greedy, end of sequence ignored) on a distinct prompt
of about --prompt-tokens tokens. Features:

  none       plain greedy decoding: the baseline
  sampling   temperature 0.8, top_p 0.95 and a seed (not a processing step: the draw)
  logprobs   logprobs with top_logprobs 5 on every token
  penalties  presence_penalty and frequency_penalty 0.5
  bias       logit_bias on 16 tokens
  grammar    response_format json_schema: a list of at least 1,000 {"name", "score"}
             objects, so the mask never lets the JSON close within --max-tokens
  grammar-bounded  the same with names of at most 24 characters (maxLength): llguidance's
             slow case, a mask inside such a string costs about 30 times as much

Prints a table of median aggregate tok/s per feature and level, and each one's ratio to plain
decoding at the same level; writes JSON under docs/bench/. For a server it started, each level
also records the CPU its HTTP process and its engine process used, in cores (a process near 1.0
is what a level waits on).

A grammar needs a real vocabulary, which the dummy models' word-level tokenizers lack:
--dummy-shape SHAPE serves random weights of that shape (engines/models/dummy.py) with the default
model's own tokenizer, from a model directory and registry file written under --work-dir (on a
GPU machine without the default model's package, copy that directory over and pass its
models.toml with --serve-args --config).

  python scripts/bench_features.py --model smollm2-135m-instruct --clients 1,4,16
  python scripts/bench_features.py --dummy-shape llama-3.2-1b --clients 1,16,64 \\
      --out docs/bench/features-llama1b-smoltok-h100.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import prompts_for, run_level, start_server, write_result  # noqa: E402

def _never_closes(name: dict) -> dict:
    """A list of at least 1,000 {"name", "score"} objects, name as given."""
    item = {"type": "object", "properties": {"name": name, "score": {"type": "integer"}},
            "required": ["name", "score"], "additionalProperties": False}
    return {"type": "object", "properties": {"items": {"type": "array", "minItems": 1000,
                                                       "items": item}},
            "required": ["items"], "additionalProperties": False}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "scores", "schema": schema}}}


FEATURES: dict[str, dict] = {
    "none": {},
    "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 1},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "bias": {"logit_bias": {str(i): 1.0 for i in range(1000, 1016)}},
    "grammar": _schema(_never_closes({"type": "string"})),
    # A length-bounded string: llguidance checks each token against the bound, so a mask
    # inside the string takes ~170 us on a 2-core EPYC, against ~6 us unbounded.
    "grammar-bounded": _schema(_never_closes({"type": "string", "maxLength": 24})),
}


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def dummy_with_real_tokenizer(shape: str, work_dir: Path) -> tuple[str, Path]:
    """A model directory of `shape`'s random weights and the default model's tokenizer, and a
    registry file serving it on the torch engine: (its model id, the registry file)."""
    import shutil

    from engines.models.config import load_models_file
    from engines.models.dummy import DUMMY_FLAG, SHAPES
    from engines.models.sources import resolve_model_dir

    source = resolve_model_dir(load_models_file(ROOT / "models.toml")[0])
    real = json.loads((source / "config.json").read_text())
    model_id = f"{shape}-default-tokenizer"
    target = work_dir / model_id
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    config = {**SHAPES[shape], "vocab_size": real["vocab_size"], "hidden_act": "silu",
              "bos_token_id": real["bos_token_id"], "eos_token_id": real["eos_token_id"],
              "torch_dtype": "bfloat16", DUMMY_FLAG: True}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    registry = work_dir / "models.toml"
    # Relative to the repository (where the server starts) when inside it, so the directory
    # and its registry can be carried to another machine's checkout.
    where = target.resolve()
    where = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    registry.write_text(f'[[models]]\nid = "{model_id}"\nsource = "path:{where}"\n'
                        'engine = "torch"\ndtype = "auto"\ncontext_length = 2048\n')
    return model_id, registry


class ProcessShares:
    """The CPU the server's processes used over a level: its own (the HTTP side's) and its
    engine process's (the largest child that multiprocessing spawned, where there is one), in
    seconds and in cores. Only for a server whose pid is known (one this script started)."""

    def __init__(self, pid: int | None):
        import psutil

        self._server = psutil.Process(pid) if pid is not None else None

    def _times(self):
        """The server's cpu_times() and its engine process's (None without one)."""
        import psutil

        try:
            kids = [c for c in self._server.children() if "spawn_main" in " ".join(c.cmdline())]
            engine = max(kids, key=lambda c: c.memory_info().rss) if kids else None
            return self._server.cpu_times(), (engine.cpu_times() if engine else None)
        except psutil.Error:  # a child that ended meanwhile
            return self._server.cpu_times(), None

    def measure(self, run) -> dict:
        """run()'s result with, over its run, http_cpu_s (of which http_kernel_s in the
        kernel), engine_cpu_s, and the same per second of wall time: http_cpu_share and
        engine_cpu_share."""
        if self._server is None:
            return run()
        import time

        (http0, engine0), start = self._times(), time.perf_counter()
        result = run()
        (http1, engine1), wall = self._times(), time.perf_counter() - start
        http = http1.user + http1.system - http0.user - http0.system
        engine = (None if engine0 is None or engine1 is None
                  else engine1.user + engine1.system - engine0.user - engine0.system)
        return {**result, "http_cpu_s": http, "http_kernel_s": http1.system - http0.system,
                "engine_cpu_s": engine, "http_cpu_share": http / wall,
                "engine_cpu_share": None if engine is None else engine / wall}


def chat_prompts(url: str, model: str, n: int, tokens: int) -> list[list[dict]]:
    """n distinct user messages of about `tokens` tokens: random ids, detokenized by the
    server, so they are text this model's tokenizer reads back to about as many tokens."""
    import httpx

    out = []
    for ids in prompts_for(n, tokens, seed=n):
        resp = httpx.post(url + "/detokenize", json={"model": model, "tokens": ids}, timeout=60)
        resp.raise_for_status()
        out.append([{"role": "user", "content": resp.json()["prompt"]}])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dummy-shape", default=None,
                   help="random weights of this shape with the default model's tokenizer")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".benchmodel")
    p.add_argument("--engine", default=None)
    p.add_argument("--url", default=None, help="an already running server")
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--features", default=",".join(FEATURES))
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="requests each client sends one after the other in a run (1: one burst)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--server-log", default="/tmp/duet-bench-features-server.log")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--device-name", default="", help="for the JSON and the table's title")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.dummy_shape:
        args.model, registry = dummy_with_real_tokenizer(args.dummy_shape, args.work_dir)
        args.serve_args += ["--config", str(registry)]
    elif args.model is None:
        p.error("--model or --dummy-shape")
    levels = [int(c) for c in args.clients.split(",")]
    features = args.features.split(",")
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise SystemExit(f"unknown features: {sorted(unknown)}")

    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        import httpx

        info = httpx.get(url + "/health").json()
        shares = ProcessShares(proc.pid if proc is not None else None)
        rows = []
        for n in levels:
            prompts = chat_prompts(url, args.model, n, args.prompt_tokens)
            runs: dict[str, list[dict]] = {f: [] for f in features}
            for f in features:  # one unmeasured round each: compile, grammar caches
                run_level(url, args.model, n, args.prompt_tokens, min(16, args.max_tokens),
                          args.engine, args.client_procs, FEATURES[f], prompts)
            for _ in range(args.repeats):
                for f in features:
                    runs[f].append(shares.measure(lambda: run_level(
                        url, args.model, n, args.prompt_tokens, args.max_tokens, args.engine,
                        args.client_procs, FEATURES[f], prompts, args.rounds)))
            for f in features:
                tok_s = sorted(r["aggregate_tok_s"] for r in runs[f])
                rows.append({
                    "clients": n, "feature": f, "aggregate_tok_s": statistics.median(tok_s),
                    "runs": tok_s,
                    "itl_ms_p50": statistics.median(r["itl_ms_p50"] for r in runs[f]),
                    # Each stream's own decode rate: unlike the ITL (gaps between chunks), not
                    # changed by a server that sends several tokens in one chunk under load.
                    "decode_tok_s_p50": statistics.median(
                        r["per_client_decode_tok_s_p50"] or 0 for r in runs[f]),
                    "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in runs[f]),
                    # Where a slow level's time went: the server's own first-token time, the
                    # engine's step at the peak batch, the load generator's CPU share, the
                    # server's processes' (cores).
                    **{key: _median(r.get(key) for r in runs[f])
                       for key in ("server_ttft_ms_p50", "engine_step_ms_at_peak_batch",
                                   "client_cpu_share", "http_cpu_share", "engine_cpu_share")},
                    "peak_batch": max(r["peak_batch"] for r in runs[f]),
                })
                r = rows[-1]
                cores = "".join(f"  {name} {r[key]:.2f} cores" for name, key in
                                (("HTTP", "http_cpu_share"), ("engine", "engine_cpu_share"))
                                if r[key] is not None)
                print(f"{n:4} clients  {f:16} {r['aggregate_tok_s']:9.1f} tok/s  ITL p50 "
                      f"{r['itl_ms_p50']:7.2f} ms  decode {r['decode_tok_s_p50']:7.1f} tok/s a "
                      f"stream  batch {r['peak_batch']}{cores}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    base = {r["clients"]: r["aggregate_tok_s"] for r in rows if r["feature"] == "none"}
    for r in rows:
        r["vs_none"] = round(r["aggregate_tok_s"] / base[r["clients"]], 3) if base else None
    rounds = f" of {args.rounds} requests a client" if args.rounds > 1 else ""
    print(f"\n{args.model} on {args.device_name or 'this machine'}: median aggregate tok/s "
          f"(x plain decoding), {args.repeats} runs{rounds}")
    print("| feature | " + " | ".join(f"{n} client{'s' * (n > 1)}" for n in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for f in features:
        cells = []
        for n in levels:
            r = next(r for r in rows if r["clients"] == n and r["feature"] == f)
            ratio = f" ({r['vs_none']:.2f}x)" if r["vs_none"] is not None else ""
            cells.append(f"{r['aggregate_tok_s']:,.0f}{ratio}")
        print(f"| {f} | " + " | ".join(cells) + " |")
    if args.out:
        result = {"date": dt.date.today().isoformat(), "model": args.model,
                  "engine": args.engine, "device": args.device_name,
                  "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                  "repeats": args.repeats, "rounds": args.rounds,
                  "server": info.get("engines"), "rows": rows,
                  "command": " ".join(sys.argv)}
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
