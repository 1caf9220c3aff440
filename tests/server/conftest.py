import dataclasses
import importlib.util
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeClassifier, FakeEmbedder, FakeEngine
from engines.memory import Estimate
from server.app import create_app
from server.settings import Settings

MODELS = """
[[models]]
id = "tiny"
source = "path:/unused"
engine = "torch"
context_length = 512

[[models]]
id = "sorter"
source = "path:/unused"
task = "classify"

[[models]]
id = "embedder"
source = "path:/unused"
task = "embed"
"""


class FakeFactory:
    names = ("torch", "mlx")

    def __init__(self, available=("torch", "mlx"), engine_class=FakeEngine, *,
                 weights_bytes=1000, kv_bytes=1000, **engine_kwargs):
        self.weights_bytes, self.kv_bytes = weights_bytes, kv_bytes
        self._available = set(available)
        self.engine_class = engine_class
        self.engine_kwargs = engine_kwargs
        self.engines: dict[str, FakeEngine] = {}

    def available(self, name):
        return name in self._available

    def estimate(self, name, spec):
        return Estimate(self.weights_bytes, 1000, spec.context_length)

    def default_memory_budget(self):
        return 1 << 40

    def prepare(self, name):
        pass  # nothing to import ahead of time

    def create(self, name, spec, kv_cache_limit=None):
        if spec.task in ("classify", "embed"):
            engine = FakeClassifier(name) if spec.task == "classify" else FakeEmbedder(name)
            self.engines[f"{spec.id}-{name}"] = engine
            return engine
        engine = self.engine_class(name, context_length=spec.context_length, **self.engine_kwargs)
        # what the memory budget counts: the weights, and its default KV cache (None: all it
        # may take) within what the budget left it, as the engines size theirs
        kv = self.kv_bytes if kv_cache_limit is None else min(
            kv_cache_limit, self.kv_bytes or kv_cache_limit)
        engine.info = dataclasses.replace(engine.info, weights_bytes=self.weights_bytes,
                                          kv_cache_bytes=kv)
        self.engines[name] = engine
        return engine


@pytest.fixture
def models_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(MODELS)
    return path


@pytest.fixture
def make_client(models_file):
    def make(factory=None, **settings):
        factory = factory or FakeFactory()
        app = create_app(Settings(models_file=models_file, **settings), factory)
        client = TestClient(app)
        client.factory = factory
        return client

    return make


@pytest.fixture
def client(make_client):
    with make_client() as c:
        yield c


def script(name: str):
    """A module of scripts/ (a folder of scripts, not a package), loaded from its file: the
    server-facing helpers the benchmarks share."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"duet_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
