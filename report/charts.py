"""Charts: PNGs beside report.md (`make report`), drawn from the same latest runs and pairings
as the table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from report.results_table import (
    busy_host,
    latest_runs,
    optimized_runs,
    over_tolerance,
    row_label,
    script_label,
    why_not_compared,
    within_noise,
)

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn, not for the table
    from matplotlib.figure import Figure



KIND_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def _setup(rec: dict) -> str:
    return f"{rec.get('device')}, world {rec.get('world_size')}, size {rec.get('size')}"


def _setups(recs: list[dict]) -> tuple[str, list[str]]:
    """A chart's title part and each run's label suffix: the one setup they share in the title,
    or each run's own beside it when they differ."""
    if len({_setup(r) for r in recs}) == 1:
        return _setup(recs[0]), [""] * len(recs)
    return "runs on several setups", [f" [{_setup(r)}]" for r in recs]


GREEN, RED, GREY = "#55a868", "#c44e52", "#8c8c8c"
BUSY_HATCH = "////"  # a speedup timed on a busy host: not the technique's (results_table)


def _ratio_label(ax, y: float, ratio: float, text: str) -> None:
    """`text` at the end of the bar `ratio` long. A bar shorter than 1.0 ends left of the 1.0
    line: its label, which starts there, covers the line with a white box drawn above it, so
    that the line never runs through the figures."""
    box = dict(facecolor="white", edgecolor="none", pad=0.5) if ratio < 1.0 else None
    ax.text(ratio, y, text, va="center", fontsize=8, bbox=box, zorder=3)


def _speedup_chart(plt, records: list[dict]) -> Figure | None:
    """Speedup and memory ratio of every optimized run over its baseline: green better, red
    worse, grey neither (over tolerance: it does not train the same model; `~`: within noise);
    a speedup hatched, with `(busy host)`, where either run of the pair was timed on a busy
    host. Each ratio is written at its bar's end. A run with no pair says why where its bars
    would be."""
    rows = optimized_runs(records)
    compared = [why_not_compared(rec, base) is None for rec, base in rows]
    if not any(compared):
        return None
    setup, suffixes = _setups([r for r, _ in rows])
    labels = [f"{r['folder']}  {row_label(r)}" + (f" @{r['link']}" if r.get("link") else "")
              + suffix for (r, _), suffix in zip(rows, suffixes, strict=True)]
    # constrained layout sets the suptitle above the panels' titles at any height (tight_layout
    # keeps it 2% of the height below the top, into the titles of a tall figure) and keeps the
    # left panel's last tick label off the right panel's first
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True,
                             layout="constrained")
    speedups, memories, any_busy = [], [], False
    for y, ((rec, base), paired) in enumerate(zip(rows, compared, strict=True)):
        if not paired:
            axes[0].text(0, y, f" not compared: {why_not_compared(rec, base)}", va="center",
                         fontsize=8, color=GREY)
            continue
        speedup, memory = base["step_ms"] / rec["step_ms"], rec["peak_mem_mb"] / base["peak_mem_mb"]
        over, noise = over_tolerance(rec, base), within_noise(rec, base)
        busy = " (busy host)" if busy_host(rec) or busy_host(base) else ""
        any_busy |= bool(busy)
        tail = " over tolerance" if over else ""
        axes[0].barh(y, speedup, color=GREY if over or noise else GREEN if speedup >= 1 else RED,
                     hatch=BUSY_HATCH if busy else None, edgecolor="white" if busy else None)
        _ratio_label(axes[0], y, speedup, f" {'~' if noise else ''}{speedup:.2f}x{busy}{tail}")
        axes[1].barh(y, memory, color=GREY if over else GREEN if memory <= 1 else RED)
        _ratio_label(axes[1], y, memory, f" {memory:.2f}x{tail}")
        speedups.append(speedup)
        memories.append(memory)
    for ax, values, title in ((axes[0], speedups, "speedup over its baseline (step time)"),
                              (axes[1], memories, "peak memory / its baseline's")):
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max([*values, 1.0]) * (1.4 if any_busy and ax is axes[0] else 1.2))
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{setup}: green is better, red worse; grey: over tolerance, or within noise (~)"
                 + ("; hatched: timed on a busy host" if any_busy else ""))
    return fig


