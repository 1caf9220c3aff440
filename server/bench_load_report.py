"""`duet bench --clients`: the load mode's summary as a rich table, JSON, a markdown table and a
PNG chart of aggregate tokens/s and latency against the number of clients, a line per engine."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ["target", "clients", "tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "peak batch",
           "peak KV MiB", "RSS peak Δ MiB", "own meter MiB", "sends spread ms"]
COLOURS = {"torch": "#e4572e", "mlx": "#1f77b4", "transformers": "#7a7a7a", "mlx-lm": "#6a3d9a"}


def cell(value, spec: str, scale: float = 1.0) -> str:
    """A figure, or '-' where the level has none (no stream had two chunks, say; a reference's
    batch has no per-client latency)."""
    return "-" if value is None else format(value if scale == 1.0 else value * scale, spec)


def level_line(lv: dict) -> str:
    return (f"{lv['target']:<6} {lv['clients']:>3} clients: {lv['aggregate_tok_s']:,.1f} tok/s, "
            f"TTFT p50 {cell(lv['ttft_ms_p50'], '.0f')} ms, "
            f"ITL p50 {cell(lv['itl_ms_p50'], '.1f')} ms, peak batch {cell(lv['peak_batch'], 'd')}")


def table_rows(summary: dict) -> list[list[str]]:
    mib = 1 / 2**20
    return [[lv["target"], str(lv["clients"]), f"{lv['aggregate_tok_s']:,.1f}",
             f"{cell(lv['ttft_ms_p50'], '.0f')} / {cell(lv['ttft_ms_p99'], '.0f')}",
             f"{cell(lv['itl_ms_p50'], '.1f')} / {cell(lv['itl_ms_p99'], '.1f')}",
             cell(lv["peak_batch"], "d"), cell(lv["peak_kv_used_bytes"], ".1f", mib),
             cell(lv.get("rss_peak_delta_bytes"), ".1f", mib),
             cell(lv.get("engine_peak_memory_bytes") or None, ".0f", mib),
             cell(lv["sent_spread_ms"], ".0f")]
            for lv in summary["levels"]]


def title(summary: dict) -> str:
    devices = sorted({t["info"]["device_name"] for t in summary["targets"].values()
                      if "device_name" in t.get("info", {})})
    return f"{summary['model']} under load on {', '.join(devices) or '?'}, {summary['date'][:10]}"


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title(summary))
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "target" else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    console = Console(width=150)
    console.print(table)
    for pair, ratio in summary["ratios"].items():
        console.print(f"  {pair}: {ratio:.2f}x aggregate tok/s")
    for name, message in summary.get("errors", {}).items():
        console.print(f"  {name} failed: {message}")


def markdown(summary: dict, image: str | None = None, command: str | None = None) -> str:
    lines = [f"### `duet bench --clients`: {title(summary)}", ""]
    if command:
        lines += [f"`{command}`", ""]
    env = summary["environment"]
    lines += [
        f"{env['host']}. Versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}. "
        f"Each level's clients stream at once through the server's HTTP API, "
        f"{summary['max_tokens']} new tokens each, greedy, end-of-sequence ignored; engines in "
        f"turn; references: one batch of the same prompts per level. RSS peak Δ: the engine "
        f"process's resident-set peak over the level (sampled) less what it held as the level "
        f"began, the same measure for each engine; own meter: "
        + "; ".join(f"{name} {t['info'].get('memory_measure') or '-'}"
                    for name, t in summary["targets"].items()
                    if t["info"].get("kind") == "engine") + ".",
        "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    if summary["ratios"]:
        lines += ["", "Aggregate tok/s ratios: " + "; ".join(
            f"{pair}: {ratio:.2f}x" for pair, ratio in summary["ratios"].items()) + "."]
    if image:
        lines += ["", f"![duet bench under load]({image})"]
    return "\n".join(lines) + "\n"


def chart(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in dict.fromkeys(lv["target"] for lv in summary["levels"]):
        levels = [lv for lv in summary["levels"] if lv["target"] == name]
        clients = [lv["clients"] for lv in levels]
        colour = COLOURS.get(name, "#2ca02c")
        axes[0].plot(clients, [lv["aggregate_tok_s"] for lv in levels], "o-", color=colour,
                     label=name)
        nan = float("nan")  # a point a level has no figure for is left out of its line
        axes[1].plot(clients, [lv["ttft_ms_p50"] or nan for lv in levels], "o-", color=colour,
                     label=f"{name} TTFT p50")
        axes[1].plot(clients, [lv["itl_ms_p50"] or nan for lv in levels], "s--",
                     color=colour, label=f"{name} ITL p50")
    axes[0].set_title("aggregate tokens/s")
    axes[1].set_title("latency, ms")
    for ax in axes:
        ax.set_xlabel("clients")
        ax.set_xscale("log", base=2)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"duet bench: {title(summary)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(summary: dict, out_dir: Path, stem: str,
                  command: str | None = None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    chart(summary, paths["png"])
    paths["md"].write_text(markdown(summary, paths["png"].name, command))
    return paths
