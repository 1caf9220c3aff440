import os
from pathlib import Path

import pytest

# The suite runs hundreds of servers and engines in one process: gc.freeze() after each load
# (gc_pauses.settle) would keep every test's garbage for good. Its tests turn it on where they
# check it, in processes of their own.
os.environ["DUET_GC_FREEZE"] = "0"

if os.environ.get("DUET_TINY_MODELS"):
    # Under mutation testing this module is imported once, by the process every per-mutant
    # pytest session is forked from: importing the reference models' code here (3 s) spares
    # each mutant that cost.
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401


def pytest_configure(config):
    # scripts/test.sh runs the suite in pytest-xdist workers: each gets its share of the cores,
    # since workers with a thread per core each would oversubscribe the CPU (torch's OpenMP
    # threads spin while they wait, which slows a CPU-bound test several times over).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        share = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(share)
        # MLX's CPU products in OpenBLAS (engines/mlx_blas.py): its pool is sized when it
        # loads, from this.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(share))
    from engines.mlx_blas import preload

    preload()  # before any test module imports mlx.core


# The longest files, longest first (seconds on this machine, 2026-11-23). scripts/test.sh hands
# whole files to its workers in collection order (--no-loadscope-reorder; xdist's own order, by
# number of tests, left a 70 s file to start after four minutes, alone at the end).
LONGEST_FIRST = (
    "tests/test_project.py",  # 65-80: pip sets up a serving environment
    "tests/e2e/test_concurrency.py",  # 70
    "tests/e2e/test_classifications.py",  # 57
    "tests/engines/test_gguf_convert.py",  # 50
    "tests/e2e/test_bench_page.py",  # 45
    "tests/e2e/test_openai_client.py",  # 44
    "tests/e2e/test_embeddings.py",  # 32 (2026-11-23, under load)
    "tests/engines/test_embeddings.py",  # 24 (2026-11-23, under load)
    "tests/e2e/test_tensor_parallel.py",  # 35 (2026-11-25): the default model over 3 ranks
    "tests/engines/test_tensor_parallel.py",  # 30 (2026-11-25): a rank process per engine
    "tests/engines/test_cuda_kernels.py",  # 22
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved tiny checkpoint per supported family, with its transformers reference."""
    from tests.tiny_models import FAMILIES, load_tiny_model, make_tiny_model

    # Mutation testing starts a pytest session per mutant: it builds the models once into
    # DUET_TINY_MODELS (scripts/mutation.py), and each session loads them from there.
    kept = os.environ.get("DUET_TINY_MODELS")
    out = {}
    for family in FAMILIES:
        if kept and (Path(kept) / family / "reference.pt").exists():
            out[family] = (Path(kept) / family, load_tiny_model(Path(kept) / family))
            continue
        path = Path(kept) / family if kept else tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (path, make_tiny_model(path, family))
        if kept:
            import torch

            torch.save(out[family][1], path / "reference.pt")
    return out
