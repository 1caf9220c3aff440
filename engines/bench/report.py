"""What a benchmark's numbers were taken on, and where they are written: library versions,
device names, the host; a results file as JSON; a marked section of a markdown file."""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import asdict
from pathlib import Path

from .core import Result


# ---------------------------------------------------------------- where the numbers come from
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


def device_label(device: str) -> str:
    """A readable name for an engine's device (cpu, cuda:0, mps, metal)."""
    if device in ("mps", "metal", "gpu"):
        return f"Apple {platform.machine()} GPU ({device})"
    try:
        return device_name(device)
    except Exception:  # a label is never a reason to fail a run
        return device


def environment() -> dict:
    """Where the numbers come from: the host and the library versions."""
    return {"host": f"{platform.system()} {platform.machine()}, {_cpu_count()} CPU cores",
            "versions": versions()}


def _cpu_count() -> int:
    return os.cpu_count() or 1


# ---------------------------------------------------------------- writing
def results_json(results: list[Result], meta: dict) -> str:
    return json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2)


def write_marked_section(path: Path, key: str, text: str, tag: str = "bench") -> None:
    """Put text between <!-- tag:key --> markers of a markdown file, replacing what was there
    (or appending), so each benchmark rewrites only its own section."""
    start, end = f"<!-- {tag}:{key} -->", f"<!-- /{tag}:{key} -->"
    block = f"{start}\n{text}{end}\n"
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block
    path.write_text(new)
