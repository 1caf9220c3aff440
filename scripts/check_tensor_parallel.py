#!/usr/bin/env python3
"""Whether a model split over GPUs computes what it computes on one: greedy decoding of a few
prompts with each token's top log-probabilities, on one GPU and then split over N (the decode
steps replayed as CUDA graphs, with their sums over the ranks and the split vocabulary
projection), compared token by token while both have decoded the same tokens.

A checkpoint of random weights of a real shape (fewer layers with --layers), written once as
safetensors so both load the same weights (a dummy model's ranks draw their shares apart), in
bfloat16 (the split model sums in another order, so a token whose two best logits are within
rounding may differ, and the texts part there). Exits
non-zero when the decodes part at once or the log-probabilities differ by more than rounding.

  python scripts/check_tensor_parallel.py --model llama-3.2-1b --ranks 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode(path: Path, ranks: int, prompts: list[list[int]], tokens: int, compile: str):
    """Each prompt's steps: (token, {top token: logprob})."""
    import torch

    from engines.base import SamplingParams, Step
    from engines.runtime.runtime import Runtime, Submission
    from engines.torch_engine import TorchEngine

    engine = TorchEngine(path, context_length=512, dtype="bfloat16", compile=compile,
                         max_batch=len(prompts), tensor_parallel=ranks)
    engine.wait_compiled()  # one GPU: compared through the compiled step
    runtime = Runtime(engine, max_batch=len(prompts))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    out: list[list[tuple[int, dict[int, float]]]] = [[] for _ in prompts]

    def emit_to(i):
        def emit(event):
            if isinstance(event, Step) and event.logprobs is not None:
                out[i].append((event.token_id, dict(event.logprobs.top)))
        return emit

    for i, p in enumerate(prompts):
        runtime.add(Submission(p, params, emit_to(i)))
    while runtime.has_work:
        runtime.step()
    runtime.close()
    engine.close()
    del runtime, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def checkpoint(shape: str, layers: int, target: Path) -> Path:
    """A directory with random weights of `shape` (its first `layers` layers), as safetensors,
    and the dummy model's tokenizer."""
    import json
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.models.atomic_dir import build_atomically
    from engines.models.dummy import DUMMY_FLAG, write_dummy_model

    dummy = write_dummy_model(shape, target.parent / f"{shape}-dummy")

    def build(tmp: Path) -> None:
        config = json.loads((dummy / "config.json").read_text())
        config.pop(DUMMY_FLAG)
        config["num_hidden_layers"] = layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                                 torch_dtype=torch.bfloat16)
        model.save_pretrained(str(tmp))
        for f in dummy.iterdir():
            if f.name != "config.json":
                shutil.copy(f, tmp / f.name)

    return build_atomically(target, build, lambda d: (d / "config.json").is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a dummy model's shape")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--cache", default="/tmp/duet-profile")
    args = parser.parse_args()
    path = checkpoint(args.model, args.layers, Path(args.cache) / f"{args.model}-{args.layers}l")
    prompts = [[(37 * i + 11 * j) % 9000 + 100 for j in range(16 + 5 * i)]
               for i in range(args.prompts)]
    whole = decode(path, 1, prompts, args.tokens, args.compile)
    split = decode(path, args.ranks, prompts, args.tokens, args.compile)
    agreed, diffs, overlaps = [], [], []
    for a, b in zip(whole, split):
        n = 0
        for (ta, top_a), (tb, top_b) in zip(a, b):
            common = top_a.keys() & top_b.keys()
            overlaps.append(len(common) / len(top_a))
            diffs.extend(abs(top_a[t] - top_b[t]) for t in common)
            if ta != tb:
                break
            n += 1
        agreed.append(n)
    worst = max(diffs)
    print(f"{args.model} shape ({args.layers} layers) over {args.ranks} GPUs against one, "
          f"{args.prompts} prompts, "
          f"{args.tokens} tokens each, greedy, bfloat16:")
    print(f"  tokens alike before the decodes part, by prompt: {agreed}")
    print(f"  top-5 tokens shared: {statistics.mean(overlaps):.0%} on average; their "
          f"log-probabilities differ by {statistics.median(diffs):.4f} (median), "
          f"{worst:.4f} (most)")
    ok = statistics.median(agreed) >= 4 and statistics.mean(overlaps) >= 0.6 and worst < 0.25
    print("tensor parallelism: " + ("ok" if ok else "DIFFERS"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
