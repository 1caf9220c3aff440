"""A model shipped as a zip of its directory: extracted once into the cache, never re-read;
unsafe or model-less zips refused."""

import zipfile

import pytest

from engines.models.config import ModelSpec
from engines.models.sources import ModelSourceError, resolve_model_dir


def write_zip(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


MODEL = {"config.json": '{"model_type": "bert"}', "1_Pooling/config.json": "{}",
         "tokenizer.json": "{}"}


def spec(path):
    return ModelSpec(id="emb", source=f"path:{path}", task="embed")


def test_a_zip_is_extracted_once_into_the_cache(tmp_path):
    zipped = write_zip(tmp_path / "model.zip", MODEL)
    cache = tmp_path / "cache"
    first = resolve_model_dir(spec(zipped), cache)
    assert first.parent == cache / "models" and (first / "1_Pooling" / "config.json").is_file()
    assert (first / "config.json").read_text() == MODEL["config.json"]
    stamp = (first / "config.json").stat().st_mtime_ns
    zipped.write_bytes(zipped.read_bytes())  # the same size: the same cached directory
    assert resolve_model_dir(spec(zipped), cache) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not extracted again
    assert not list((cache / "models").glob(".partial-*"))


def test_a_zip_of_one_folder_is_read_from_that_folder(tmp_path):
    zipped = write_zip(tmp_path / "m.zip", {f"all-MiniLM/{k}": v for k, v in MODEL.items()})
    model_dir = resolve_model_dir(spec(zipped), tmp_path / "cache")
    assert model_dir.name == "all-MiniLM" and (model_dir / "config.json").is_file()


@pytest.mark.parametrize("files, words", [
    ({**MODEL, "../evil.txt": "x"}, "outside the model directory"),
    ({**MODEL, "/etc/evil": "x"}, "outside the model directory"),
    ({"README.md": "no model here"}, "no config.json"),
])
def test_unsafe_or_model_less_zips_are_refused_and_leave_nothing(tmp_path, files, words):
    zipped = write_zip(tmp_path / "bad.zip", files)
    with pytest.raises(ModelSourceError, match=f"model 'emb': cannot extract .*{words}"):
        resolve_model_dir(spec(zipped), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").iterdir())
    assert not (tmp_path / "evil.txt").exists()


def test_a_broken_zip_is_refused(tmp_path):
    broken = tmp_path / "broken.zip"
    broken.write_bytes(b"PK not really")
    with pytest.raises(ModelSourceError, match="not a readable zip"):
        resolve_model_dir(spec(broken), tmp_path / "cache")
