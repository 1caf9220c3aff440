"""Mutation testing: mutmut changes the modules listed under [tool.mutmut] in pyproject.toml
one small edit at a time (an operator, a constant, a dropped argument) and runs the tests that
cover the changed function; a mutant the tests do not notice "survives".

    .venv/bin/python scripts/mutation.py           # run mutmut, then report (about an hour here)
    .venv/bin/python scripts/mutation.py --report  # report on the last run only
    .venv/bin/python scripts/mutation.py --modules engines/runtime/scheduler.py \
        --tests tests/engines/test_scheduler.py --name runtime   # a part, in a scratch copy

A part run copies the tracked files to mutants-runs/NAME/, narrows [tool.mutmut] there to the
given modules and tests (mutmut itself has no such switch) and writes docs/mutation-NAME.json.

Prints the surviving-mutant rate per module, writes docs/mutation.json (every survivor with its
diff, to be read and either killed by a test or explained in docs/testing.md), and exits
non-zero when the overall rate rose above the one recorded in docs/testing.md's baseline
(`--baseline`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = ROOT / "docs" / "mutation.json"


def mutmut(*args: str, check: bool = True, cwd: Path = ROOT) -> str:
    done = subprocess.run([str(BIN / "mutmut"), *args], cwd=cwd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"mutmut {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def module_of(mutant: str) -> str:
    """engines.torch_engine.sampling.x_make_sampler__mutmut_7 -> engines/torch_engine/sampling.py"""
    dotted = re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]
    return dotted.replace(".", "/") + ".py"


def diff_of(mutant: str, cwd: Path) -> list[str]:
    lines = mutmut("show", mutant, check=False, cwd=cwd).splitlines()
    return [line for line in lines if line[:2] in ("- ", "+ ")]


def report(baseline: float | None, cwd: Path = ROOT, out: Path = OUT) -> int:
    statuses = {}
    for line in mutmut("results", "--all", "true", cwd=cwd).splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            statuses[name] = status
    if not statuses:
        raise SystemExit("no mutation results: run without --report first")
    per_module: dict[str, Counter] = defaultdict(Counter)
    for name, status in statuses.items():
        per_module[module_of(name)][status] += 1
    # A mutant no test runs ("no tests": code reached only in a subprocess, or not at all)
    # survives as surely as one the tests run and miss: both count as surviving. A timeout is
    # a mutant that made the tests hang, so caught; "not checked" ones (a run cut short) are
    # left out of the rate.
    print(f"{'module':40} {'mutants':>8} {'killed':>7} {'timeout':>8} {'survived':>9} "
          f"{'no tests':>9} {'not run':>8} {'surviving':>10}")
    rows = {}
    for module in sorted(per_module):
        c = per_module[module]
        total = sum(c.values())
        checked = total - c["not checked"]
        lived = c["survived"] + c["no tests"]
        rows[module] = {"mutants": total, "killed": c["killed"], "timeout": c["timeout"],
                        "survived": c["survived"], "no_tests": c["no tests"],
                        "not_run": c["not checked"],
                        "surviving_rate": round(lived / checked, 4) if checked else None}
        print(f"{module:40} {total:8} {c['killed']:7} {c['timeout']:8} {c['survived']:9} "
              f"{c['no tests']:9} {c['not checked']:8} "
              f"{(lived / checked if checked else 0):10.1%}")
    sums = {k: sum(r[k] for r in rows.values())
            for k in ("mutants", "killed", "timeout", "survived", "no_tests", "not_run")}
    total = sums["mutants"]
    survived = sums["survived"] + sums["no_tests"]
    rate = survived / (total - sums["not_run"])
    print(f"{'all':40} {total:8} {sums['killed']:7} {sums['timeout']:8} {sums['survived']:9} "
          f"{sums['no_tests']:9} {sums['not_run']:8} {rate:10.1%}")
    survivors = [{"mutant": name, "module": module_of(name), "status": status,
                  "diff": diff_of(name, cwd)}
                 for name, status in sorted(statuses.items()) if status in ("survived", "no tests")]
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "tool": f"mutmut {mutmut('--version').split()[-1]}",
        **sums, "surviving_rate": round(rate, 4),
        "modules": rows, "survivors": survivors,
    }, indent=2, ensure_ascii=False) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)} ({len(survivors)} survivors with their diffs)")
    if baseline is not None and rate > baseline:
        print(f"the surviving-mutant rate rose: {rate:.1%} > the baseline {baseline:.1%}")
        return 1
    return 0


def scratch_copy(name: str, modules: list[str], tests: list[str]) -> Path:
    """The tracked files in mutants-runs/NAME, with [tool.mutmut] narrowed to modules/tests."""
    where = ROOT / "mutants-runs" / name
    shutil.rmtree(where, ignore_errors=True)
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for rel in files:
        if (ROOT / rel).is_file():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, where / rel)
    config = (where / "pyproject.toml").read_text()
    config, n = re.subn(r"only_mutate = \[.*?\]", "only_mutate = " + json.dumps(modules),
                        config, flags=re.S)
    config, m = re.subn(r"pytest_add_cli_args_test_selection = \[.*?\]",
                        "pytest_add_cli_args_test_selection = " + json.dumps(tests),
                        config, flags=re.S)
    if n != 1 or m != 1:
        raise SystemExit("pyproject.toml's [tool.mutmut] has no only_mutate or test selection")
    (where / "pyproject.toml").write_text(config)
    return where


def run(cwd: Path) -> None:
    shutil.rmtree(cwd / "mutants", ignore_errors=True)  # a whole fresh run, no stale cache
    # mutmut starts a pytest session per mutant: the tiny test models are built once, here,
    # and loaded by each session (tests/conftest.py's tiny_dirs) instead of rebuilt.
    tiny = cwd / "mutants-tiny-models"
    shutil.rmtree(tiny, ignore_errors=True)
    env = {**os.environ, "DUET_TINY_MODELS": str(tiny)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/engines/test_torch_parity.py"], cwd=cwd, env=env, check=True,
                   capture_output=True)
    started = time.perf_counter()
    subprocess.run([str(BIN / "mutmut"), "run"], cwd=cwd, env=env, check=False)
    print(f"mutmut ran for {(time.perf_counter() - started) / 60:.1f} min")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only report on the last run")
    parser.add_argument("--baseline", type=float, default=None,
                        help="fail when the overall surviving rate exceeds this fraction")
    parser.add_argument("--modules", nargs="+", help="mutate only these (a part run)")
    parser.add_argument("--tests", nargs="+", help="with --modules: the tests that guard them")
    parser.add_argument("--name", default="part", help="with --modules: the run's name")
    args = parser.parse_args()
    cwd, out = ROOT, OUT
    if args.modules:
        if not args.tests:
            parser.error("--modules needs --tests")
        cwd = ROOT / "mutants-runs" / args.name
        out = ROOT / "docs" / f"mutation-{args.name}.json"
        if not args.report:
            scratch_copy(args.name, args.modules, args.tests)
    if not args.report:
        run(cwd)
    return report(args.baseline, cwd, out)


if __name__ == "__main__":
    sys.exit(main())
