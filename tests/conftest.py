import pytest


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved tiny checkpoint per supported family, with its transformers reference."""
    from tests.tiny_models import FAMILIES, make_tiny_model

    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (path, make_tiny_model(path, family))
    return out
