"""`duet bench`: drive the bench (in-process or over HTTP), then show and save its summary as
a rich table, JSON, a markdown table and a PNG chart."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from engines.bench.report import write_marked_section

MiB = 2**20
COLUMNS = ["target", "device", "runs", "TTFT ms", "prefill tok/s", "decode tok/s", "peak MiB",
           "KV cache MiB"]
# Per column: the summary key and how to scale it for display.
_METRICS = [("ttft_s", 1000, 1), ("prefill_tokens_per_s", 1, 0), ("decode_tokens_per_s", 1, 1),
            ("peak_memory_bytes", 1 / MiB, 0), ("kv_cache_bytes", 1 / MiB, 1)]
COLOURS = {"torch": "#e4572e", "mlx": "#1f77b4", "transformers": "#7a7a7a", "mlx-lm": "#6a3d9a"}


class BenchFailed(Exception):
    """The server (or the in-process service) refused the bench; message as the API said it."""


# ---------------------------------------------------------------- the two ways to run it
def events_over_http(url: str, body: dict, timeout: float = 3600) -> Iterator[dict]:
    request = urllib.request.Request(
        url.rstrip("/") + "/bench", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    try:
        resp = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = str(exc)
        raise BenchFailed(f"HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise BenchFailed(f"cannot reach {url}: {exc.reason}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def events_in_process(settings, body: dict, on_event: Callable[[dict], None]) -> None:
    """The same BenchService the server runs, on engines loaded in this process."""
    from .app import create_app
    from .bench import BenchRequest
    from .errors import APIError

    app = create_app(settings)
    service, registry = app.state.bench, app.state.registry

    async def main() -> None:
        try:
            run = await service.prepare(BenchRequest(**body))
        except APIError as exc:
            raise BenchFailed(exc.message) from None
        async for event in run.events():
            on_event(event)

    try:
        asyncio.run(main())
    finally:
        registry.close()


# ---------------------------------------------------------------- showing it
def _cell(stat: dict | None, scale: float, digits: int) -> str:
    if not stat:
        return "-"
    return f"{stat['median'] * scale:.{digits}f} ({stat['p90'] * scale:.{digits}f})"


def table_rows(summary: dict) -> list[list[str]]:
    rows = []
    for name, t in summary["targets"].items():
        info = t.get("info", {})
        device = f"{info.get('device', '?')} {info.get('dtype', '')}".strip()
        if not t.get("runs"):
            rows.append([name, device, "0", t.get("error", "no runs")[:70], "", "", "", ""])
            continue
        rows.append([name, device, str(t["runs"])] + [_cell(t.get(k), s, d) for k, s, d in _METRICS])
    return rows


def ratio_lines(summary: dict) -> list[str]:
    def f(x):
        return "-" if x is None else f"{x:.2f}x"

    return [f"{pair}: decode {f(r['decode_tokens_per_s'])}, prefill {f(r['prefill_tokens_per_s'])}, "
            f"TTFT {f(r['ttft_s'])}, peak memory {f(r['peak_memory_bytes'])}"
            for pair, r in summary["ratios"].items()]


def title(summary: dict) -> str:
    devices = sorted({t["info"]["device_name"] for t in summary["targets"].values() if "info" in t})
    return f"{summary['model']} on {', '.join(devices) or '?'}, {summary['date'][:10]}"


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title(summary), caption="median (p90)")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("target", "device") else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    console = Console(width=150)
    console.print(table)
    for line in ratio_lines(summary):
        console.print("  " + line)


def markdown(summary: dict, image: str | None = None, command: str | None = None) -> str:
    env = summary["environment"]
    prompts = ", ".join(str(p["prompt_tokens"]) for p in summary["prompts"])
    lines = [f"### `duet bench`: {title(summary)}", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += [
        f"{env['host']}. Versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}. "
        f"Preset `{summary['preset'] or 'custom'}` (prompts of {prompts} tokens), "
        f"{summary['max_tokens']} new tokens a run, greedy, end-of-sequence ignored, "
        f"{summary['warmup']} warm-up run(s) then {summary['repeats']} repeats per prompt, "
        f"engines interleaved run by run. Cells: median (p90) over all measured runs.",
        "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    ratios = ratio_lines(summary)
    if ratios:
        lines += ["", "Ratios of medians (a / b):", ""] + [f"- {r}" for r in ratios]
    if image:
        lines += ["", f"![duet bench chart]({image})"]
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    measured = {n: t for n, t in summary["targets"].items() if t.get("runs")}
    names = list(measured)
    colours = [COLOURS.get(n, "#2ca02c") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = [("decode_tokens_per_s", 1, "decode tokens/s"), ("ttft_s", 1000, "time to first token, ms")]
    for ax, (key, scale, label) in zip(axes, panels):
        med = [measured[n][key]["median"] * scale for n in names]
        p90 = [measured[n][key]["p90"] * scale for n in names]
        ax.bar(names, med, color=colours)
        ax.scatter(names, p90, marker="_", s=400, color="black", label="p90", zorder=3)
        ax.set_title(label)
        ax.legend(loc="best", fontsize=8)
    ax = axes[2]
    x = range(len(names))
    peak = [measured[n]["peak_memory_bytes"]["median"] / MiB for n in names]
    kv = [(measured[n]["kv_cache_bytes"] or {"median": 0})["median"] / MiB for n in names]
    ax.bar([i - 0.2 for i in x], peak, width=0.4, color=colours, label="peak")
    ax.bar([i + 0.2 for i in x], kv, width=0.4, color=colours, alpha=0.45, label="KV cache")
    ax.set_xticks(list(x), names)
    ax.set_title("memory, MiB (median)")
    ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"duet bench: {title(summary)}  (bars: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(summary: dict, runs: list[dict], out_dir: Path, stem: str,
                  command: str | None = None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps({**summary, "runs": runs}, indent=2) + "\n")
    chart(summary, paths["png"])
    paths["md"].write_text(markdown(summary, paths["png"].name, command))
    return paths


# ---------------------------------------------------------------- the command
def run_from_cli(args) -> int:
    """`duet bench`: the bench core in-process (engines loaded here) or on a running server."""
    body = {k: v for k, v in {
        "model": args.model, "preset": args.preset, "prompts": args.prompt or None,
        "engines": args.engines.split(",") if args.engines else None,
        "references": args.references.split(",") if args.references else [],
        "max_tokens": args.max_tokens, "repeats": args.repeats, "warmup": args.warmup,
        "clients": [int(n) for n in args.clients.split(",")] if args.clients else None,
    }.items() if v is not None}
    if args.clients and not args.url:
        print("duet bench: --clients (the load mode) runs against a server: give --url",
              file=sys.stderr)
        return 2
    summary: dict = {}
    runs: list[dict] = []

    def on_event(event: dict) -> None:
        kind = event["type"]
        if kind == "run":
            runs.append({k: v for k, v in event.items() if k != "type"})
            which = "warm-up" if event["warmup"] else f"repeat {event['repeat'] + 1}"
            print(f"  {event['target']:<13} prompt {event['prompt'] + 1}, {which}: "
                  f"TTFT {event['ttft_s'] * 1000:.0f} ms, "
                  f"decode {event['decode_tokens_per_s']:.1f} tok/s", flush=True)
        elif kind == "start":
            print(f"duet bench: {event['model']}, {len(event['prompts'])} prompts, "
                  f"{event['repeats']} repeats, {event['max_tokens']} tokens", flush=True)
        elif kind == "level":
            from .bench_load_report import level_line

            print("  " + level_line(event), flush=True)
        elif kind == "target":
            print(f"  {event['name']} loaded in {event['load_s']:.1f} s", flush=True)
        elif kind == "error":
            print(f"  {event['target']} failed: {event['error']['message']}", file=sys.stderr)
        elif kind == "summary":
            summary.update(event)

    try:
        if args.url:
            for event in events_over_http(args.url, body):
                on_event(event)
        else:
            from .bench import BenchRequest
            from .settings import Settings

            BenchRequest(**body)  # a bad flag fails before any engine loads
            overrides = {"models_file": args.config, "device": args.device}
            settings = Settings(preload=False, **{k: v for k, v in overrides.items() if v})
            events_in_process(settings, body, on_event)
    except BenchFailed as exc:
        print(f"duet bench: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # pydantic's ValidationError and bad registry files
        print(f"duet bench: {exc}", file=sys.stderr)
        return 2
    if not summary:
        print("duet bench: the run ended without a summary", file=sys.stderr)
        return 1
    summary.pop("type", None)
    stem = args.name or f"{summary['model']}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    command = "duet bench " + " ".join(args.argv) if args.argv else "duet bench"
    if summary.get("mode") == "load":
        from . import bench_load_report as report

        report.print_summary(summary)
        paths = report.write_outputs(summary, Path(args.out), stem, command)
        render = report.markdown
        ok = not summary["errors"]
    else:
        print_summary(summary)
        paths = write_outputs(summary, runs, Path(args.out), stem, command)
        render = markdown
        ok = all(t.get("runs") for t in summary["targets"].values())
    if args.md_section:
        md = Path(args.md_section)
        image = os.path.relpath(paths["png"], md.parent)
        write_marked_section(md, stem, render(summary, image, command), tag="duet-bench")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if ok else 1
