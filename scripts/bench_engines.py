#!/usr/bin/env python3
"""Engine benchmark: duet's engines against transformers and mlx-lm, in one run, on one model.

Runs the same way here (CPU, the default model) and on a lent GPU (dummy weights of a real
shape). Prints a table, writes JSON under docs/bench/ and a section of docs/benchmarks.md.

  python scripts/bench_engines.py --model default --systems duet-torch,hf-dynamic --dtype bfloat16
  python scripts/bench_engines.py --model llama-3.2-1b --check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.bench import core, report, systems  # noqa: E402


def model_dir(model: str, cache: Path) -> Path:
    if model == "default":
        # The packaged GGUF model; needs the server's own dependencies (pydantic).
        from engines.models.config import load_models_file
        from engines.models.sources import resolve_model_dir

        spec = load_models_file(ROOT / "models.toml")[0]
        return resolve_model_dir(spec)
    from engines.models.dummy import write_dummy_model

    return write_dummy_model(model, cache / "dummy" / model)


def mlx_checkpoint(source: Path, bits: int, cache: Path) -> Path:
    """source quantized by mlx-lm itself, as `mlx_lm.convert -q --q-bits BITS` writes it
    (affine, groups of 64, the head included), in bfloat16 otherwise: one checkpoint that duet's
    MLX engine and mlx-lm both load. A dummy's random weights are drawn once and saved."""
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from engines.mlx_engine.engine import _legacy_rope_keys
    from engines.models.dummy import DUMMY_FLAG, is_dummy

    target = cache / "mlx-quantized" / f"{source.name}-q{bits}"
    if (target / "config.json").is_file():
        return target
    config = json.loads((source / "config.json").read_text())
    model, config = load_model(source, strict=not is_dummy(config),
                               model_config=_legacy_rope_keys(config))
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, group_size=64, bits=bits)
    config.pop(DUMMY_FLAG, None)  # its weights are in the files now
    target.mkdir(parents=True)
    save_model(target, model)
    save_config(config, target / "config.json")
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, target / f.name)
    return target


def gpu_check(path: Path, dtype: str, context: int, steps: int = 64) -> dict:
    """The compiled path's greedy tokens against the eager path's, step by step. Random
    weights give near-ties between the top logits, which half precision flips; the check
    runs in float32, where the two paths must agree."""
    dtype = "float32"
    from engines.base import SamplingParams, Step
    from engines.torch_engine import TorchEngine

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    prompt = core.random_prompt(128, 30000)
    runs = {}
    for mode in ("auto", "off"):
        engine = TorchEngine(path, context_length=context, dtype=dtype, compile=mode)
        engine.wait_compiled()
        runs[mode] = [e.token_id for e in engine.generate(prompt, params)
                      if isinstance(e, Step) and e.finish_reason is None]
        engine = None
        systems.free_torch()
    same = 0
    for a, b in zip(runs["auto"], runs["off"]):
        if a != b:
            break
        same += 1
    return {"steps": steps, "identical_prefix": same, "passed": same == steps, "dtype": dtype}


def table_rows(results, floor_tps):
    rows = []
    for r in results:
        if r.error:
            rows.append([r.system, str(r.prompt_tokens), "error", "", "", "", "", r.error[:60]])
            continue
        decode = r.median("decode_tokens_per_s")
        rows.append([
            r.system, str(r.prompt_tokens), f"{r.median('ttft_s') * 1000:.1f}",
            f"{r.median('prefill_tokens_per_s'):.0f}", f"{decode:.1f}",
            f"{decode / floor_tps:.0%}" if floor_tps else "", f"{r.median('peak_memory_bytes') / 2**30:.2f}",
            f"{min(m.decode_tokens_per_s for m in r.runs):.1f}-{max(m.decode_tokens_per_s for m in r.runs):.1f}",
        ])
    return rows


HEADER = ["system", "prompt", "TTFT ms", "prefill tok/s", "decode tok/s", "of floor",
          "peak GiB", "decode range"]


def print_table(rows, title):
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for h in HEADER:
            t.add_column(h, justify="left" if h == "system" else "right")
        for r in rows:
            t.add_row(*r)
        Console(width=140).print(t)
    except ImportError:
        print(title)
        for r in [HEADER, *rows]:
            print(" | ".join(f"{c:>14}" for c in r))


def ratios(results, new_tokens) -> dict[str, float]:
    by = {(r.system, r.prompt_tokens): r.median("decode_tokens_per_s") for r in results if not r.error}
    out = {}
    refs = {s for s, _ in by if s.split(":")[0] in ("hf-dynamic", "hf-static-compile", "mlx-lm")}
    for (system, n), tps in by.items():
        for ref in sorted(refs):
            if (ref, n) in by and system.startswith("duet"):
                out[f"{system} / {ref} @ {n}"] = tps / by[(ref, n)]
    return out


