"""/bench end to end on the real default model, both engines: the page in headless Chromium
(Debian's chromium and its chromedriver, driven by Selenium) and POST /bench with references."""

import shutil
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.settings import Settings
from tests.live_server import LiveServer

pytestmark = pytest.mark.e2e
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(Settings())) as live:
        yield live


@pytest.fixture
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,1500"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def test_page_runs_both_engines_and_charts_them(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/bench")
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return window.benchState.ready"))
    engines = {e.get_attribute("value"): e.is_selected()
               for e in browser.find_elements(By.CSS_SELECTOR, "input[name=engine]")}
    assert engines == {"torch": True, "mlx": True}
    browser.execute_script("""
        document.getElementById('max_tokens').value = 8;
        document.getElementById('repeats').value = 1;
        document.getElementById('warmup').value = 0;""")
    browser.find_element(By.ID, "start").click()
    # Both series appear while the run is going, before its summary.
    WebDriverWait(browser, 300).until(lambda d: d.execute_script(
        "const s = window.benchState.series;"
        "return s.torch && s.mlx && s.torch.decode.length > 0 && s.mlx.decode.length > 0"))
    WebDriverWait(browser, 300).until(lambda d: d.execute_script("return window.benchState.summary"))
    state = browser.execute_script("return window.benchState")
    assert state["error"] is None
    for name in ("torch", "mlx"):
        series = state["series"][name]
        assert len(series["decode"]) == 4 and all(v > 0 for v in series["decode"])  # 4 prompts
        assert all(v > 0 for v in series["ttft"]) and series["kv"][-1] > 0
        for chart in ("chart-decode", "chart-ttft"):
            group = browser.find_element(
                By.CSS_SELECTOR, f"#{chart} g.series[data-target='{name}']")
            assert group.get_attribute("data-points") == "4"
            assert len(group.find_elements(By.TAG_NAME, "circle")) == 4
        bars = browser.find_elements(By.CSS_SELECTOR, f"#chart-memory g.series[data-target='{name}'] rect")
        assert len(bars) == 2 and float(bars[0].get_attribute("height")) > 0
    where = browser.find_element(By.ID, "targets-table").text
    assert "torch" in where and "mlx" in where and "CPU" in where
    assert "torch 2." in browser.find_element(By.ID, "versions").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#summary-table tbody tr")
    assert [r.find_element(By.TAG_NAME, "td").text for r in rows] == ["torch", "mlx"]
    assert "torch / mlx: decode" in browser.find_element(By.ID, "ratios").text
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "bench-page.png"))


