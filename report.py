"""Everything that reads results rather than training: the report, the per-rank trace
breakdown, the charts and the strategy planner. Recipes never import this file; it imports
`common` only to read the results file the recipes write.

    python report.py                 # outputs/results.jsonl -> table, outputs/report.md, charts
    python report.py traces          # where each traced step's time went, per script and rank
    python report.py plan --params 7e9 --gpus 8 --gpu-mem 80   # which strategy fits, and its bytes
    python report.py list            # every script with the first line of its docstring
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

import common


# ---------------------------------------------------------------------------------------------
# The results table: latest run of each script, grouped by folder, optimized rows beside their
# baseline.
# ---------------------------------------------------------------------------------------------
def _script_label(rec: dict) -> str:
    """The script, and its flags where they differ from the defaults."""
    return " ".join(filter(None, [rec.get("script"), rec.get("variant")]))


def latest_runs(records: list[dict]) -> list[dict]:
    """The last record of each (folder, script and variant, size, model, world, device, link)."""
    latest = {}
    for rec in records:
        latest[common.run_key(rec) + (_script_label(rec),)] = rec
    return list(latest.values())


def _fmt(value, spec: str = ",.1f") -> str:
    return "" if value is None else format(value, spec)


def max_loss_diff(losses: list[float] | None, baseline_losses: list[float] | None
                  ) -> float | None:
    if not losses or not baseline_losses or len(losses) != len(baseline_losses):
        return None
    return max(abs(a - b) for a, b in zip(losses, baseline_losses, strict=True))


def _size_label(rec: dict) -> str:
    """The size, the model unless it is the GPT, and the link where LINK shaped it."""
    model, link = rec.get("model"), rec.get("link")
    return " ".join([str(rec.get("size"))] + ([model] if model not in (None, "gpt") else [])
                    + ([f"@{link}"] if link else []))


# An optimized row is compared with its baseline only if these settings match too.
COMPARED = ("dtype", "batch_size", "seq_len", "steps", "warmup", "seed", "lr", "nnodes")


def _report_row(rec: dict, base: dict | None) -> list[str]:
    status = rec.get("status", "?")
    if status != "ok":
        return [_script_label(rec), _size_label(rec), rec.get("world_size"), rec.get("device"),
                *[""] * 9, f"{status}: {rec.get('reason') or ''}"]
    throughput = rec.get("tokens_per_s") or rec.get("samples_per_s")
    speedup = mem_ratio = dloss = ""
    status = "ok"
    unlike = [k for k in COMPARED if base is not None and rec.get(k) != base.get(k)]
    if unlike:
        status = f"ok; not compared: baseline ran with other {', '.join(unlike)}"
    elif base is not None and base.get("status") == "ok":
        speedup = f"{base['step_ms'] / rec['step_ms']:.2f}x"
        mem_ratio = f"{rec['peak_mem_mb'] / base['peak_mem_mb']:.2f}x"
        diff = max_loss_diff(rec.get("losses"), base.get("losses"))
        if diff is not None:
            tol = rec.get("loss_tolerance")
            verdict = "" if tol is None else (" (ok)" if diff <= tol else f" (> {tol:g})")
            dloss = f"{diff:.2e}{verdict}"
    theory = _theory_cell(rec)
    return [_script_label(rec), _size_label(rec), rec.get("world_size"), rec.get("device"),
            f"{rec['step_ms']:.1f} ({rec['step_ms_p90']:.1f})", _fmt(throughput, ",.0f"),
            speedup, _fmt(rec.get("peak_mem_mb"), ",.0f"), mem_ratio,
            _fmt(rec.get("state_mb")), _fmt(rec.get("comm_mb"), ",.2f"), dloss, theory, status]


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value}"


def _theory_cell(rec: dict) -> str:
    """Each predicted figure, with the measured one beside it where the record has it under the
    same name and the table has no column for it (e.g. compression)."""
    cells = []
    for key, predicted in (rec.get("theory") or {}).items():
        cell = f"{key}={_number(predicted)}"
        if key not in ("comm_mb", "peak_mem_mb", "state_mb") and \
                isinstance(rec.get(key), (int, float)):
            cell += f" (measured {_number(rec[key])})"
        cells.append(cell)
    return "; ".join(cells)


REPORT_HEADERS = ["script", "size", "world", "device", "step ms (p90)", "tok/s (img/s)",
                  "speedup", "peak MB", "mem vs base", "state MB", "comm MB/step",
                  "max Δloss", "theory", "status"]


SWEEP_HEADERS = ["op", "bytes", "world", "device", "baseline", "ms", "busbw GB/s", "script",
                 "ms ", "busbw GB/s ", "speedup"]


def _sweep_table(sweeps: list[dict], by_key: dict) -> str:
    """Collectives benchmarks: each optimized sweep beside its baseline's, size by size."""
    table = []
    for rec in sweeps:
        if rec.get("baseline") is None:
            continue
        # the baseline's run with the same sweep flags, else its default one
        same_flags = " ".join(filter(None, [rec["baseline"], rec.get("variant")]))
        base = by_key.get(common.run_key(rec) + (same_flags,)) or \
            by_key.get(common.run_key(rec) + (rec["baseline"],))
        theirs = {(r["op"], r["bytes"]): r for r in (base or {}).get("sweep", [])}
        for row in rec["sweep"]:
            other = theirs.get((row["op"], row["bytes"]))
            table.append([row["op"], f"{row['bytes']:,}", rec.get("world_size"),
                          rec.get("device"), _script_label(base) if base else "",
                          _fmt(other and other["ms"], ",.3f"),
                          _fmt(other and other["busbw_gbps"], ",.2f"), _script_label(rec),
                          f"{row['ms']:,.3f}", f"{row['busbw_gbps']:,.2f}",
                          f"{other['ms'] / row['ms']:.2f}x" if other else ""])
    for rec in sweeps:  # a baseline nothing was compared with still shows its figures
        if rec.get("baseline") is None and not any(
                r.get("baseline") == rec.get("script") and common.run_key(r) == common.run_key(rec)
                for r in sweeps):
            table += [[row["op"], f"{row['bytes']:,}", rec.get("world_size"), rec.get("device"),
                       _script_label(rec), f"{row['ms']:,.3f}", f"{row['busbw_gbps']:,.2f}",
                       "", "", "", ""] for row in rec["sweep"]]
    return tabulate(table, SWEEP_HEADERS, tablefmt="github") + \
        "\n\nbusbw = bytes / time x 2(N-1)/N (all-reduce), (N-1)/N (all-gather, " \
        "reduce-scatter), 1 (send/recv); speedup = baseline time / this time."


