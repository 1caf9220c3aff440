"""faulthandler for duet's processes: on where there is a stderr, a quiet no where there is
none (a daemon's), and a crash then prints the threads' stacks."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_crash_prints_the_stacks_where_there_is_a_stderr():
    done = _python("import ctypes\nfrom engines import crash_stacks\n"
                   "print(crash_stacks.enable(), flush=True)\nctypes.string_at(0)")
    assert done.stdout.strip() == "True" and done.returncode != 0
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "line 4 in <module>" in done.stderr  # where the main thread was


def test_no_stderr_is_no_error():
    done = _python("import sys\nsys.stderr = None\nfrom engines import crash_stacks\n"
                   "print(crash_stacks.enable())")
    assert done.returncode == 0 and done.stdout.strip() == "False"
