"""Device and dtype choices, with the accelerators faked."""

import pytest
import torch

from engines.device import (
    CudaMeter,
    MPSMeter,
    RSSMeter,
    choose_decode_dtype,
    choose_device,
    choose_dtype,
    cuda_visible,
    free_memory_bytes,
    memory_meter,
)


@pytest.mark.parametrize(
    "mps, cuda, expected", [(True, True, "mps"), (False, True, "cuda"), (False, False, "cpu")]
)
def test_auto_prefers_mps_then_cuda_then_cpu(monkeypatch, mps, cuda, expected):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert choose_device("auto") == expected


def test_explicit_device_that_is_missing_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="mps"):
        choose_device("mps")
    with pytest.raises(ValueError, match="CUDA"):
        choose_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        choose_device("tpu")
    assert choose_device("cpu") == "cpu"


def test_a_gpu_shows_in_the_drivers_device_files_unless_hidden(tmp_path):
    assert not cuda_visible(tmp_path, {})
    (tmp_path / "nvidiactl").touch()
    assert cuda_visible(tmp_path, {}) and cuda_visible(tmp_path, {"CUDA_VISIBLE_DEVICES": "1"})
    assert not cuda_visible(tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert not cuda_visible(tmp_path, {"CUDA_VISIBLE_DEVICES": "-1"})


def test_dtype_defaults_per_device():
    assert choose_dtype("auto", "cuda") == "bfloat16"
    assert choose_dtype("auto", "mps") == "float16"
    assert choose_dtype("auto", "cpu") == "float32"
    assert choose_dtype("float16", "cpu") == "float16"
    # a generating engine decodes faster in bf16 on the CPU too (half the weight bytes)
    assert choose_decode_dtype("auto", "cpu") == "bfloat16"
    assert choose_decode_dtype("float32", "cpu") == "float32"
    assert choose_decode_dtype("auto", "cuda") == "bfloat16"
    assert choose_decode_dtype("auto", "mps") == "float16"


def test_memory_meter_per_device():
    assert isinstance(memory_meter("cuda"), CudaMeter)
    assert isinstance(memory_meter("mps"), MPSMeter)
    meter = memory_meter("cpu")
    assert isinstance(meter, RSSMeter)
    meter.reset()
    before = meter.peak_bytes()
    block = touched(64 * 2**20)
    meter.sample()
    block.close()
    assert meter.peak_bytes() >= before + 60 * 2**20


def resident() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def touched(size: int):
    """Fresh pages from the kernel, each written once, so resident now. A heap allocation may
    reuse pages the process already holds (seen in CI: the RSS did not move)."""
    import mmap

    block = mmap.mmap(-1, size)
    block[:: mmap.PAGESIZE] = b"x" * (size // mmap.PAGESIZE)
    return block


SPIKE = 256 * 2**20


def test_the_cpu_meter_catches_a_peak_between_the_ends_of_a_request():
    """RSS has no resettable peak: a spike that is gone by the end of the request is only seen
    because the runtime reads the meter after every step."""
    from engines.base import RequestStats, SamplingParams
    from engines.fake import FakeEngine

    seen = []

    class Spiking(FakeEngine):
        def before_token(self, request_no, index):
            if index == 1:  # resident now; gone before the request ends
                self.buffer = touched(SPIKE)
                seen.append(resident())
            elif index == 2:
                self.buffer.close()

    engine = Spiking(reply="abcd")
    engine.meter = RSSMeter()
    baseline = resident()  # not through the meter under test
    events = list(engine.generate([1, 2], SamplingParams(max_tokens=8)))
    stats = events[-1]
    assert isinstance(stats, RequestStats) and stats.completion_tokens == 5
    assert seen[0] >= baseline + SPIKE * 0.9  # the spike was real
    assert resident() < baseline + SPIKE // 2  # and really went away
    assert stats.peak_memory_bytes >= baseline + SPIKE * 0.9


def test_the_cpu_meter_sees_what_a_requests_last_step_allocated():
    """The meter is reset as each step starts, so a spike that lasts past a step is seen then;
    one that appears in the request's last step is seen only by the reading after that step."""
    from engines.base import RequestStats, SamplingParams
    from engines.fake import FakeEngine

    seen = []

    class GrowingAtTheEnd(FakeEngine):
        def before_token(self, request_no, index):
            if index == 4:  # the end-of-sequence step of "abcd"
                self.buffer = touched(SPIKE)
                seen.append(resident())

    engine = GrowingAtTheEnd(reply="abcd")
    engine.meter = RSSMeter()
    baseline = resident()  # not through the meter under test
    events = list(engine.generate([1, 2], SamplingParams(max_tokens=8)))
    engine.buffer.close()
    stats = events[-1]
    assert isinstance(stats, RequestStats) and stats.completion_tokens == 5
    assert seen[0] >= baseline + SPIKE * 0.9
    assert stats.peak_memory_bytes >= baseline + SPIKE * 0.9


def test_the_cuda_meter_reads_the_allocators_peak(monkeypatch):
    """The peak of allocated bytes (what max_memory_allocated gives), read from the nested
    statistics without their flattening; on a GPU, a tensor made after a reset shows in it."""
    import torch

    asked = []

    def stats(device):
        asked.append(device)
        return {"allocated_bytes": {"all": {"peak": 123, "current": 5}, "large_pool": {"peak": 7}},
                "reserved_bytes": {"all": {"peak": 999}}}

    meter = CudaMeter("cuda:1")
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    assert meter.peak_bytes() == 123 and asked == ["cuda:1"]
    monkeypatch.undo()
    if torch.cuda.is_available():
        meter = CudaMeter("cuda")
        meter.reset()
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        assert meter.peak_bytes() == torch.cuda.max_memory_allocated() >= block.numel()


def test_cuda_memory_the_allocator_holds_unused_counts_as_free(monkeypatch):
    """A quantized model frees its float weights into the allocator's cache: the KV pool's
    sizing must see them as free, not only what the driver reports."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 14 << 30)
    assert free_memory_bytes("cuda:0") == (10 + 16) << 30
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 14 << 30)
    assert free_memory_bytes("cuda:0") == 10 << 30
