"""Plant small, realistic bugs one at a time in a copy of the working tree and check that the
tests meant to guard each one fail.

Each bug is one textual change (it must match exactly once, so a refactor that moves the code
shows up here as a stale entry, not as a silent pass). The tests named for a bug are part of
the default run, so a bug caught here fails `scripts/test.sh` too.

    .venv/bin/python scripts/planted_bugs.py            # every bug
    .venv/bin/python scripts/planted_bugs.py top_p eos  # the named ones

Prints a table and writes docs/planted_bugs.json; exits non-zero when a bug escapes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


BUGS = [
    Bug("worker_slot", "EngineWorker never releases a finished job's queue slot unless it was "
        "a generation (classifications and bench runs leak theirs)",
        "server/worker.py",
        "                self._jobs.remove(job)\n",
        "                if job.kind == 'generation':\n                    self._jobs.remove(job)\n",
        ("tests/server/test_worker.py",)),
    Bug("auth_prefix", "the API-key check accepts any prefix of a key",
        "server/auth.py",
        "found |= hmac.compare_digest(candidate, key)",
        "found |= hmac.compare_digest(candidate, key[: len(candidate)])",
        ("tests/server/test_auth.py",)),
    Bug("top_p", "top_p keeps the wrong side of the cumulative sum (the unlikely tail)",
        "engines/torch_engine/sampling.py",
        "drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p",
        "drop = (sorted_probs.cumsum(-1) - sorted_probs) < top_p",
        ("tests/engines/test_sampling.py",)),
    Bug("window_eager", "the sliding-window mask of the eager path is one token too wide",
        "engines/torch_engine/model.py",
        "            mask &= k_pos > q_pos - window\n",
        "            mask &= k_pos >= q_pos - window\n",
        ("tests/engines/test_torch_parity.py",)),
    Bug("window_batched", "the sliding-window mask of the batched (paged KV) path is one token "
        "too wide",
        "engines/torch_engine/paged.py",
        "mask &= k_pos[None, None, :] > self.positions[:, :, None] - self.window",
        "mask &= k_pos[None, None, :] >= self.positions[:, :, None] - self.window",
        ("tests/engines/test_torch_parity.py", "tests/engines/test_batching.py")),
    Bug("graph_padding", "the CUDA graph runner's padding rows write into the pool's first slot "
        "instead of its trash slot",
        "engines/torch_engine/cuda_graphs.py",
        "        host[n:b, WRITE] = self.kv.trash\n",
        "",
        ("tests/engines/test_cuda_graphs_host.py",)),
    Bug("one_listing", "classification scores only the given label order (the reversed "
        "listing is dropped)",
        "engines/classify.py",
        "listings = [labels, labels[::-1]] if params.calibrate and n > 1 else [labels]",
        "listings = [labels]",
        ("tests/engines/test_classify.py",)),
    Bug("no_average", "classification adds the two listings' scores instead of averaging them",
        "engines/classify.py",
        "for k in range(len(listings))) / len(listings)",
        "for k in range(len(listings)))",
        ("tests/engines/test_classify.py",)),
    Bug("sse_param", "the mid-stream SSE error event leaves out `param`",
        "server/streaming.py",
        '"type": type_, "param": None, "code": code}',
        '"type": type_, "code": code}',
        ("tests/server/test_ordering.py", "tests/server/test_limits.py",
         "tests/server/test_faults.py")),
    Bug("eos_generation_config", "end-of-sequence ids in generation_config.json are ignored",
        "engines/tokenizer.py",
        'for name in ("generation_config.json", "config.json"):',
        'for name in ("config.json",):',
        ("tests/engines/test_end_of_sequence.py",)),
    Bug("rss_sampling", "the CPU memory meter's per-token sampling does nothing",
        "engines/device.py",
        "        self._peak = max(self._peak, self._proc.memory_info().rss)\n",
        "        pass\n",
        ("tests/engines/test_device.py",)),
]


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored): no venv, caches."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy, not the editable install
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tree, env=env, capture_output=True, text=True,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, time.perf_counter() - started, tail[-1] if tail else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="bugs to plant (default: all)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "planted_bugs.json"))
    args = parser.parse_args()
    bugs = [b for b in BUGS if not args.names or b.name in args.names]
    results = []
    clean_runs: dict[tuple[str, ...], int] = {}  # each guarding set must pass unplanted first
    with tempfile.TemporaryDirectory(prefix="duet-planted-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for bug in bugs:
            target = tree / bug.path
            clean = target.read_text()
            if clean.count(bug.old) != 1:
                results.append({"bug": bug.name, "outcome": "stale", "seconds": 0.0,
                                "detail": f"the text to change occurs {clean.count(bug.old)} times"})
                continue
            if bug.tests not in clean_runs:
                clean_runs[bug.tests] = run_tests(tree, bug.tests)[0]
            if clean_runs[bug.tests] != 0:
                results.append({"bug": bug.name, "outcome": "red before planting", "seconds": 0.0,
                                "detail": "the guarding tests fail on the clean tree"})
                continue
            target.write_text(clean.replace(bug.old, bug.new))
            try:
                rc, seconds, last = run_tests(tree, bug.tests)
            finally:
                target.write_text(clean)
            results.append({"bug": bug.name, "outcome": "caught" if rc == 1 else (
                "escaped" if rc == 0 else f"error (pytest exit {rc})"), "seconds": round(seconds, 1),
                "detail": last})
            print(f"{bug.name:24} {results[-1]['outcome']:10} {seconds:6.1f}s  {last}", flush=True)
    print()
    print(f"{'bug':24} {'outcome':10} what")
    for bug, r in zip(bugs, results):
        print(f"{bug.name:24} {r['outcome']:10} {bug.what}")
    caught = sum(r["outcome"] == "caught" for r in results)
    print(f"\n{caught} of {len(results)} planted bugs caught")
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "caught": caught, "planted": len(results),
        "results": [{**r, "what": b.what, "file": b.path, "tests": list(b.tests)}
                    for b, r in zip(bugs, results)],
    }, indent=2) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