def markdown(meta, rows, ratio_map, check) -> str:
    lines = [
        f"### {meta['model']} on {meta['device_name']} ({meta['dtype']}), {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. "
        f"Copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (read + write); weights "
        f"{meta['weight_bytes'] / 2**30:.2f} GiB, so the decode floor is "
        f"{meta['floor_tokens_per_s']:.0f} tok/s. KV cache for the {meta['context']}-token "
        f"context: {meta['kv_cache_bytes'] / 2**20:.0f} MiB. Medians of {meta['repeats']} runs"
        f"{' (systems loaded together, runs taken in turn)' if meta.get('interleaved') else ''}, "
        f"{meta['new_tokens']} new tokens, end-of-sequence ignored, greedy, batch 1.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if ratio_map:
        lines += ["", "Decode ratios: " + "; ".join(f"{k}: {v:.2f}x" for k, v in ratio_map.items()) + "."]
    if check:
        lines += ["", f"Compiled vs eager greedy tokens ({check['dtype']}): "
                      f"{check['identical_prefix']}/{check['steps']} identical "
                      f"({'pass' if check['passed'] else 'FAIL'})."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="default (the packaged SmolLM2) or a dummy shape: llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b")
    p.add_argument("--systems", default="duet-torch,duet-mlx,hf-dynamic,hf-static-compile,mlx-lm",
                   help="names, each with options after a colon: a dtype, and for duet's engines "
                        "a quantization (duet-torch:int4, hf-dynamic:bfloat16, "
                        "duet-torch:float32+none)")
    p.add_argument("--prompts", default="128,1024", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", help="torch device")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--compile", default="auto", help="duet-torch: auto, on or off")
    p.add_argument("--check", action="store_true", help="compare compiled and eager greedy tokens")
    p.add_argument("--interleave", action="store_true",
                   help="load every system at once and take their runs in turn (noisy hosts)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "duet")
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--tag", default="", help="extra words for the result's key (e.g. the GPU)")
    p.add_argument("--mlx-quantized", type=int, choices=(4, 8),
                   help="run the MLX systems on this many bits: a checkpoint quantized by "
                        "mlx-lm itself, which both load")
    args = p.parse_args(argv)

    from engines.device import choose_device, choose_dtype

    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    path = model_dir(args.model, args.cache)
    if args.mlx_quantized:
        path = mlx_checkpoint(path, args.mlx_quantized, args.cache)
        args.tag = f"{args.tag}-mlx-q{args.mlx_quantized}".strip("-")
    prompt_lens = [int(x) for x in args.prompts.split(",")]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    bandwidth = systems.copy_bandwidth(device)
    wbytes = systems.weight_bytes(path, dtype, device)
    floor_tps = bandwidth / wbytes
    print(f"device {report.device_name(device)}: copy {bandwidth / 1e9:.0f} GB/s; weights "
          f"{wbytes / 2**30:.2f} GiB; floor {floor_tps:.0f} tok/s", flush=True)

    chosen = [systems.make(name, device, args.compile) for name in args.systems.split(",")]
    # Interleaved: every system loaded together; otherwise one at a time, each freed before
    # the next loads (GPU memory), with the table so far printed after each.
    results = []
    for group in [chosen] if args.interleave else [[s] for s in chosen]:
        results += core.run_systems(group, path, dtype, args.context, prompt_lens,
                                    args.new_tokens, args.repeats, vocab)
        print_table(table_rows(results, floor_tps), f"{args.model} so far")

    check = gpu_check(path, dtype, args.context) if args.check else None
    meta = {
        "model": args.model, "device": device, "device_name": report.device_name(device),
        "dtype": dtype, "date": dt.date.today().isoformat(), "versions": report.versions(),
        "copy_bandwidth_GBps": bandwidth / 1e9, "weight_bytes": wbytes,
        "floor_tokens_per_s": floor_tps, "context": args.context, "repeats": args.repeats,
        "new_tokens": args.new_tokens, "interleaved": args.interleave,
        "kv_cache_bytes": systems.kv_cache_bytes(path, dtype, device, args.context),
        "command": "python scripts/bench_engines.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    rows = table_rows(results, floor_tps)
    ratio_map = ratios(results, args.new_tokens)
    print_table(rows, f"{args.model} on {meta['device_name']} ({dtype})")
    for k, v in ratio_map.items():
        print(f"  {k}: {v:.2f}x")
    if check:
        print(f"  compiled vs eager: {check}")
    key = re.sub(r"[^a-z0-9.-]+", "-", f"{args.model}-{device.split(':')[0]}-{dtype}-{args.tag}".lower()).strip("-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{key}.json").write_text(report.results_json(results, {**meta, "ratios": ratio_map, "check": check}))
    report.write_marked_section(args.md, key, markdown(meta, rows, ratio_map, check))
    print(f"wrote {args.out_dir / (key + '.json')} and a section of {args.md}")
    return 0 if all(not math.isnan(r.median("decode_tokens_per_s")) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
