"""The systems a benchmark times: duet's engines and the references (transformers generate()
with a dynamic cache, or a static cache that generate() compiles; mlx-lm's generate_step, and
its BatchGenerator for batch runs), and the device's ceiling (copy bandwidth, weight and KV-cache
bytes).

Every system implements setup(model_dir, dtype, context), run(prompt_ids, new_tokens) ->
Measurement, teardown(). Only the backends a system needs are imported, when it is set up.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from .core import Measurement, PlannedRun, RunRecord, TargetKind, engine_run
from .load import reference_level
from .report import versions


def free_torch() -> None:
    """Give a torch system's memory back before the next one loads."""
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

    quantize = "auto"

    def __init__(self, device: str = "auto", compile: str = "auto"):
        self.device, self.compile = device, compile

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        from ..torch_engine import TorchEngine

        self.engine = TorchEngine(model_dir, context_length=context, dtype=dtype,
                                  device=self.device, compile=self.compile,
                                  quantize=self.quantize)
        self.engine.wait_compiled()  # the steady state is measured, not the eager start

    def run(self, prompt: list[int], new_tokens: int) -> Measurement:
        stats = engine_run(self.engine, prompt, new_tokens)
        return Measurement(stats.ttft_s, stats.prefill_tokens_per_s, stats.decode_tokens_per_s,
                           stats.peak_memory_bytes)

    def teardown(self) -> None:
        self.engine = None
        free_torch()


class DuetMLX(DuetTorch):
    name = "duet-mlx"

    def __init__(self):
        pass

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        from ..mlx_engine import MLXEngine

        self.engine = MLXEngine(model_dir, context_length=context, dtype=dtype,
                                quantize=self.quantize)


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

        from ..device import choose_device, choose_dtype, torch_dtype
        from ..models.dummy import is_dummy

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

    def _generate(self, ids, n: int, attention_mask=None) -> float:
        from ..device import synchronize

        synchronize(self.device)
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=attention_mask, max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)
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
        """Seconds for one generate() over the batch, prefill included. Prompts of unequal
        lengths are padded on the left under an attention mask, as transformers documents for
        batched generation with a decoder-only model."""
        torch = self.torch
        if len(set(map(len, prompts))) == 1:
            return self._generate(torch.tensor(prompts, device=self.device), new_tokens)
        ids, mask = pad_left(prompts)
        return self._generate(torch.tensor(ids, device=self.device), new_tokens,
                              attention_mask=torch.tensor(mask, device=self.device))

    def teardown(self) -> None:
        self.model = None
        free_torch()


def pad_left(prompts: Sequence[Sequence[int]], pad: int = 0) -> tuple[list[list[int]],
                                                                     list[list[int]]]:
    """Token ids padded on the left to the longest prompt, and the attention mask that hides
    the padding: how a decoder-only model generates for prompts of unequal lengths."""
    longest = max(map(len, prompts))
    ids = [[pad] * (longest - len(p)) + list(p) for p in prompts]
    mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


class HFStaticCompile(HFGenerate):
    name = "hf-static-compile"
    static = True


