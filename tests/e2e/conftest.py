"""What the end-to-end tests share."""

import pytest

from server.settings import REPO_MODELS_FILE

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def float_models_file(tmp_path_factory):
    """The repository's registry with the default model served from its float weights, in
    float32.

    Served by default (bfloat16 on the CPU, its GGUF's 4 bits kept), activations are rounded to
    bfloat16, so a float32 difference of one rounding step (attention over a prompt prefilled in
    chunks or in one piece; the other engine's own quantized format) can move a logprob in its
    third decimal or flip a near-tie some tokens later. Tests that compare exact numbers across
    engines, references or batches compare the float model."""
    line = f'id = "{DEFAULT_MODEL}"\n'
    text = REPO_MODELS_FILE.read_text()
    start = text.index(line)
    table, rest = text[start:].split("\n\n", 1)
    assert 'dtype = "auto"' in table
    table = table.replace('dtype = "auto"', 'dtype = "float32"') + '\nquantize = "none"'
    path = tmp_path_factory.mktemp("models") / "models.toml"
    path.write_text(text[:start] + table + "\n\n" + rest)
    return path
