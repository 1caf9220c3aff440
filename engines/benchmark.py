"""The benchmark core: the same prompts through duet's engines and the reference systems,
timed the same way. Front ends (scripts/bench_engines.py, later /bench and `duet bench`)
only choose what to run and how to show it.

Every system implements setup(model_dir, dtype, context), run(prompt_ids, new_tokens) ->
Measurement, teardown(). Only the backends a system needs are imported, when it is set up."""

from __future__ import annotations

import gc
import json
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Measurement:
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int


@dataclass
class Result:
    system: str
    prompt_tokens: int
    new_tokens: int
    runs: list[Measurement] = field(default_factory=list)
    error: str | None = None

    def median(self, key: str) -> float:
        return statistics.median(getattr(m, key) for m in self.runs) if self.runs else float("nan")


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed + n)
    return [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]


def _free_torch() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    except ImportError:
        pass


# ---------------------------------------------------------------- duet's engines
class DuetTorch:
    name = "duet-torch"

    def __init__(self, device: str = "auto", compile: str = "auto"):
        self.device, self.compile = device, compile

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        from .torch_engine import TorchEngine

        self.engine = TorchEngine(model_dir, context_length=context, dtype=dtype,
                                  device=self.device, compile=self.compile)

    def run(self, prompt: list[int], new_tokens: int) -> Measurement:
        from .bench_core import engine_run

        stats = engine_run(self.engine, prompt, new_tokens)
        return Measurement(stats.ttft_s, stats.prefill_tokens_per_s, stats.decode_tokens_per_s,
                           stats.peak_memory_bytes)

    def teardown(self) -> None:
        self.engine = None
        _free_torch()


class DuetMLX(DuetTorch):
    name = "duet-mlx"

    def __init__(self):
        pass

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        from .mlx_engine import MLXEngine

        self.engine = MLXEngine(model_dir, context_length=context, dtype=dtype)