class MLXLMGenerate:
    """mlx-lm's own generate_step, greedy."""

    name = "mlx-lm"

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        from ..mlx_blas import preload

        preload()  # the BLAS duet's MLX engine has, before mlx.core loads
        import mlx.core as mx
        from mlx_lm.utils import load_model

        from ..mlx_engine.engine import _MX_DTYPES, _legacy_rope_keys, choose_mlx_dtype, mlx_device
        from ..models.dummy import is_dummy

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
        return self.run_batch_timed(prompts, new_tokens)[0]

    def run_batch_timed(self, prompts: list[list[int]],
                        new_tokens: int) -> tuple[float, list[float], list[float]]:
        """run_batch's seconds, each prompt's seconds to its first token, and each step's
        (BatchGenerator.next()) seconds."""
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(self.model, max_tokens=new_tokens,
                             completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
        start = time.perf_counter()
        gen.insert(prompts, max_tokens=[new_tokens] * len(prompts))
        first: dict[int, float] = {}
        steps = []
        left = len(prompts)
        while left:
            tic = time.perf_counter()
            _, generated = gen.next()
            steps.append(time.perf_counter() - tic)
            for r in generated:
                first.setdefault(r.uid, time.perf_counter() - start)
                left -= r.finish_reason is not None
        gen.close()
        return time.perf_counter() - start, list(first.values()), steps

    def teardown(self) -> None:
        self.model = None
        gc.collect()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------- by name
SYSTEMS = {
    "duet-torch": DuetTorch, "duet-mlx": DuetMLX, "hf-dynamic": HFGenerate,
    "hf-static-compile": HFStaticCompile, "mlx-lm": MLXLMGenerate,
}


_DTYPES = ("float32", "float16", "bfloat16")


class Variant:
    """A system under options of its own, named 'system:opt+opt': a dtype for any system
    ('hf-dynamic:bfloat16'), a weight quantization for duet's engines ('duet-torch:int4',
    'duet-torch:bfloat16+int8')."""

    def __init__(self, system, options: str):
        from ..quantization import CHOICES

        self.system, self.name = system, f"{system.name}:{options}"
        self.dtype = None
        for opt in options.split("+"):
            if opt in _DTYPES:
                self.dtype = opt
            elif opt in CHOICES and isinstance(system, DuetTorch):
                system.quantize = opt
            else:
                raise ValueError(f"{system.name} takes no option '{opt}'")

    def setup(self, model_dir: Path, dtype: str, context: int) -> None:
        self.system.setup(model_dir, self.dtype or dtype, context)

    def run(self, prompt: list[int], new_tokens: int) -> Measurement:
        return self.system.run(prompt, new_tokens)

    def teardown(self) -> None:
        self.system.teardown()


def make(spec: str, device: str = "auto", compile: str = "auto"):
    """A system by its name, with options after a colon (Variant)."""
    name, _, options = spec.partition(":")
    if name == "duet-torch":
        system = DuetTorch(device, compile)
    elif name in ("hf-dynamic", "hf-static-compile"):
        system = SYSTEMS[name](device)
    else:
        system = SYSTEMS[name]()
    return Variant(system, options) if options else system


# Reference name (/bench) -> its system, and the engine whose backend it needs (so it is offered
# only where that backend is installed).
REFERENCES = {"transformers": (HFGenerate, "torch"), "mlx-lm": (MLXLMGenerate, "mlx")}


class ReferenceTarget:
    """A reference system behind the run-and-measure shape of duet's engines (/bench)."""

    kind: TargetKind = "reference"

    def __init__(self, name: str, device: str = "auto"):
        cls, self.backend = REFERENCES[name]
        self.name = name
        self.system = cls(device) if issubclass(cls, HFGenerate) else cls()

    def setup(self, model_dir, dtype: str, context: int) -> dict:
        """Load the reference's own copy of the model; returns what it runs on."""
        self.system.setup(model_dir, dtype, context)
        v = versions()
        if self.backend == "torch":
            from ..device import choose_dtype

            device = self.system.device
            dtype = choose_dtype(dtype, device)
            backend = f"transformers {v.get('transformers')}, torch {v.get('torch')}"
        else:
            from ..mlx_engine.engine import choose_mlx_dtype, mlx_device

            device = mlx_device()
            dtype = choose_mlx_dtype(dtype, device)
            backend = f"mlx {v.get('mlx')}, mlx-lm {v.get('mlx-lm')}"
        return {"device": device, "dtype": dtype, "backend_version": backend}

    def run(self, run: PlannedRun, prompt_ids: Sequence[int], max_tokens: int) -> RunRecord:
        start = time.perf_counter()
        m = self.system.run(list(prompt_ids), max_tokens)
        return RunRecord(
            self.name, "reference", run.prompt, run.repeat, run.warmup, len(prompt_ids),
            max_tokens, m.ttft_s, m.prefill_tokens_per_s, m.decode_tokens_per_s,
            int(m.peak_memory_bytes), None, time.perf_counter() - start,
        )

    def run_level(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """The load mode's figure for this reference: one batch of every client's prompt, each
        given max_tokens (prefill included, as the server's aggregate includes it), after an
        unmeasured batch of the same size (compiled kernels, allocator growth)."""
        self.system.run_batch(prompts, min(max_tokens, 8))
        seconds = self.system.run_batch(prompts, max_tokens)
        return reference_level(len(prompts), len(prompts) * max_tokens, seconds)

    def close(self) -> None:
        """Free the reference's model (the server calls this on the reference's thread)."""
        self.system.teardown()


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
    from ..device import choose_dtype
    from ..torch_engine.config import ModelArgs

    config = json.loads((model_dir / "config.json").read_text())
    if "quantization" in config:  # a quantized checkpoint is read as stored
        return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    a = ModelArgs.from_hf(config)
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
    from ..device import choose_dtype
    from ..torch_engine.config import ModelArgs

    a = ModelArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[choose_dtype(dtype, device)]
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * context * size
