#!/usr/bin/env python3
"""Where a batched step's time goes, on the torch engine: the runtime driven directly (no HTTP)
with B requests of --prompt-tokens prompts decoding together. Per batch size: the prefill
step of one prompt, then over steady decode steps the wall time per step split into the
executor (host preparation, GPU, read-back) and the runtime's own work (scheduling,
detokenizing, events), and the top GPU kernels from torch.profiler. With --feature, every
request asks for it (bench_features.py's settings), and the step's host work is split further
(the rows' processing, the wait for the last step's tokens, the grammar masks) and profiled
with cProfile. A grammar needs a real vocabulary: --model-dir a directory with the default
model's tokenizer (bench_features.py's dummy_with_real_tokenizer makes one).

  python scripts/profile_step.py --model llama-3.2-1b --batches 1,64
  python scripts/profile_step.py --model-dir .benchmodel/llama1b/... --feature grammar
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Timer:
    def __init__(self):
        self.spent: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, label: str, sync=None):
        fn = getattr(obj, name, None)
        if fn is None:  # another version of the engine (an A/B run)
            return

        def timed(*a, **k):
            started = time.perf_counter()
            out = fn(*a, **k)
            if sync is not None:
                sync()
            self.spent.setdefault(label, []).append(time.perf_counter() - started)
            return out

        setattr(obj, name, timed)

    def median_ms(self, label: str) -> float:
        values = self.spent.get(label, [])
        return round(statistics.median(values) * 1000, 3) if values else float("nan")


def feature_params(feature: str, max_tokens: int):
    """bench_features.py's request fields for `feature` as the engine's SamplingParams."""
    from bench_features import FEATURES

    from engines.base import SamplingParams
    from engines.grammar import json_schema_grammar

    base = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    fields = FEATURES[feature]
    if feature.startswith("grammar"):
        return replace(base, grammar=json_schema_grammar(
            fields["response_format"]["json_schema"]["schema"]))
    if feature == "logprobs":
        return replace(base, logprobs=fields["top_logprobs"])
    if feature == "bias":
        return replace(base, logit_bias=tuple((int(t), b) for t, b in fields["logit_bias"].items()))
    return replace(base, **fields)


def host_profile(step, steps: int) -> str:
    """cProfile of `steps` calls of step(): the host's hot spots."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main() -> int:
    from engines.models.dummy import write_dummy_model
    from engines.torch_engine import TorchEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--cache", default="/tmp/duet-profile")
    parser.add_argument("--trace", default=None,
                        help="write a Chrome trace of B=max's decode steps here (and of its "
                             "prefill beside it, .prefill.json, with --prefill-kernels; with "
                             "--tensor-parallel, each other rank's first steps, .rankN.json)")
    parser.add_argument("--model-dir", default=None, help="this model directory, not --model")
    parser.add_argument("--feature", default="none",
                        help="none or bench_features.py's features, comma-separated")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="split the model over this many GPUs (kernels: rank 0's)")
    parser.add_argument("--prefill-kernels", action="store_true",
                        help="torch.profiler over the prompts' prefill too")
    parser.add_argument("--no-kernels", action="store_true", help="skip torch.profiler")
    parser.add_argument("--quantize", default=None, help="int8, int4 or fp8 weights")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="prompt tokens a step prefills (default: 512 or one prompt)")
    parser.add_argument("--mask-threads", type=int, default=None,
                        help="llguidance's threads for the grammar masks (its default: 80%% "
                             "of the CPUs)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    batches = [int(b) for b in args.batches.split(",")]
    path = (Path(args.model_dir) if args.model_dir
            else write_dummy_model(args.model, Path(args.cache) / args.model))
    if args.trace and args.tensor_parallel > 1:  # the other ranks trace their first steps
        os.environ["DUET_RANK_TRACE"] = str(Path(args.trace).with_suffix(""))
    started = time.perf_counter()
    engine = TorchEngine(path, context_length=args.context, dtype="bfloat16",
                         compile=args.compile, max_batch=max(batches),
                         tensor_parallel=args.tensor_parallel, quantize=args.quantize or "auto")
    engine.wait_compiled()
    print(f"load {time.perf_counter() - started:.1f} s", flush=True)
    for feature in args.feature.split(","):
        params = feature_params(feature, args.context - args.prompt_tokens - 1)
        for b in batches:
            profile_batch(args, engine, feature, params, b)
    return 0


def profile_batch(args, engine, feature: str, params, b: int) -> None:
    """One feature at batch b: the step's time split, its host profile, its kernels."""
    import torch

    from engines.runtime.runtime import Runtime, Submission

    runtime = Runtime(engine, max_batch=b, max_prefill_tokens=args.max_prefill_tokens
                      or max(512, args.prompt_tokens))
    timer = Timer()
    ex = runtime.executor
    timer.wrap(ex, "launch", "executor.launch")
    timer.wrap(ex, "collect", "executor.collect (read-back)")
    if ex.decoder is not None:
        timer.wrap(ex.decoder, "run", "decoder.run (host + launch)")
    sync = torch.cuda.synchronize if engine.device.startswith("cuda") else None
    timer.wrap(ex, "_forward", "prefill forward", sync=sync)
    timer.wrap(runtime, "step", "runtime.step")
    timer.wrap(runtime, "_handle", "runtime._handle (tokens to events)")
    timer.wrap(runtime.scheduler, "schedule", "scheduler.schedule")
    if args.mask_threads is not None:
        from llguidance import LLExecutor

        ex._processor._masks._executor = LLExecutor(args.mask_threads)
    timer.wrap(ex._processor, "begin", "processing.begin (host)")
    timer.wrap(ex._processor, "finish", "processing.finish (host, waits for the masks)")
    timer.wrap(ex, "_in_flight", "wait for the last tokens")
    timer.wrap(ex._processor._masks, "take", "grammar: tokens taken in")
    timer.wrap(ex._processor._masks, "compute", "grammar masks (on the worker if pipelined)")
    # One request through first, so the prefill profiled below is not the process's first of
    # its shape (allocator growth, kernels chosen on first use).
    runtime.add(Submission([(5 * j) % 9000 + 100 for j in range(args.prompt_tokens)],
                           replace(params, max_tokens=2), lambda e: None))
    while runtime.has_work:
        runtime.step()
    timer.spent.clear()
    prompts = [[(31 * i + 7 * j) % 9000 + 100 for j in range(args.prompt_tokens)]
               for i in range(b)]
    for p in prompts:
        runtime.add(Submission(p, params, lambda e: None))
    from torch.profiler import ProfilerActivity, profile

    with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
          if args.prefill_kernels else contextlib.nullcontext()) as profiler:
        while any(live.out.n == 0 for live in runtime._live.values()):
            runtime.step()
    if profiler is not None:
        if args.trace and b == max(int(n) for n in args.batches.split(",")):
            profiler.export_chrome_trace(str(Path(args.trace).with_suffix(".prefill.json")))
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(f"prefill B={b}, by {key}:\n" + profiler.key_averages().table(
                sort_by=key, row_limit=12, max_name_column_width=60), flush=True)
    prefill = dict(timer.spent)
    timer.spent.clear()
    for _ in range(args.steps):
        runtime.step()
    line = {k: timer.median_ms(k) for k in timer.spent}
    line["prefill forward (all prompts)"] = round(sum(prefill.get("prefill forward", [0]))
                                                  * 1000, 2)
    print(f"{feature} B={b}: {line}", flush=True)
    print(f"{feature} B={b}: {b / (line['runtime.step'] / 1000):.0f} tok/s at the step's "
          "median", flush=True)
    if feature != "none":
        print(host_profile(runtime.step, args.steps), flush=True)
    if args.no_kernels:
        runtime.stop_all()
        while runtime.has_work:
            runtime.step()
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runtime.step()
        if sync is not None:
            sync()
    # On the CPU there is no device time: the ops' own host time is what a step spends.
    key = "self_cuda_time_total" if sync is not None else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=20,
                                      max_name_column_width=60)
    print(table, flush=True)
    if args.trace and b == max(int(n) for n in args.batches.split(",")):
        prof.export_chrome_trace(args.trace)
    runtime.stop_all()
    while runtime.has_work:
        runtime.step()


if __name__ == "__main__":
    raise SystemExit(main())
