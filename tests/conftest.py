import os

import pytest


def pytest_configure(config):
    # scripts/test.sh runs the suite in pytest-xdist workers: each gets its share of the cores,
    # since workers with a thread per core each would oversubscribe the CPU (torch's OpenMP
    # threads spin while they wait, which slows a CPU-bound test several times over).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved tiny checkpoint per supported family, with its transformers reference."""
    from tests.tiny_models import FAMILIES, make_tiny_model

    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (path, make_tiny_model(path, family))
    return out