# ---------------------------------------------------------------- references
class HFGenerate:
    """transformers generate(), greedy, end-of-sequence ignored by min_new_tokens."""

    name = "hf-dynamic"
    static = False

    def __init__(self, device: str = "auto"):
        self.device = device

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from .device import choose_device, choose_dtype, torch_dtype
        from .dummy import is_dummy

        self.device = choose_device(self.device)
        self.torch = torch
        tdtype = torch_dtype(choose_dtype(dtype, self.device))
        config = json.loads((model_dir / "config.json").read_text())
        if is_dummy(config):
            hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(hf_config, dtype=tdtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdtype).to(self.device)
        self.model.eval()
        self.context = context
        if self.static:
            # generate() compiles the decoding forward itself (mode reduce-overhead) once the
            # cache is static: the documented transformers recipe.
            self.model.generation_config.cache_implementation = "static"

    def _generate(self, ids, n: int) -> float:
        from .device import synchronize

        synchronize(self.device)
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0)
        synchronize(self.device)
        return time.perf_counter() - start

    def run(self, prompt: list[int], new_tokens: int) -> Measurement:
        torch = self.torch
        ids = torch.tensor([prompt], device=self.device)
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        ttft = self._generate(ids, 1)
        total = self._generate(ids, new_tokens)
        peak = torch.cuda.max_memory_allocated() if self.device.startswith("cuda") else _rss()
        return Measurement(ttft, len(prompt) / ttft, (new_tokens - 1) / max(total - ttft, 1e-9), peak)

    def run_batch(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds for one generate() over the batch (equal-length prompts), prefill included."""
        return self._generate(self.torch.tensor(prompts, device=self.device), new_tokens)

    def teardown(self) -> None:
        self.model = None
        _free_torch()


class HFStaticCompile(HFGenerate):
    name = "hf-static-compile"
    static = True


class MLXLMGenerate:
    """mlx-lm's own generate_step, greedy."""

    name = "mlx-lm"

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load_model

        from .dummy import is_dummy
        from .mlx_engine.engine import _MX_DTYPES, _legacy_rope_keys, choose_mlx_dtype, mlx_device

        config = json.loads((model_dir / "config.json").read_text())
        self.model, _ = load_model(model_dir, strict=not is_dummy(config),
                                   model_config=_legacy_rope_keys(config))
        self.model.set_dtype(_MX_DTYPES[choose_mlx_dtype(dtype, mlx_device())])
        mx.eval(self.model.parameters())
        self.mx = mx

    def run(self, prompt: list[int], new_tokens: int) -> Measurement:
        from mlx_lm.generate import generate_step

        mx = self.mx
        mx.reset_peak_memory()
        start = time.perf_counter()
        first = start
        for i, _ in enumerate(generate_step(mx.array(prompt), self.model, max_tokens=new_tokens)):
            if i == 0:
                first = time.perf_counter()
        end = time.perf_counter()
        ttft = first - start
        return Measurement(ttft, len(prompt) / ttft, (new_tokens - 1) / (end - first),
                           int(mx.get_peak_memory()))

    def run_batch(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds for mlx-lm's BatchGenerator to give every prompt new_tokens, prefill
        included."""
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(self.model, max_tokens=new_tokens,
                             completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
        start = time.perf_counter()
        gen.insert(prompts, max_tokens=[new_tokens] * len(prompts))
        left = len(prompts)
        while left:
            left -= sum(r.finish_reason is not None for r in gen.next_generated())
        gen.close()
        return time.perf_counter() - start

    def teardown(self) -> None:
        self.model = None
        gc.collect()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


SYSTEMS = {
    "duet-torch": DuetTorch, "duet-mlx": DuetMLX, "hf-dynamic": HFGenerate,
    "hf-static-compile": HFStaticCompile, "mlx-lm": MLXLMGenerate,
}


# ---------------------------------------------------------------- the device's ceiling
def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, counting bytes read plus bytes written."""
    import torch

    n = (1 << 30) // 2 if device.startswith("cuda") else (256 << 20) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1000
        else:
            t = time.perf_counter()
            b.copy_(a)
            dt = time.perf_counter() - t
        if i >= 3:
            times.append(dt)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def weight_bytes(model_dir: Path, dtype: str, device: str) -> int:
    """Bytes of every distinct weight: what one decode step must read at least."""
    from .device import choose_dtype
    from .torch_engine.config import ModelArgs

    a = ModelArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    per_layer = (
        a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        + a.num_heads * a.head_dim * a.hidden_size
        + 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size
    )
    embed = a.vocab_size * a.hidden_size
    params = a.num_layers * per_layer + embed * (1 if a.tie_word_embeddings else 2) + a.hidden_size
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[choose_dtype(dtype, device)]
    return params * size


def kv_cache_bytes(model_dir: Path, dtype: str, device: str, context: int) -> int:
    from .device import choose_dtype
    from .torch_engine.config import ModelArgs

    a = ModelArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[choose_dtype(dtype, device)]
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * context * size


# ---------------------------------------------------------------- running
def run_systems(systems, model_dir: Path, dtype: str, context: int, prompt_lens: list[int],
                    new_tokens: int, repeats: int, vocab: int, log=print) -> list[Result]:
    """The systems loaded together and their runs taken in turn, so slow drifts of the
    machine (clocks, host load) fall on all of them alike (pass one system to run it alone).
    A system that fails keeps its error and never loses the others' numbers."""
    results = {s.name: [Result(s.name, n, new_tokens) for n in prompt_lens] for s in systems}

    def fail(system, exc: Exception) -> None:
        log(f"{system.name}: failed: {type(exc).__name__}: {exc}")
        for res in results[system.name]:
            res.error = f"{type(exc).__name__}: {exc}"

    live = []
    for system in systems:
        try:
            started = time.perf_counter()
            system.setup(model_dir, dtype, context)
            for res in results[system.name]:  # warm-up: compiles, graph captures, allocator growth
                system.run(_prompt(res.prompt_tokens, vocab), new_tokens)
            log(f"{system.name}: set up and warmed up in {time.perf_counter() - started:.1f}s")
            live.append(system)
        except Exception as exc:
            fail(system, exc)
    try:
        for i, n in enumerate(prompt_lens):
            for _ in range(repeats):
                for system in list(live):
                    try:
                        results[system.name][i].runs.append(system.run(_prompt(n, vocab), new_tokens))
                    except Exception as exc:
                        fail(system, exc)
                        live.remove(system)
    finally:
        for system in systems:
            try:
                system.teardown()
            except Exception:
                pass
    return [r for s in systems for r in results[s.name]]


def write_marked_section(path: Path, key: str, text: str, tag: str = "bench") -> None:
    """Put text between <!-- tag:key --> markers of a markdown file, replacing what was there
    (or appending), so each benchmark rewrites only its own section."""
    start, end = f"<!-- {tag}:{key} -->", f"<!-- /{tag}:{key} -->"
    block = f"{start}\n{text}{end}\n"
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block
    path.write_text(new)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "mlx", "mlx-lm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU ({platform.processor() or platform.system()})"


def results_json(results: list[Result], meta: dict) -> str:
    return json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2)