def test_page_sweeps_two_levels_of_clients_on_both_engines(server, browser, tmp_path):
    """Under load: the page asks for 1 and 2 clients at once on each engine, draws each level
    as it comes (tokens/s, latency and memory against clients, a line per engine), fills the
    levels' table, names each engine's memory figure, and offers the summary as JSON."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.execute_cdp_cmd("Page.setDownloadBehavior",
                            {"behavior": "allow", "downloadPath": str(tmp_path)})
    browser.get(server.url + "/bench")
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return window.benchState.ready"))
    clients = browser.find_element(By.ID, "clients")
    assert not clients.is_displayed() and browser.find_element(By.ID, "repeats").is_displayed()
    Select(browser.find_element(By.ID, "mode")).select_by_value("load")
    assert clients.is_displayed() and not browser.find_element(By.ID, "repeats").is_displayed()
    clients.clear()
    clients.send_keys("1, 2")
    browser.execute_script("document.getElementById('max_tokens').value = 8;")
    browser.find_element(By.ID, "start").click()
    # The first level is drawn before the sweep ends.
    WebDriverWait(browser, 300).until(lambda d: d.execute_script(
        "return window.benchState.levels.length > 0 && !window.benchState.summary"))
    assert browser.find_element(By.CSS_SELECTOR,
                                "#chart-load-tps g.series[data-target='torch']")
    WebDriverWait(browser, 600).until(lambda d: d.execute_script("return window.benchState.summary"))
    state = browser.execute_script("return window.benchState")
    assert state["error"] is None and state["summary"]["mode"] == "load"
    assert [(lv["target"], lv["clients"]) for lv in state["levels"]] == [
        ("torch", 1), ("torch", 2), ("mlx", 1), ("mlx", 2)]
    assert not browser.find_element(By.ID, "chart-decode").is_displayed()
    for name in ("torch", "mlx"):
        for chart, key in (("chart-load-tps", "aggregate_tok_s"),
                           ("chart-load-latency", "ttft_ms_p50"),
                           ("chart-load-latency", "itl_ms_p50"),
                           ("chart-load-memory", "rss_peak_delta_bytes")):
            group = browser.find_element(
                By.CSS_SELECTOR, f"#{chart} g.series[data-target='{name}'][data-key='{key}']")
            assert group.get_attribute("data-points") == "2", (chart, key, name)
            assert len(group.find_elements(By.TAG_NAME, "polyline")) == 1
    rows = [[td.text for td in r.find_elements(By.TAG_NAME, "td")]
            for r in browser.find_elements(By.CSS_SELECTOR, "#load-table tbody tr")]
    assert [r[:2] for r in rows] == [["torch", "1"], ["torch", "2"], ["mlx", "1"], ["mlx", "2"]]
    assert all(float(r[2].replace(",", "")) > 0 for r in rows)
    assert "torch / mlx @ 2 clients" in browser.find_element(By.ID, "load-ratios").text
    where = browser.find_element(By.ID, "targets-table").text
    assert "process RSS" in where and "MLX allocator peak" in where
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "bench-page-load.png"))
    browser.find_element(By.ID, "download").click()
    WebDriverWait(browser, 30).until(lambda d: list(tmp_path.glob("duet-bench-load-*.json")))
    import json

    saved = json.loads(next(tmp_path.glob("duet-bench-load-*.json")).read_text())
    assert saved["levels"] == state["summary"]["levels"]


def test_post_bench_with_references_on_the_real_model(server):
    body = {"model": MODEL, "prompts": ["The capital of France is"], "max_tokens": 8,
            "repeats": 2, "warmup": 0, "references": ["transformers", "mlx-lm"]}
    resp = httpx.post(server.url + "/bench", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert list(data["targets"]) == ["torch", "mlx", "transformers", "mlx-lm"]
    for name, t in data["targets"].items():
        assert t["runs"] == 2 and t["decode_tokens_per_s"]["median"] > 0, name
        assert t["peak_memory_bytes"]["median"] > 0
    assert data["targets"]["torch"]["kv_cache_bytes"]["median"] > 0
    assert data["targets"]["transformers"]["kv_cache_bytes"] is None  # not reported, not 0
    assert {r["completion_tokens"] for r in data["runs"]} == {8}
    assert len({r["prompt_tokens"] for r in data["runs"]}) == 1  # one tokenization for all
    assert set(data["ratios"]) >= {"torch / mlx", "torch / transformers", "mlx / mlx-lm"}
    # The bench's references are gone again; the engines still answer.
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 20, "engine": "mlx"})
    assert "Paris" in chat.json()["choices"][0]["message"]["content"]


def test_stop_on_the_page_stops_the_run_on_the_server(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.server.conftest import MODELS, FakeFactory

    registry = tmp_path / "models.toml"
    registry.write_text(MODELS)
    factory = FakeFactory(token_delay_s=0.01, reply="x" * 64)
    with LiveServer(create_app(Settings(models_file=registry), factory)) as live:
        browser.get(live.url + "/bench")
        WebDriverWait(browser, 30).until(lambda d: d.execute_script("return window.benchState.ready"))
        browser.execute_script("""
            document.getElementById('max_tokens').value = 60;
            document.getElementById('repeats').value = 20;""")
        browser.find_element(By.ID, "start").click()
        WebDriverWait(browser, 60).until(lambda d: d.execute_script(
            "return (window.benchState.series.torch || {decode: []}).decode.length > 0"))
        browser.find_element(By.ID, "stop").click()
        WebDriverWait(browser, 30).until(lambda d: not d.execute_script(
            "return window.benchState.running"))
        assert "Stopped" in browser.find_element(By.ID, "status").text
        import time

        time.sleep(1.0)
        calls = sum(len(e.calls) for e in factory.engines.values())
        time.sleep(1.5)
        assert sum(len(e.calls) for e in factory.engines.values()) == calls < 2 * 4 * 21
