"""Extract a zip of a model directory once into the model cache.

A model shipped as a zip (sentence-transformers' files, say) is unpacked into a directory of
its own, which appears whole or not at all (engines/models/atomic_dir.py); later starts find it
complete and read nothing from the zip. Members that would land outside the directory
(absolute paths, '..') are refused, and a zip holding one top-level folder is read from that
folder.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path, PurePosixPath

from .atomic_dir import build_atomically

COMPLETE_MARKER = "duet-complete.json"
EXTRACTOR_VERSION = 1


def is_complete(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


def model_root(target: Path) -> Path:
    """The directory with config.json: the extracted one, or its only folder."""
    if (target / "config.json").is_file():
        return target
    folders = [p for p in target.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if len(folders) == 1 and (folders[0] / "config.json").is_file():
        return folders[0]
    raise ValueError("the zip holds no config.json (at its top or in its only folder)")


def _safe_member(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise ValueError(f"the zip member '{name}' would land outside the model directory")
    return path


def _extract(zip_path: Path, out: Path) -> None:
    with zipfile.ZipFile(zip_path) as zf:
        for info in zf.infolist():
            rel = _safe_member(info.filename)
            dest = out.joinpath(*rel.parts)
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def extract_model_zip(zip_path: Path, target: Path) -> Path:
    """The model directory inside target, extracting zip_path there first if needed."""

    def build(tmp: Path) -> None:
        try:
            _extract(zip_path, tmp)
        except zipfile.BadZipFile as exc:
            raise ValueError(f"not a readable zip file: {exc}") from exc
        model_root(tmp)  # refuse a zip without a model before it is trusted
        (tmp / COMPLETE_MARKER).write_text(json.dumps(
            {"source": str(zip_path), "bytes": zip_path.stat().st_size,
             "extractor_version": EXTRACTOR_VERSION}))

    return model_root(build_atomically(target, build, is_complete))
