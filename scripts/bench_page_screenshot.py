#!/usr/bin/env python3
"""A screenshot of the /bench page after a sweep under load, for docs/benchmarks.md.

Drives a running duet server's page in headless Chromium (Debian's chromium and
chromium-driver, as the page's test does): picks the engines and references, the "under load"
mode and the client levels, presses Start, waits for the summary, saves a PNG and the
summary's JSON.

  python scripts/bench_page_screenshot.py --url http://127.0.0.1:8000 --clients 1,4 \\
      --engines torch,mlx --references transformers --max-tokens 32 \\
      --out docs/bench/bench-page-load-cpu.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", default="1,4")
    p.add_argument("--engines", default="torch,mlx")
    p.add_argument("--references", default="")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, required=True, help="the PNG; its JSON goes beside it")
    args = p.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,1400"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(args.url + "/bench")
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return window.benchState.ready"))
        wanted = {"engine": args.engines.split(","), "reference": args.references.split(",")}
        for name, values in wanted.items():
            for box in driver.find_elements(By.CSS_SELECTOR, f"input[name={name}]"):
                if box.is_enabled() and box.is_selected() != (box.get_attribute("value") in values):
                    box.click()
        Select(driver.find_element(By.ID, "mode")).select_by_value("load")
        clients = driver.find_element(By.ID, "clients")
        clients.clear()
        clients.send_keys(args.clients)
        driver.execute_script(f"document.getElementById('max_tokens').value = {args.max_tokens};")
        driver.find_element(By.ID, "start").click()
        WebDriverWait(driver, args.timeout).until(
            lambda d: d.execute_script("return !window.benchState.running && "
                                       "(window.benchState.summary || window.benchState.error)"))
        state = driver.execute_script("return window.benchState")
        if state["error"]:
            print(f"the bench failed: {state['error']}", file=sys.stderr)
            return 1
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # The whole page in one picture: a window as tall as the document, with room for
        # the window's own frame.
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1200, height + 200)
        driver.save_screenshot(str(args.out))
        args.out.with_suffix(".json").write_text(json.dumps(state["summary"], indent=2) + "\n")
        for lv in state["summary"]["levels"]:
            print(f"{lv['target']:<12} {lv['clients']:>3} clients {lv['aggregate_tok_s']:>9,.1f} tok/s")
        print(f"wrote {args.out}")
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