def _compression_chart(plt, records: list[dict]) -> Figure | None:
    runs = [r for r in latest_runs(records)
            if r.get("folder") == "02_compression" and r.get("status") == "ok"]
    if not runs:
        return None
    labels = [script_label(r) + (f" @{r['link']}" if r.get("link") else "") for r in runs]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(runs) + 1.4))
    ax.barh(range(len(runs)), [r["comm_mb"] for r in runs], color="#4c72b0")
    for y, r in enumerate(runs):
        ax.text(r["comm_mb"], y, f" {r['comm_mb']:.2f} MB", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB each rank sends per step")
    ax.set_title("02_compression: gradient bytes on the wire")
    ax.set_xlim(0, max(r["comm_mb"] for r in runs) * 1.25)
    return _laid_out(fig)


def _pipeline_setup(rec: dict) -> str:
    """What a timeline ran: its schedule, micro-batches and stages, and where."""
    micro = rec.get("microbatches")
    return (f"{rec.get('schedule')}, {micro} micro-batch{'es' * (micro != 1)} over "
            f"{rec.get('stages')} stages; {_setup(rec)}")


def _pipeline_chart(plt, records: list[dict]) -> Figure | None:
    """One step of each pipeline run, a lane per rank, every panel on one time axis so that
    step lengths compare by eye."""
    runs = [r for r in latest_runs(records) if r.get("folder") == "05_pipeline"
            and r.get("status") == "ok" and r.get("timeline")]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.0 + 0.45 * sum(
        len(r["timeline"]) + 1.5 for r in runs)), squeeze=False, sharex=True,
        layout="constrained")
    for ax, rec in zip(axes[:, 0], runs, strict=True):
        t0 = min(a[3] for lane in rec["timeline"] for a in lane)
        for rank, lane in enumerate(rec["timeline"]):
            first_stage = min(a[2] for a in lane)
            for kind, micro, stage, start, end in lane:
                ax.broken_barh([(1e3 * (start - t0), 1e3 * (end - start))], (rank - 0.4, 0.8),
                               facecolor=KIND_COLOURS.get(kind, "grey"), edgecolor="white",
                               hatch="//" if stage != first_stage else None)
                ax.text(1e3 * ((start + end) / 2 - t0), rank, f"{micro}", ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(rec["timeline"])),
                      [f"rank {r}" for r in range(len(rec["timeline"]))])
        ax.invert_yaxis()
        ax.tick_params(axis="x", labelbottom=True)  # sharex keeps them on the last panel only
        bubble = rec.get("bubble")
        ax.set_title(f"{script_label(rec)} ({_pipeline_setup(rec)}): measured bubble "
                     f"{'?' if bubble is None else f'{bubble:.3f}'}", fontsize=10)
    axes[-1, 0].set_xlabel("ms into the step (blank: idle; hatched: the rank's second stage)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    fig.legend(handles, ["F forward", "B backward", "I input grad", "W weight grad"],
               loc="outside upper center", ncol=4, fontsize=8)
    return fig


def _busbw_chart(plt, records: list[dict]) -> Figure | None:
    sweeps = [r for r in latest_runs(records) if r.get("status") == "ok" and r.get("sweep")]
    ops = sorted({row["op"] for r in sweeps for row in r["sweep"]})
    if not ops:
        return None
    # a world of one moves nothing between ranks (busbw 0): its algbw shows that the path ran
    one = all(r.get("world_size") == 1 for r in sweeps)
    figure = "algbw_gbps" if one else "busbw_gbps"
    setup, suffixes = _setups(sweeps)
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for rec, suffix in zip(sweeps, suffixes, strict=True):
            rows = sorted((row for row in rec["sweep"] if row["op"] == op and row[figure] > 0),
                          key=lambda row: row["bytes"])
            transport = rec.get("transport") or "process group"
            ax.plot([row["bytes"] for row in rows], [row[figure] for row in rows],
                    marker="o", label=f"{script_label(rec)} ({transport}){suffix}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("message bytes")
    axes[0, 0].set_ylabel(f"{figure.split('_')[0]} GB/s")
    lines = {label: line for ax in axes[0]  # every run's line, whichever ops it swept
             for line, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    fig.legend(lines.values(), lines.keys(), loc="lower center", ncol=len(lines), fontsize=8)
    fig.suptitle(f"06_symmem: {'algorithm' if one else 'bus'} bandwidth against message size, "
                 f"{setup}", fontsize=11)
    return _laid_out(fig, bottom=0.1)


def _laid_out(fig: Figure, bottom: float = 0.0) -> Figure:
    fig.tight_layout(rect=(0, bottom, 1, 1))  # room for a legend below the plots
    return fig


CHARTS = {"speedup.png": _speedup_chart, "compression_bytes.png": _compression_chart,
          "pipeline_timelines.png": _pipeline_chart, "symmem_busbw.png": _busbw_chart}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw_charts(records: list[dict]) -> dict[str, Figure]:
    """Every chart the records have data for, by file name, drawn and not yet saved: the tests
    read what each shows from its axes. Close them (`write_charts` does)."""
    plt = _pyplot()
    drawn = {name: draw(plt, records) for name, draw in CHARTS.items()}
    return {name: fig for name, fig in drawn.items() if fig is not None}


def write_charts(records: list[dict], out_dir: Path) -> list[Path]:
    """Every chart the records have data for, as PNGs in `out_dir`; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plt, written = _pyplot(), []
    for name, fig in draw_charts(records).items():
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    return written
