"""Host arrays to the device through pinned buffers kept between steps (transfer.Staging)."""

import numpy as np
import pytest
import torch

from engines.torch_engine.transfer import Staging

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_staged_arrays_arrive_whole_whatever_their_size_and_turn(device):
    """Arrays of growing and shrinking sizes and of two dtypes, sent one after another
    without reading them in between (a refilled buffer must not overwrite a copy in flight):
    each arrives as it was sent."""
    staging = Staging(device)
    rng = np.random.default_rng(0)
    sent, arrived = [], []
    for rows in (3, 64, 1, 128, 128, 7, 200):
        values = rng.integers(0, 256, (rows, 6144), dtype=np.uint8)
        if rows % 2:
            values = rng.integers(-2**40, 2**40, (rows, 5), dtype=np.int64)
        sent.append(values.copy())
        arrived.append(staging.to_device(values))
        values[:] = 0  # the caller may reuse its array at once
    for values, tensor in zip(sent, arrived):
        assert tensor.device.type == device
        assert np.array_equal(tensor.cpu().numpy(), values)
