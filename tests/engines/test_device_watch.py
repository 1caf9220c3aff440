"""A wait on the device that never ends stops the engine's process (device_watch), where it
would otherwise hold its requests, and all after them, for ever."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from engines.torch_engine.device_watch import DeviceWatch
from engines.torch_engine.transfer import ReadBack

ROOT = Path(__file__).resolve().parents[2]


def test_only_a_wait_past_the_limit_is_reported_once_with_what_waited():
    stuck = []
    watch = DeviceWatch(limit_s=0.4, on_stuck=stuck.append)
    with watch.waiting("a quick read-back"):
        time.sleep(0.05)
    time.sleep(0.5)
    assert stuck == []
    with watch.waiting("a step's read-back"):
        time.sleep(1.0)
    time.sleep(0.3)
    assert stuck == ["a step's read-back waited more than 0.4 s for the device"]


class SlowEvent:
    """A CUDA event's stand-in whose synchronize() takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def synchronize(self):
        time.sleep(self.seconds)


def test_a_steps_read_back_waits_under_the_watch():
    stuck = []
    readback = ReadBack("cpu", watch=DeviceWatch(limit_s=0.3, on_stuck=stuck.append))
    assert readback.finish((torch.tensor([4, 5]), SlowEvent(0.01))) == [4, 5]
    assert readback.finish((torch.tensor([6]), SlowEvent(1.0))) == [6]
    assert stuck == ["a step's read-back waited more than 0.3 s for the device"]
    assert readback.finish([7]) == [7]  # read at once (the CPU's): nothing to wait on


def test_a_stuck_wait_ends_the_process_with_every_threads_stack():
    code = textwrap.dedent("""
        import logging, time
        logging.basicConfig()
        from engines.torch_engine.device_watch import DeviceWatch
        with DeviceWatch(limit_s=0.3).waiting("a step's read-back"):
            time.sleep(30)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 70 and time.monotonic() - started < 20
    assert "a step's read-back waited more than 0.3 s for the device" in done.stderr
    assert "the engine's process stops" in done.stderr
    assert 'File "<string>"' in done.stderr  # the waiting thread's stack, printed
