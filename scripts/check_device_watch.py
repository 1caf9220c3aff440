"""The device watch against a kernel that never ends, on a CUDA GPU: a Triton kernel waits for
a flag nobody sets, and a step's read-back (transfer.ReadBack, the engine's own) waits on it
under a DeviceWatch of --limit seconds. The process must end with exit code 70, every thread's
stack in its output, well before --timeout; the command exits 0 when it did.

  python scripts/check_device_watch.py --limit 5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(limit: float) -> None:
    """The spin and the watched read-back (Triton compiles kernels from a file's source)."""
    import logging

    import torch
    import triton
    import triton.language as tl

    sys.path.insert(0, str(ROOT))
    from engines.torch_engine.device_watch import DeviceWatch
    from engines.torch_engine.transfer import ReadBack

    logging.basicConfig(level=logging.INFO)

    @triton.jit
    def spin(flag, out):
        while tl.atomic_add(flag, 0) == 0:
            pass
        tl.store(out, 1)

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    reads = ReadBack("cuda", watch=DeviceWatch(limit_s=limit))
    spin[(1,)](flag, out)
    print("read back:", reads.finish(reads.start(out)), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=float, default=5.0, help="the watch's limit, seconds")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.limit)
        return 1  # the read-back came back: the kernel ended, which it must not
    started = time.monotonic()
    done = subprocess.run([sys.executable, __file__, "--child", "--limit", str(args.limit)],
                          capture_output=True, text=True, timeout=args.timeout)
    took = time.monotonic() - started
    print(done.stdout + done.stderr)
    ok = done.returncode == 70 and "Thread" in done.stderr
    print(f"exit code {done.returncode} after {took:.1f} s (Triton's compile of the kernel "
          f"included): {'the watch ended the process' if ok else 'NOT ended by the watch'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
