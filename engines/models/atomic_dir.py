"""Write a directory so that it appears whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def remove_abandoned_partials(target: Path) -> None:
    """Sweep away partial directories whose writer process is gone (killed mid-way)."""
    import psutil

    for path in target.parent.glob(f".partial-{target.name}-*"):
        pid = path.name[len(f".partial-{target.name}-") :].split("-")[0]
        if not pid.isdigit() or not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def build_atomically(
    target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> Path:
    """build(tmp) fills a temporary sibling directory, which is then renamed to target.

    A writer killed half-way leaves only a .partial-* directory that nothing trusts."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{target.name}-{os.getpid()}-", dir=target.parent))
    try:
        build(tmp)
        if target.exists() and not is_complete(target):
            shutil.rmtree(target)  # not ours to trust: it is incomplete
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same directory first; keep its copy.
            if not is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