def render_report(records: list[dict]) -> str:
    """Markdown: one table per folder; baselines first, each optimized row after its baseline."""
    runs = latest_runs(records)
    if not runs:
        return "No results yet: run `make all` (or `make ddp`) first.\n"
    by_key = {common.run_key(r) + (_script_label(r),): r for r in runs}
    out = ["# Distributed Training Playbook: results", ""]
    for folder in sorted({str(r.get("folder")) for r in runs}):
        rows = sorted((r for r in runs if str(r.get("folder")) == folder),
                      key=lambda r: (str(r.get("size")), str(r.get("model")), r.get("link") or "",
                                     r.get("world_size") or 0, str(r.get("device")),
                                     (r.get("baseline") or r.get("script") or ""),
                                     r.get("baseline") is not None, r.get("variant") or ""))
        sweeps = [r for r in rows if "sweep" in r]
        table = [_report_row(r, by_key.get(common.run_key(r) + (r.get("baseline"),)))
                 for r in rows if r not in sweeps]
        out += [f"## {folder}", ""]
        if table:
            out += [tabulate(table, REPORT_HEADERS, tablefmt="github"), ""]
        if sweeps:
            out += [_sweep_table(sweeps, by_key), ""]
    if any("sweep" not in r for r in runs):
        out += ["speedup = baseline step time / this step time (same size, world, device and "
                "link); mem vs base = peak memory ratio; max Δloss = largest per-step loss "
                "difference from the baseline, checked against the script's stated tolerance.",
                ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
    cli = argparse.ArgumentParser(prog="report.py", description=__doc__.split("\n\n")[0])
    cli.add_argument("--results", type=Path, default=common.RESULTS)
    cli.add_argument("--out", type=Path, default=common.RESULTS.parent / "report.md")
    sub = cli.add_subparsers(dest="command")
    sub.add_parser("report", help="the results table (the default)")
    args = cli.parse_args(argv)
    text = render_report(common.load_results(args.results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
