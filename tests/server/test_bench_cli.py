"""`duet bench`: against a running server (--url) and in-process, with its table, JSON, markdown
and PNG."""

import json

import pytest

from server.app import create_app
from server.cli import main
from server.settings import Settings
from tests.live_server import LiveServer
from tests.server.conftest import FakeFactory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def fake_server(models_file):
    with LiveServer(create_app(Settings(models_file=models_file), FakeFactory())) as live:
        yield live


def test_bench_against_a_server_writes_json_markdown_png_and_a_section(fake_server, tmp_path,
                                                                       capsys):
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\nkept\n")
    args = ["bench", "--url", fake_server.url, "--model", "tiny", "--max-tokens", "8",
            "--repeats", "2", "--out", str(tmp_path / "out"), "--name", "run1",
            "--md-section", str(doc)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "torch / mlx" in out and "median (p90)" in out
    data = json.loads((tmp_path / "out" / "run1.json").read_text())
    assert set(data["targets"]) == {"torch", "mlx"} and data["targets"]["mlx"]["runs"] == 8
    assert len(data["runs"]) == 2 * (1 + 8)  # warm-up and measured runs, both engines
    md = (tmp_path / "out" / "run1.md").read_text()
    assert "| torch | cpu none | 8 |" in md and "![duet bench chart](run1.png)" in md
    png = (tmp_path / "out" / "run1.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    from matplotlib.image import imread

    height, width, _ = imread(tmp_path / "out" / "run1.png").shape
    assert width > 1000 and height > 400
    # A second run replaces its section and leaves the rest of the file alone.
    assert main(args) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    assert text.count("<!-- duet-bench:run1 -->") == 1 and "](../out/run1.png)" in text


def test_bench_load_mode_writes_a_table_json_markdown_and_a_chart(fake_server, tmp_path,
                                                                  capsys):
    args = ["bench", "--url", fake_server.url, "--model", "tiny", "--max-tokens", "4",
            "--clients", "1,2", "--engines", "torch", "--out", str(tmp_path), "--name", "load"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 clients:" in out and "TTFT p50 / p99 ms" in out
    data = json.loads((tmp_path / "load.json").read_text())
    assert data["mode"] == "load" and [lv["clients"] for lv in data["levels"]] == [1, 2]
    assert all(lv["tokens"] == 4 * lv["clients"] for lv in data["levels"])
    assert "| torch | 2 |" in (tmp_path / "load.md").read_text()
    assert (tmp_path / "load.png").read_bytes().startswith(PNG_MAGIC)
    # In-process there is no server for the clients to reach: said, not attempted.
    assert main(["bench", "--clients", "2", "--out", str(tmp_path)]) == 2
    assert "give --url" in capsys.readouterr().err


def test_bench_reports_the_servers_error(fake_server, tmp_path, capsys):
    assert main(["bench", "--url", fake_server.url, "--repeats", "1000",
                 "--out", str(tmp_path)]) == 2
    assert "repeats is 1000" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_bench_in_process_runs_both_engines_and_both_references(tiny_dirs, tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    path, _ = tiny_dirs["llama"]
    registry = tmp_path / "models.toml"
    registry.write_text(f'[[models]]\nid = "tiny-llama"\nsource = "path:{path}"\n'
                        f'engine = "torch"\ndtype = "float32"\ncontext_length = 128\n')
    assert main(["bench", "--config", str(registry), "--device", "cpu", "--engines", "torch,mlx",
                 "--references", "transformers,mlx-lm", "--prompt", "hello there",
                 "--max-tokens", "6", "--repeats", "2", "--warmup", "1",
                 "--out", str(tmp_path / "out"), "--name", "tiny"]) == 0
    data = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert list(data["targets"]) == ["torch", "mlx", "transformers", "mlx-lm"]
    for name, t in data["targets"].items():
        assert t["runs"] == 2 and t["decode_tokens_per_s"]["median"] > 0, name
        assert t["info"]["device"] == "cpu" and t["info"]["dtype"] == "float32"
    assert {r["completion_tokens"] for r in data["runs"]} == {6}
    assert len({r["prompt_tokens"] for r in data["runs"]}) == 1  # one tokenization for all
    assert "torch / transformers" in data["ratios"] and "mlx / mlx-lm" in data["ratios"]
    assert "transformers loaded in" in capsys.readouterr().out


def test_bench_rejects_a_bad_flag_before_loading_anything(tmp_path, capsys):
    assert main(["bench", "--repeats", "0", "--out", str(tmp_path)]) == 2
    assert "repeats" in capsys.readouterr().err


def test_a_load_level_of_several_rounds_sends_each_clients_requests_in_turn(models_file):
    """rounds: each client's next request goes once its last one ended, so a level of 2
    clients and 3 rounds of 4 tokens at 20 ms a token lasts about 3 requests' time, and every
    request's tokens are counted."""
    from engines.bench import load

    factory = FakeFactory(token_delay_s=0.02, reply="z" * 40)
    with LiveServer(create_app(Settings(models_file=models_file), factory)) as live:
        prompts = [[104, 105] * 4, [106] * 8]  # the fake engine's tokens are bytes
        one = load.run_level(live.url, "tiny", 2, 8, 4, procs=1, prompts=prompts)
        three = load.run_level(live.url, "tiny", 2, 8, 4, procs=1, prompts=prompts, rounds=3)
    assert one["tokens"] == 2 * 4 and three["tokens"] == 2 * 3 * 4
    assert three["clients"] == 2 and three["peak_batch"] <= 2
    assert three["wall_s"] >= 2 * one["wall_s"]  # all at once, it would take about one's
