"""Everything that reads results rather than training: the report, the per-rank trace
breakdown, the charts and the strategy planner. Recipes never import this file; it imports
`common` only to read the results file the recipes write.

    python report.py                 # outputs/results.jsonl -> table, outputs/report.md, charts
    python report.py traces          # where each traced step's time went, per script and rank
    python report.py plan --params 7e9 --gpus 8 --gpu-mem 80  # which strategy fits, its bytes
    python report.py list            # every script with the first line of its docstring
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tabulate import tabulate

import common

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn, not for the table
    from matplotlib.figure import Figure


# ---------------------------------------------------------------------------------------------
# Reading results back (report.py renders them; the Makefile's outcome lines check for a run's
# own record)
# ---------------------------------------------------------------------------------------------
def max_loss_diff(losses: list[float] | None, baseline_losses: list[float] | None
                  ) -> float | None:
    """The largest per-step loss difference from the baseline's run (None: not comparable)."""
    if not losses or not baseline_losses or len(losses) != len(baseline_losses):
        return None
    return max(abs(a - b) for a, b in zip(losses, baseline_losses, strict=True))


def over_tolerance(rec: dict, base: dict | None) -> bool:
    """Whether a run's losses strayed from its baseline's further than the tolerance its script
    states: its status is then `over tolerance`, not `ok`. The record says which kind:
    `loss_tolerance`, the largest per-step difference, or `loss_tolerance_final_rel`, the final
    loss's distance from the baseline's final loss as a fraction of it (a long lossy run, judged
    by where it ends)."""
    losses = rec.get("losses")
    diff = max_loss_diff(losses, (base or {}).get("losses"))
    if diff is not None and rec.get("loss_tolerance_final_rel") is not None:
        final = base["losses"][-1]
        return abs(losses[-1] - final) > rec["loss_tolerance_final_rel"] * abs(final)
    tolerance = rec.get("loss_tolerance")
    return diff is not None and tolerance is not None and diff > tolerance


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


def _size_label(rec: dict) -> str:
    """The size, the model unless it is the GPT, and the link where LINK shaped it."""
    model, link = rec.get("model"), rec.get("link")
    return " ".join([str(rec.get("size"))] + ([model] if model not in (None, "gpt") else [])
                    + ([f"@{link}"] if link else []))


# An optimized row is compared with its baseline only if these settings match too.
COMPARED = ("dtype", "batch_size", "seq_len", "steps", "warmup", "seed", "lr", "nnodes",
            "clip_grad_norm")


def why_not_compared(rec: dict, base: dict | None) -> str | None:
    """Why a run that names a baseline has no speedup beside it (None: it has one, or it is a
    baseline). `base` is the baseline's latest run on the same setup. A baseline that failed
    says so: its record, written before its flags were known, lacks the settings compared."""
    if rec.get("baseline") is None:
        return None
    if rec.get("status") != "ok":
        return str(rec.get("status"))
    if base is None:
        return f"no {rec['baseline']} run on this setup"
    if base.get("status") != "ok":
        return f"baseline {base.get('status')}"
    unlike = [k for k in COMPARED if rec.get(k) != base.get(k)]
    return f"baseline ran with other {', '.join(unlike)}" if unlike else None


def _flag_groups(variant: str | None) -> set[str]:
    """A variant's flags, each with its values: "--stage 3 --clip-grad-norm 0.5" -> two."""
    return set(re.findall(r"--\S+(?: (?!--)\S+)*", variant or ""))


def baseline_run(rec: dict, by_key: dict) -> dict | None:
    """The run `rec` is compared with: of its baseline's runs on the same setup, the one whose
    flags are the most of `rec`'s (06's `--batch-size 1 --seq-len 32` beside its
    `--replicated-optimizer`, a flag the baseline lacks), whatever its status, so that a row
    says why it is not compared (`baseline failed`) rather than pick another run."""
    ours = _flag_groups(rec.get("variant"))
    theirs = [run for run in by_key.values() if run.get("script") == rec.get("baseline")
              and common.run_key(run) == common.run_key(rec)
              and _flag_groups(run.get("variant")) <= ours]
    return max(theirs, key=lambda run: len(_flag_groups(run.get("variant"))), default=None)


# A spoiled comparison says so. Both tests read what a run records (`step_ms_iqr`, `load_avg`,
# `cpus`); a record from before they existed is marked neither way.
def within_noise(rec: dict, base: dict) -> bool:
    """`~`: the middle halves of the two runs' step times ([q1, q3]) overlap, so the speedup is
    smaller than the step-to-step spread within either run."""
    ours, theirs = rec.get("step_ms_iqr"), base.get("step_ms_iqr")
    return bool(ours and theirs) and ours[0] <= theirs[1] and theirs[0] <= ours[1]


# Runnable tasks beyond the host's cores (or the run's own ranks) that mark a host busy. Less
# than one, so that a single busy process beside 2 ranks on 2 cores (a load near 3) is caught;
# above zero, so that the run's own helper threads (gloo's, autograd's), which wake only
# briefly, are not. Chosen from how the load average counts, not calibrated on measured runs.
BUSY_MARGIN = 0.5


def busy_host(rec: dict) -> bool:
    """`(busy host)`: the host's 1-minute load average, at the first timed step or after the
    last (the larger), was above max(its cores, the run's ranks on it) + BUSY_MARGIN. The run's
    ranks alone fill the cores on CPU (`common.setup` gives each cores / ranks threads; more
    ranks than cores run one thread each) and keep one thread each busy on GPU, so load beyond
    that is other work taking cores from the timed steps. The average lags by about a minute:
    a burst shorter than that barely shows, and load from just before the run still does."""
    load, cpus = rec.get("load_avg"), rec.get("cpus")
    if not load or not cpus:
        return False
    ranks_here = rec.get("world_size", 1) // (rec.get("nnodes") or 1)
    return max(load) > max(cpus, ranks_here) + BUSY_MARGIN


NOISE_NOTE = ("~ before a speedup: within noise, the two runs' middle halves of step times "
              "(q1 to q3) overlap. (busy host): the host's 1-minute load average at the run's "
              "first or last timed step was above its cores (or the run's own ranks, where "
              f"more) + {BUSY_MARGIN}, so other work took cores from the timed steps: its times, "
              "and the speedups they enter, are not the technique's; rerun on a quiet host.")


def _report_row(rec: dict, base: dict | None) -> list[str]:
    status = rec.get("status", "?")
    if status != "ok":
        return [_script_label(rec), _size_label(rec), rec.get("world_size"), rec.get("device"),
                *[""] * 9, f"{status}: {rec.get('reason') or ''}"]
    throughput = rec.get("tokens_per_s") or rec.get("samples_per_s")
    speedup = mem_ratio = dloss = ""
    why = why_not_compared(rec, base)
    if why is None and base is not None:
        noise = "~" if within_noise(rec, base) else ""
        speedup = f"{noise}{base['step_ms'] / rec['step_ms']:.2f}x"
        mem_ratio = f"{rec['peak_mem_mb'] / base['peak_mem_mb']:.2f}x"
        diff = max_loss_diff(rec.get("losses"), base.get("losses"))
        final_rel = rec.get("loss_tolerance_final_rel")
        if diff is not None and final_rel is not None:  # a long run, judged by where it ends
            gap = rec["losses"][-1] / base["losses"][-1] - 1
            dloss = f"final {gap:+.1%} " + ("(ok)" if abs(gap) <= final_rel
                                            else f"(> {final_rel:.0%})")
        elif diff is not None:
            tol = rec.get("loss_tolerance")
            verdict = "" if tol is None else (" (ok)" if diff <= tol else f" (> {tol:g})")
            dloss = f"{diff:.2e}{verdict}"
        if over_tolerance(rec, base):
            status = "over tolerance"
    status += " (busy host)" if busy_host(rec) else ""
    status += f"; not compared: {why}" if why else ""
    theory = _theory_cell(rec)
    return [_script_label(rec), _size_label(rec), _world_label(rec), rec.get("device"),
            f"{rec['step_ms']:.1f} ({rec['step_ms_p90']:.1f})", _fmt(throughput, ",.0f"),
            speedup, _fmt(rec.get("peak_mem_mb"), ",.0f"), mem_ratio,
            _fmt(rec.get("state_mb")), _fmt(rec.get("comm_mb"), ",.2f"), dloss, theory, status]


def _world_label(rec: dict) -> str:
    """The world, and its mesh where a run records one: `8 (pp 2 x dp 2 x tp 2)`."""
    mesh = rec.get("mesh")
    if not isinstance(mesh, dict):
        return str(rec.get("world_size"))
    return f"{rec.get('world_size')} ({' x '.join(f'{d} {n}' for d, n in mesh.items())})"


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value}"


def _theory_cell(rec: dict) -> str:
    """Each predicted figure, with the measured one beside it where the record has it under the
    same name and the table has no column for it (e.g. compression)."""
    cells = []
    for key, predicted in (rec.get("theory") or {}).items():
        if isinstance(predicted, dict):  # by mesh dim: each predicted, then what was measured
            measured = rec[key] if isinstance(rec.get(key), dict) else {}
            cells.append(f"{key}: " + ", ".join(
                f"{dim} {_number(value)}" + (f" (measured {_number(measured[dim])})"
                                             if dim in measured else "")
                for dim, value in predicted.items()))
            continue
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
        base = baseline_run(rec, by_key)
        theirs = {(r["op"], r["bytes"]): r for r in (base or {}).get("sweep", [])}
        for row in rec["sweep"]:
            other = theirs.pop((row["op"], row["bytes"]), None)
            table.append([row["op"], f"{row['bytes']:,}", rec.get("world_size"),
                          rec.get("device"), _script_label(base) if base else "",
                          _fmt(other and other["ms"], ",.3f"),
                          _fmt(other and other["busbw_gbps"], ",.2f"), _script_label(rec),
                          f"{row['ms']:,.3f}", f"{row['busbw_gbps']:,.2f}",
                          f"{other['ms'] / row['ms']:.2f}x" if other else ""])
        # what only the baseline swept (on CUDA symmetric memory runs all-reduce alone)
        table += [[op, f"{nbytes:,}", rec.get("world_size"), rec.get("device"),
                   _script_label(base), f"{other['ms']:,.3f}", f"{other['busbw_gbps']:,.2f}",
                   _script_label(rec), "", "", ""] for (op, nbytes), other in theirs.items()]
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
        table = [_report_row(r, baseline_run(r, by_key) if r.get("baseline") else None)
                 for r in rows if r not in sweeps]
        out += [f"## {folder}", ""]
        if table:
            out += [tabulate(table, REPORT_HEADERS, tablefmt="github"), ""]
        if sweeps:
            out += [_sweep_table(sweeps, by_key), ""]
    if any("sweep" not in r for r in runs):
        out += ["speedup = baseline step time / this step time (same size, world, device and "
                "link); mem vs base = peak memory ratio; max Δloss = largest per-step loss "
                "difference from the baseline, checked against the script's stated tolerance "
                "(`final +x%`: a long run's final loss against its baseline's, checked against "
                "its stated relative tolerance).",
                ""]
    if any(busy_host(r) for r in runs) or \
            any(within_noise(rec, base) for rec, base in compared_pairs(records)):
        out += [NOISE_NOTE, ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Traces: where each traced step's time went. `--trace` writes a Chrome trace per rank of two
# warm-up steps, each inside a `ProfilerStep#i` range; this reads them back.
# ---------------------------------------------------------------------------------------------
# A collective's kind from any of its names: the training thread's call (`c10d::allreduce_`),
# gloo's transfer on its own thread (`gloo:all_reduce`), NCCL's kernel (`ncclDevKernel_AllReduce..`)
COLLECTIVE_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "broadcast": "broadcast",
                    "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "send": "send",
                    "recv": "recv", "sendrecv": "send_recv", "barrier": "barrier",
                    "gather": "gather", "scatter": "scatter", "reduce": "reduce"}
ELEMENT_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "signed char": 1,
                 "unsigned char": 1, "int": 4, "long int": 8, "c10::Float8_e4m3fn": 1}


def collective_kind(name: str) -> str | None:
    """`all_reduce` for `c10d::allreduce_`, `gloo:all_reduce` or an NCCL AllReduce kernel; None
    for anything that is not communication."""
    if name.startswith(("c10d::", "gloo:", "nccl:")):  # a call, or its transfer (annotation)
        word = name.split(":")[-1]
    elif name.startswith("nccl"):  # every NCCL kernel communicates; most name their kind
        return next((COLLECTIVE_KINDS[part.lower()] for part in name.split("_")[1:]
                     if part.lower() in COLLECTIVE_KINDS), "nccl")
    else:
        return None
    word = word.lower().replace("_", "").removesuffix("base").removesuffix("coalesced")
    return COLLECTIVE_KINDS.get(word, word or None)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]
               ) -> list[tuple[float, float]]:
    """Both unions; the overlap of the two sets of intervals."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        start, end = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if start < end:
            out.append((start, end))
        i, j = (i + 1, j) if xs[i][1] < ys[j][1] else (i, j + 1)
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _span(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _events_and_steps(trace: dict) -> tuple[list[dict], list[dict]]:
    """The trace's complete events, and its `ProfilerStep#` ranges in time order."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    # the CPU's ranges; on CUDA kineto copies each onto the GPU's timeline too
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("no ProfilerStep# ranges: record it with a script's --trace")
    return events, steps


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def step_breakdown(trace: dict) -> list[dict]:
    """Each traced step of one rank, cut into four parts that add up to its wall time (ms):
    - compute: the training thread (on GPU: the compute kernels) busy, no communication in flight
    - hidden: communication in flight while it computes (overlap that cost nothing)
    - exposed: communication in flight and nothing computing: the training thread blocked in a
      collective, a wait on one, or a point-to-point transfer
    - idle: neither (Python between ops, waits on anything else, launch gaps on GPU)
    On CPU, communication is the training thread's collective calls plus gloo's transfers on its
    own threads, within the `ProfilerStep#` range. On GPU (a trace with kernels) it is what HTA's
    temporal breakdown calls non-compute: NCCL kernels and memory copies and sets; and a step is
    its span on the GPU (`gpu_step_windows`), which runs behind the CPU's range."""
    events, steps = _events_and_steps(trace)
    if any(e.get("cat") == "kernel" for e in events):
        device = [e for e in events if e.get("cat") in GPU_WORK]
        moves = [e.get("cat") != "kernel" or collective_kind(e["name"]) is not None
                 for e in device]
        comm = _union([_span(e) for e, m in zip(device, moves, strict=True) if m])
        compute = _union([_span(e) for e, m in zip(device, moves, strict=True) if not m])
        windows = gpu_step_windows(events, steps)
    else:
        main = steps[0]["tid"]
        ops = [e for e in events if e["tid"] == main and e.get("cat") == "cpu_op"]
        calls = _union([_span(e) for e in ops if collective_kind(e["name"])])
        busy = _union([_span(e) for e in ops if not collective_kind(e["name"])])
        # a collective call's own inner ops are communication, not compute
        compute = _union([piece for a, b in busy for piece in _subtract((a, b), calls)])
        transfers = [_span(e) for e in events if e["tid"] != main and collective_kind(e["name"])]
        comm = _union(calls + transfers)
        windows = [_span(step) for step in steps]
    rows = []
    for step, (start, end) in zip(steps, windows, strict=True):
        c, m = _intersect(compute, [(start, end)]), _intersect(comm, [(start, end)])
        hidden = _length(_intersect(c, m))
        parts = {"compute": _length(c) - hidden, "hidden": hidden,
                 "exposed": _length(m) - hidden}
        parts["idle"] = (end - start) - _length(_union(c + m))  # measured, not the remainder
        rows.append({"step": step["name"], "wall": (end - start) / 1e3,
                     **{k: v / 1e3 for k, v in parts.items()}})
    return rows


def gpu_step_windows(events: list[dict], steps: list[dict]) -> list[tuple[float, float]]:
    """Each step's span on the GPU: from the start of the first kernel (or copy) its CPU range
    launched to the start of the next step's first one; the last step ends with its last kernel.
    Kernels are matched to their launch by `correlation`. A step that launched nothing keeps its
    CPU range."""
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    first: list[float | None] = [None] * len(steps)
    last_end = first[:]
    for e in events:
        ts = launched.get(e.get("args", {}).get("correlation")) \
            if e.get("cat") in GPU_WORK else None
        i = next((i for i, s in enumerate(steps) if ts is not None
                  and s["ts"] <= ts < s["ts"] + s["dur"]), None)
        if i is not None:
            first[i] = e["ts"] if first[i] is None else min(first[i], e["ts"])
            last_end[i] = max(last_end[i] or 0.0, e["ts"] + e["dur"])
    windows = []
    for i, step in enumerate(steps):
        if first[i] is None:
            windows.append(_span(step))
            continue
        later = next((f for f in first[i + 1:] if f is not None), None)
        windows.append((first[i], later if later is not None else last_end[i]))
    return windows


def _subtract(interval: tuple[float, float], cuts: list[tuple[float, float]]
              ) -> list[tuple[float, float]]:
    """`interval` minus the (sorted, disjoint) `cuts`."""
    start, end = interval
    pieces = []
    for a, b in cuts:
        if b <= start or a >= end:
            continue
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    return pieces + ([(start, end)] if start < end else [])


# Calls whose first tensor argument is their output: the message is the second, their input.
OUTPUT_FIRST = ("all_gather", "reduce_scatter", "all_to_all")


def _message_bytes(event: dict) -> int:
    """From the trace's shapes (`record_shapes`): the elements of the call's input tensor (or
    tensor list), times the element size; fp32 where the trace names no type (tensor lists).
    The input, as HTA counts a message: an all-gather's 1/N, a reduce-scatter's whole."""
    args = event.get("args", {})
    tensors = [(dims, kind) for dims, kind in zip(args.get("Input Dims", []),
                                                  args.get("Input type", []), strict=False)
               if dims]
    if collective_kind(event["name"]) in OUTPUT_FIRST:
        tensors = tensors[1:]
    if not tensors:
        return 0
    dims, kind = tensors[0]
    shapes = dims if isinstance(dims[0], list) else [dims]
    return sum(math.prod(shape) for shape in shapes) * ELEMENT_BYTES.get(kind, 4)


def comm_pattern(trace: dict) -> dict[str, dict]:
    """Per collective kind, as HTA's communication summary: the calls (count, bytes; from any
    thread: on CUDA backward runs on autograd's own) and the time their transfers took (gloo's
    threads, NCCL's kernels)."""
    events, steps = _events_and_steps(trace)
    main, gpu = steps[0]["tid"], any(e.get("cat") == "kernel" for e in events)
    cpu_windows = [_span(s) for s in steps]
    kernel_windows = gpu_step_windows(events, steps) if gpu else cpu_windows  # as the breakdown
    out: dict[str, dict] = {}
    for e in events:
        kind = collective_kind(e["name"])
        windows = kernel_windows if e.get("cat") in GPU_WORK else cpu_windows
        if kind is None or not any(a <= e["ts"] < b for a, b in windows):
            continue
        if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::"):
            row = out.setdefault(kind, {"count": 0, "bytes": 0, "ms": 0.0})
            row["count"] += 1
            row["bytes"] += _message_bytes(e)
        elif (e.get("cat") == "kernel") if gpu else (e["tid"] != main
                                                     and e["name"].startswith("gloo:")):
            out.setdefault(kind, {"count": 0, "bytes": 0, "ms": 0.0})["ms"] += e["dur"] / 1e3
    return out


def _trace_name(rec: dict) -> str:
    """The name `common._export_trace` gives a run's traces, less `_rank<r>`."""
    variant = re.sub(r"[^\w.-]", "", rec.get("variant") or "")
    return f"{rec.get('folder')}_{rec.get('script')}{variant}"


def _folder_and_script(name: str) -> tuple[str, str]:
    """`05_pipeline_optimized_pipeline_pytorch--schedule1f1b` -> the folder, the script."""
    match = re.fullmatch(r"(\d+_[^_]+)_(.+)", name)
    folder, script = match.groups() if match else ("", name)
    return folder, script.partition("--")[0]


def _trace_places(names: Sequence[str], records: Sequence[dict]) -> dict[str, tuple]:
    """Each trace's place in the results table's order: by folder, each baseline's runs
    together after it. A run's record names its baseline; a trace with no record is placed by
    the names: optimized_X beside the folder's baseline_Y with the longest Y that X starts
    with (optimized_ddp_flash beside baseline_ddp_flash, optimized_zero1 beside baseline_zero)."""
    baseline_of = {_trace_name(rec): rec.get("baseline") for rec in records}
    scripts = {name: _folder_and_script(name) for name in names}
    baselines = {(folder, script) for folder, script in scripts.values()
                 if script.startswith("baseline_")}
    places = {}
    for name, (folder, script) in scripts.items():
        technique = script.removeprefix("optimized_")
        named = max((base for f, base in baselines if f == folder
                     and script.startswith("optimized_")
                     and technique.startswith(base.removeprefix("baseline_"))),
                    key=len, default=None)
        baseline = baseline_of.get(name, named)  # a record's say, None (a baseline) too, wins
        places[name] = (folder, baseline or script, baseline is not None, name)
    return places


def trace_files(traces: Path, records: Sequence[dict] = ()) -> list[tuple[str, int, Path]]:
    """(folder_script, rank, path) of every per-rank trace `--trace` wrote, each optimized
    script's after its baseline's (`records`, the results, name the baselines), then by rank."""
    found = []
    for path in traces.glob("*_rank*.json"):
        name, _, rank = path.stem.rpartition("_rank")
        if rank.isdigit():
            found.append((name, int(rank), path))
    places = _trace_places([name for name, _, _ in found], records)
    return sorted(found, key=lambda trace: (places[trace[0]], trace[1]))


def render_traces(traces: Path, records: Sequence[dict] = ()) -> str:
    """Markdown: the breakdown of a traced step per script and rank, then its collectives; each
    optimized script's rows after its baseline's (`records` name the baselines)."""
    files = trace_files(traces, records)
    if not files:
        return ""
    breakdown, pattern, unreadable = [], [], []
    for name, rank, path in files:
        try:
            trace = json.loads(path.read_text())
            steps = step_breakdown(trace)
        except (ValueError, KeyError) as err:  # cut short, or not a trace --trace wrote
            unreadable.append(f"{path.name} ({err})")
            continue
        mean = {k: sum(s[k] for s in steps) / len(steps)
                for k in ("wall", "compute", "exposed", "hidden", "idle")}
        breakdown.append([name, rank, f"{mean['wall']:,.2f}", *[
            f"{mean[k]:,.2f} ({100 * mean[k] / mean['wall']:.0f}%)"
            for k in ("compute", "exposed", "hidden", "idle")]])
        pattern += [[name, rank, kind, f"{row['count'] / len(steps):g}",
                     f"{row['bytes'] / len(steps) / 2**20:,.3f}", f"{row['ms'] / len(steps):,.2f}"]
                    for kind, row in sorted(comm_pattern(trace).items())]
    return "\n".join([
        f"## Where the time goes (traces in {traces})", "",
        tabulate(breakdown, ["script", "rank", "step ms", "compute", "exposed comm",
                             "hidden comm", "idle"], tablefmt="github"), "",
        "Per traced step (the mean of the two): compute = the training thread busy (on GPU: the "
        "compute kernels) with no communication in flight; exposed comm = communication in "
        "flight and nothing computing (blocked in a collective or a wait on one); hidden comm ="
        " communication overlapped with compute; idle = neither (Python between ops, other "
        "waits). The four add up to the step. On GPU, communication is NCCL kernels and memory "
        "copies (HTA's non-compute) and a step is its span on the GPU.", "",
        tabulate(pattern, ["script", "rank", "collective", "calls/step", "MB/step",
                           "transfer ms/step"], tablefmt="github"), "",
        "MB from the traced shapes (fp32 where the trace names no type); transfer ms = time on "
        "gloo's threads (NCCL's kernels on GPU), including waiting for the peer.", "",
        *([f"Not read: {', '.join(unreadable)}.", ""] if unreadable else [])])


# ---------------------------------------------------------------------------------------------
# Charts: PNGs beside report.md, drawn from the same latest runs and pairings as the tables.
# ---------------------------------------------------------------------------------------------
KIND_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def optimized_runs(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """(run, its baseline's latest run on the same setup or None) of every training run that
    names a baseline, as the table pairs them; by folder and script."""
    runs = latest_runs(records)
    by_key = {common.run_key(r) + (_script_label(r),): r for r in runs}
    found = [(rec, baseline_run(rec, by_key)) for rec in runs
             if rec.get("baseline") is not None and "sweep" not in rec]
    return sorted(found, key=lambda pair: (str(pair[0]["folder"]), _script_label(pair[0])))


def compared_pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(optimized, baseline) of every training run the table compares: both ok, same settings."""
    return [(rec, base) for rec, base in optimized_runs(records)
            if why_not_compared(rec, base) is None]


def _setup(rec: dict) -> str:
    return f"{rec.get('device')}, world {rec.get('world_size')}, size {rec.get('size')}"


def _setups(recs: list[dict]) -> tuple[str, list[str]]:
    """A chart's title part and each run's label suffix: the one setup they share in the title,
    or each run's own beside it when they differ."""
    if len({_setup(r) for r in recs}) == 1:
        return _setup(recs[0]), [""] * len(recs)
    return "runs on several setups", [f" [{_setup(r)}]" for r in recs]


GREEN, RED, GREY = "#55a868", "#c44e52", "#8c8c8c"


def _speedup_chart(plt, records: list[dict]) -> Figure | None:
    """Speedup and memory ratio of every optimized run over its baseline: green better, red
    worse, grey neither (over tolerance: it does not train the same model; `~`: within noise);
    `(busy host)` where either run of the pair was. A run with no pair says why where its bars
    would be."""
    rows = optimized_runs(records)
    compared = [why_not_compared(rec, base) is None for rec, base in rows]
    if not any(compared):
        return None
    setup, suffixes = _setups([r for r, _ in rows])
    labels = [f"{r['folder']}  {_script_label(r)}" + (f" @{r['link']}" if r.get("link") else "")
              + suffix for (r, _), suffix in zip(rows, suffixes, strict=True)]
    # constrained layout sets the suptitle above the panels' titles at any height (tight_layout
    # keeps it 2% of the height below the top, into the titles of a tall figure) and keeps the
    # left panel's last tick label off the right panel's first
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True,
                             layout="constrained")
    speedups, memories = [], []
    for y, ((rec, base), paired) in enumerate(zip(rows, compared, strict=True)):
        if not paired:
            axes[0].text(0, y, f" not compared: {why_not_compared(rec, base)}", va="center",
                         fontsize=8, color=GREY)
            continue
        speedup, memory = base["step_ms"] / rec["step_ms"], rec["peak_mem_mb"] / base["peak_mem_mb"]
        over, noise = over_tolerance(rec, base), within_noise(rec, base)
        busy = " (busy host)" if busy_host(rec) or busy_host(base) else ""
        tail = " over tolerance" if over else ""
        axes[0].barh(y, speedup, color=GREY if over or noise else GREEN if speedup >= 1 else RED)
        # a label starts right of its bar or of the 1.0 line, whichever ends later: never on it
        axes[0].text(max(speedup, 1.0), y, f" {'~' if noise else ''}{speedup:.2f}x{busy}{tail}",
                     va="center", fontsize=8)
        axes[1].barh(y, memory, color=GREY if over else GREEN if memory <= 1 else RED)
        axes[1].text(max(memory, 1.0), y, f" {memory:.2f}x{tail}", va="center", fontsize=8)
        speedups.append(speedup)
        memories.append(memory)
    for ax, values, title in ((axes[0], speedups, "speedup over its baseline (step time)"),
                              (axes[1], memories, "peak memory / its baseline's")):
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max([*values, 1.0]) * 1.2)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{setup}: green is better, red worse; grey: over tolerance, or within noise (~)")
    return fig


def _compression_chart(plt, records: list[dict]) -> Figure | None:
    runs = [r for r in latest_runs(records)
            if r.get("folder") == "02_compression" and r.get("status") == "ok"]
    if not runs:
        return None
    labels = [_script_label(r) + (f" @{r['link']}" if r.get("link") else "") for r in runs]
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
        ax.set_title(f"{_script_label(rec)} ({_pipeline_setup(rec)}): measured bubble "
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
                    marker="o", label=f"{_script_label(rec)} ({transport}){suffix}")
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


# ---------------------------------------------------------------------------------------------
# The strategy planner: per-GPU memory and bytes sent per step of each way to spread a GPT over
# G GPUs, from the formulas the folders record as `theory` (and test against measurement).
# ---------------------------------------------------------------------------------------------
GB = 1e9
# Bytes per parameter: (weights, gradients, optimizer state) with AdamW. fp32: 4 + 4 + 8 (two
# moments), what every folder measures on CPU. Mixed precision, as the ZeRO paper counts it:
# 16-bit weights and gradients, and fp32 master weights + two moments in the optimizer, 2+2+12.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


def state_per_gpu(strategy: str, params: float, gpus: int, dtype: str = "fp32",
                  per_node: int = 8, embedding: float = 0.0) -> float:
    """Bytes of weights + gradients + optimizer state one GPU keeps between steps.
    `embedding`: the parameters a pipeline's end stages hold besides their share of the blocks
    (token and position tables; the tied head repeats the token table on the last stage), and
    that tensor parallelism replicates (it splits the blocks' heads and hidden units)."""
    w, g, o = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    return {"DDP": (w + g + o) * params,
            "ZeRO-1": (w + g) * params + o * params / n,
            "ZeRO-2": w * params + (g + o) * params / n,
            "ZeRO-3": (w + g + o) * params / n,
            "FSDP full": (w + g + o) * params / n,
            "FSDP grad-op": (w + g + o) * params / n,
            "FSDP hybrid": (w + g + o) * params / hybrid,
            "pipeline": (w + g + o) * ((params - embedding) / n + embedding),
            "TP": (w + g + o) * ((params - embedding) / n + embedding),
            "TP x DP": (w + g + o) * ((params - embedding) / hybrid + embedding)}[strategy]


def sent_per_gpu(strategy: str, params: float, gpus: int, dtype: str = "fp32",
                 per_node: int = 8, stage_output_bytes: float = 0.0,
                 tied_params: float = 0.0, stream: float = 0.0, replicated: float = 0.0
                 ) -> float:
    """Bytes the busiest GPU sends per optimizer step, ring collectives: an all-reduce sends
    2(n-1)/n of the message, an all-gather or reduce-scatter (n-1)/n. A pipeline: a middle
    stage sends the activations it hands on in a step (`stage_output_bytes`, every
    micro-batch's) and as many gradients back; an end stage one of the two, and the gradient of
    the token table tied to the head (`tied_params`), all-reduced with the other end.
    Tensor parallelism over t GPUs (all of them, or a node's with data parallelism across
    nodes): per layer 4 all-gathers and 4 reduce-scatters of the t GPUs' batch, t x `stream`
    (s x b x h, one GPU's micro-batch, summed over the layers) in the weights' dtype, and an
    all-reduce of the gradients of the `replicated` parameters (embedding tables); across
    nodes, each GPU's gradients all-reduced with its peers in the other replicas."""
    w, g, _ = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    share, replicas = (n - 1) / n, max(1, n // hybrid)

    def tensor_parallel(t: int) -> float:
        return (t - 1) / t * (8 * t * stream * w + 2 * g * replicated)

    return {"DDP": 2 * share * g * params,  # all-reduce the gradients
            "ZeRO-1": share * (g + w) * params,  # reduce-scatter grads, all-gather weights
            "ZeRO-2": share * (g + w) * params,
            "ZeRO-3": share * (2 * w + g) * params,  # gather twice (forward, backward)
            "FSDP full": share * (2 * w + g) * params,
            "FSDP grad-op": share * (w + g) * params,  # kept gathered from forward to backward
            "FSDP hybrid": (hybrid - 1) / hybrid * (2 * w + g) * params
            + 2 * (replicas - 1) / replicas * g * params / hybrid,
            "pipeline": 0.0 if n == 1 else max(stage_output_bytes + g * tied_params,
                                               2 * stage_output_bytes if n > 2 else 0.0),
            "TP": tensor_parallel(n),
            "TP x DP": tensor_parallel(hybrid) + 2 * (replicas - 1) / replicas * g
            * ((params - replicated) / hybrid + replicated)}[strategy]


def activations_per_gpu(layers: int, seq: int, batch: int, hidden: int, vocab: int, dtype: str,
                        checkpointing: bool, stage_layers: int | None = None,
                        in_flight: int = 1) -> float:
    """Activation bytes saved for backward. Per layer and micro-batch 34 bytes per s.b.h element
    in 16-bit (Korthikanti et al. 2022, with flash attention: no s x s scores), twice that in
    fp32. Checkpointing keeps each layer's input (s.b.h) and recomputes one layer at a time.
    Plus the logits and their gradient in fp32 (2 x s.b.V x 4). A pipeline stage keeps
    `in_flight` micro-batches of its `stage_layers` (1F1B: as many as there are stages)."""
    unit = seq * batch * hidden * (2 if dtype == "bf16" else 4)  # one s.b.h tensor
    layer = 17 * unit  # 34 bytes per s.b.h element in 16-bit is 17 tensors of the shape
    held = stage_layers if stage_layers is not None else layers
    kept = (held * unit + layer) if checkpointing else held * layer
    return in_flight * kept + 8 * seq * batch * vocab


# The composed layouts: 03_fsdp/optimized_fsdp_tp.py (FSDP2 x TP on a ("dp", "tp") mesh) and
# 05_pipeline/optimized_pipeline_3d.py (pipeline x FSDP2 x TP on ("pp", "dp", "tp")). TP stays
# inside a node: its traffic every layer needs NVLink, FSDP's and the pipeline's cross nodes.
@dataclass(frozen=True)
class Layout:
    """The decoder's parts (parameter counts) that TP and a pipeline treat apart."""

    params: float
    layers: int
    hidden: int
    vocab: int
    seq: int
    embedding: float  # the first stage's tables (token, and position): TP splits them by rows
    head: float  # an untied output head (the Llama's lm_head), split by columns; 0 if tied
    tied: float  # the token table a tied head repeats on the last stage; 0 if untied
    replicated: float  # kept whole on every TP rank: the norms (and row-parallel biases)
    norms: float  # of those, the norms, whose gradients (each TP rank's tokens') TP all-reduces
    position_table: bool  # a learned (seq x hidden) table, its lookup reduce-scattered

    @property
    def blocks(self) -> float:
        """The layers' parameters (the final norm counted with them: a few hidden units)."""
        return self.params - self.embedding - self.head


def gpt_layout(params: float, layers: int, hidden: int, vocab: int, seq: int) -> Layout:
    """GPT-2's layout (the project's GPT): token and position tables, the head tied to the token
    table, LayerNorms with biases (2 a layer and the final one) and the biases of the
    row-parallel Linears (attention's and the MLP's output, 2 a layer), which TP keeps whole."""
    norms = 2 * (2 * layers + 1) * hidden
    return Layout(params, layers, hidden, vocab, seq, embedding=(vocab + seq) * hidden,
                  head=0.0, tied=vocab * hidden, replicated=norms + 2 * layers * hidden,
                  norms=norms, position_table=True)


def llama_layout(params: float, layers: int, hidden: int, vocab: int, seq: int) -> Layout:
    """A Llama's layout: a token table, an untied head, rotary positions (no table), RMSNorm
    weights (2 a layer and the final one) and no biases."""
    norms = (2 * layers + 1) * hidden
    return Layout(params, layers, hidden, vocab, seq, embedding=vocab * hidden,
                  head=vocab * hidden, tied=0.0, replicated=norms, norms=norms,
                  position_table=False)


def tp_degree(gpus: int, per_node: int) -> int:
    """TP's group: the GPUs of a node, or fewer so that groups tile the nodes and the world
    (the largest common divisor): its gathers and scatters every layer stay on NVLink."""
    return math.gcd(gpus, per_node)


def tp_activation_bytes(tp: int, micro_batch: int, seq: int, width: int, nbytes: int) -> float:
    """One all-gather or reduce-scatter of a TP group's activations of `width` units: the group
    works on t x `micro_batch` sequences (one GPU's batch each, as data parallelism gives it),
    each GPU sends (t-1)/t of them."""
    return (tp - 1) / tp * tp * micro_batch * seq * width * nbytes


def fsdp_tp_state(layout: Layout, dp: int, tp: int, dtype: str = "fp32") -> float:
    """FSDP x TP, bytes a GPU keeps: (w+g+o) x [(P - R)/(dp tp) + R/dp]. TP splits every weight
    but the R it replicates (`layout.replicated`); FSDP shards each TP rank's piece dp ways."""
    w, g, o = STATE_BYTES[dtype]
    r = layout.replicated
    return (w + g + o) * ((layout.params - r) / (dp * tp) + r / dp)


def fsdp_tp_sent(layout: Layout, dp: int, tp: int, dtype: str = "fp32", micro_batch: int = 1
                 ) -> dict[str, float]:
    """FSDP x TP, bytes a GPU sends a step, by mesh dim (ring collectives; w: the weights' and
    activations' bytes, gradients reduced in fp32 as the scripts' MixedPrecisionPolicy does).
    tp (in a node): per layer 4 all-gathers and 4 reduce-scatters of the group's activations
    (sequence parallelism: gathered before attention and the MLP, scattered after, and the
    backward's twins); at the ends 4 more (the embedding's scatter, the head's input gather,
    and twins), the loss over logits split by vocabulary (loss_parallel: 3 all-reduces of 4
    bytes a token, 2 (t-1)/t x 3 x 4 x t.b.s), a position table's lookup (2 (t-1)/t x s.h) and
    the norms' gradients all-reduced, 2 (t-1)/t x 4 x N.
    dp (across nodes): (dp-1)/dp x [w x (2 blocks + root) + 4 x (blocks + root)] of each
    weight's TP piece: FULL_SHARD gathers a block twice, the root (tables, head) once, and
    reduce-scatters every gradient once."""
    w = STATE_BYTES[dtype][0]
    stream = tp_activation_bytes(tp, micro_batch, layout.seq, layout.hidden, w)
    positions = 2 * (tp - 1) / tp * layout.seq * layout.hidden * w if layout.position_table \
        else 0.0
    tp_bytes = (8 * layout.layers + 4) * stream + positions \
        + 2 * 3 * tp_activation_bytes(tp, micro_batch, layout.seq, 1, 4) \
        + 2 * (tp - 1) / tp * 4 * layout.norms
    blocks = (layout.blocks - layout.replicated) / tp + layout.replicated
    root = (layout.embedding + layout.head) / tp
    dp_bytes = (dp - 1) / dp * (w * (2 * blocks + root) + 4 * (blocks + root))
    return {"tp": tp_bytes, "dp": dp_bytes}


def stage_pieces(layout: Layout, pp: int, tp: int, end: float) -> float:
    """Parameters one GPU of a pipeline stage holds after TP, before FSDP shards them: the
    stage's ceil(L/pp) layers (their replicated norms whole, the rest split t ways) and `end`,
    its tables or head, split t ways."""
    share = math.ceil(layout.layers / pp) / layout.layers
    return ((layout.blocks - layout.replicated) * share + end) / tp + layout.replicated * share


def pp_fsdp_tp_state(layout: Layout, pp: int, dp: int, tp: int, dtype: str = "fp32") -> float:
    """PP x FSDP x TP, the busiest stage's bytes a GPU: (w+g+o) x its TP pieces / dp, that is
    (w+g+o) x [(P - E - R)/(pp dp tp) + E/(dp tp) + R/(pp dp)], E the heavier end: the first
    stage's tables, or the last's head (and a tied head's copy of the token table)."""
    w, g, o = STATE_BYTES[dtype]
    end = max(layout.embedding, layout.head + layout.tied)
    return (w + g + o) * stage_pieces(layout, pp, tp, end) / dp


def pp_fsdp_tp_sent(layout: Layout, pp: int, dp: int, tp: int, microbatches: int,
                    dtype: str = "fp32", micro_batch: int = 1) -> dict[str, float]:
    """PP x FSDP x TP, bytes the first stage's GPU sends a step, by mesh dim (what the script
    records for rank 0; the last stage runs loss_parallel where the first scatters its tables).
    pp: m micro-batches' activations, each GPU its 1/t sequence shard of the group's t x b
    sequences (b.s.h x w), and a tied token table's gradient shard all-reduced with the last
    stage's (4 x V.h / (dp t)). tp: m x the stage's TP terms a micro-batch (8 a layer, the
    embedding's 2, a position table's), the norms' gradients all-reduced once a step. dp:
    (dp-1)/dp x (w + 4) x the stage's TP pieces: FSDP keeps the stage gathered from the first
    forward to the last backward (one gather), one fp32 reduce-scatter."""
    w = STATE_BYTES[dtype][0]
    m, layers = microbatches, math.ceil(layout.layers / pp)
    positions = 2 * (tp - 1) / tp * layout.seq * layout.hidden * w if layout.position_table \
        else 0.0
    per_micro_batch = (8 * layers + 2) * tp_activation_bytes(tp, micro_batch, layout.seq,
                                                              layout.hidden, w) + positions
    tp_bytes = m * per_micro_batch + 2 * (tp - 1) / tp * 4 * layout.norms * layers / layout.layers
    dp_bytes = (dp - 1) / dp * (w + 4) * stage_pieces(layout, pp, tp, layout.embedding)
    pp_bytes = m * micro_batch * layout.seq * layout.hidden * w + 4 * layout.tied / (dp * tp)
    return {"pp": pp_bytes, "dp": dp_bytes, "tp": tp_bytes}


def layout_of(args: argparse.Namespace) -> Layout:
    """The planner's flags as a Layout: GPT-2's, or with --llama a Llama's."""
    layout = llama_layout if args.llama else gpt_layout
    return layout(args.params, args.layers, args.hidden, args.vocab, args.seq_len)


def sent_across_nodes(strategy: str, sent: float, params: float, gpus: int, dtype: str,
                      per_node: int, replicated: float) -> float:
    """Of the bytes the busiest GPU sends a step, those that leave its node: none on one node;
    a hybrid layout's all-reduce between its replicas (FSDP hybrid; TP x DP, with the tables TP
    replicates); every other strategy's rings and stage boundaries span the nodes: all of it."""
    if gpus <= per_node:
        return 0.0
    g, hybrid = STATE_BYTES[dtype][1], min(per_node, gpus)
    replicas = gpus // hybrid
    allreduce = 2 * (replicas - 1) / replicas * g
    return {"FSDP hybrid": allreduce * params / hybrid,
            "TP x DP": allreduce * ((params - replicated) / hybrid + replicated)
            }.get(strategy, sent)


def composed_row(args: argparse.Namespace, layout: Layout, checkpointing: bool, tp: int,
                 pp: int = 1) -> dict:
    """One FSDP x TP (pp 1) or PP x FSDP x TP row. Memory a GPU: the state; the weights FSDP
    holds gathered (FSDP x TP: a block and the next's prefetch; the pipeline keeps its stage
    gathered for the whole step); activations: sequence parallelism leaves each GPU 1/t of its
    group's t x micro-batch sequences, one micro-batch's worth (a pipeline's first stage: its
    layers, min(pp, m) micro-batches in flight under 1F1B); the logits stay split by
    vocabulary (loss_parallel), a GPU's V/t of its group's t x micro-batch sequences: one
    micro-batch's whole logits, as activations_per_gpu counts them."""
    dp, mb, w = args.gpus // (pp * tp), args.micro_batch, STATE_BYTES[args.dtype][0]
    if pp == 1:
        m, mesh = 1, f"dp {dp} x tp {tp}"
        state = fsdp_tp_state(layout, dp, tp, args.dtype)
        sent = fsdp_tp_sent(layout, dp, tp, args.dtype, mb)
        gathered = 2 * w * ((layout.blocks - layout.replicated) / tp + layout.replicated) \
            / layout.layers
        acts = activations_per_gpu(layout.layers, layout.seq, mb, layout.hidden, layout.vocab,
                                   args.dtype, checkpointing)
    else:
        m = args.micro_batches or 2 * pp
        mesh = f"pp {pp} x dp {dp} x tp {tp}, m {m}"
        state = pp_fsdp_tp_state(layout, pp, dp, tp, args.dtype)
        sent = pp_fsdp_tp_sent(layout, pp, dp, tp, m, args.dtype, mb)
        end = max(layout.embedding, layout.head + layout.tied)
        gathered = w * stage_pieces(layout, pp, tp, end)
        acts = activations_per_gpu(layout.layers, layout.seq, mb, layout.hidden, layout.vocab,
                                   args.dtype, checkpointing, math.ceil(layout.layers / pp),
                                   min(pp, m))
    total = state + gathered + acts
    return {"strategy": "FSDP x TP" if pp == 1 else "PP x FSDP x TP",
            "checkpointing": checkpointing, "state": state,
            "activations": gathered + acts, "total": total,
            "fits": total <= args.gpu_mem * GB, "sent": sum(sent.values()), "by_dim": sent,
            "network": sent["dp"] + sent.get("pp", 0.0) if args.gpus > args.gpus_per_node
            else 0.0, "mesh": mesh, "bubble": (pp - 1) / (m + pp - 1),
            "sequences": dp * m * tp * mb}


def pipeline_depths(args: argparse.Namespace, tp: int) -> list[int]:
    """The pp PP x FSDP x TP may take: --pp, else each divisor of the GPUs TP leaves (gpus/tp)
    from 2 up to the layers; none when TP takes them all."""
    if args.pp:
        return [args.pp]
    across = args.gpus // tp
    return [pp for pp in range(2, min(across, args.layers) + 1) if across % pp == 0]


def composed_rows(args: argparse.Namespace, layout: Layout) -> list[dict]:
    """FSDP x TP, then PP x FSDP x TP at the smallest pp at which it fits (fewest stages: the
    least bubble), else at the largest (the leanest), with and without checkpointing."""
    tp, rows = tp_degree(args.gpus, args.gpus_per_node), []
    for checkpointing in (False, True):
        rows.append(composed_row(args, layout, checkpointing, tp))
    depths = pipeline_depths(args, tp)
    for checkpointing in (False, True) if depths else ():
        tried = [composed_row(args, layout, checkpointing, tp, pp) for pp in depths]
        rows.append(next((r for r in tried if r["fits"]), tried[-1]))
    return rows


def plan_strategies(args: argparse.Namespace) -> list[dict]:
    """Every strategy, with and without activation checkpointing, at the planner's flags."""
    layout = layout_of(args)
    embedding = layout.embedding
    stage_layers = -(-args.layers // args.gpus)
    micro_batches = args.micro_batches or 4 * args.gpus
    stage_output = micro_batches * args.seq_len * args.micro_batch * args.hidden * \
        (2 if args.dtype == "bf16" else 4)
    w = STATE_BYTES[args.dtype][0]
    rows = []
    stream = args.layers * args.seq_len * args.micro_batch * args.hidden
    for strategy in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full", "FSDP grad-op",
                     "FSDP hybrid", "pipeline", "TP", "TP x DP"):
        # weights gathered during the step: a block and the next one's prefetch, or all of them
        block = w * (args.params - embedding) / args.layers
        gathered = {"ZeRO-3": 2 * block, "FSDP full": 2 * block, "FSDP hybrid": 2 * block,
                    "FSDP grad-op": w * args.params}.get(strategy, 0.0)
        state = state_per_gpu(strategy, args.params, args.gpus, args.dtype, args.gpus_per_node,
                              embedding)
        sent = sent_per_gpu(strategy, args.params, args.gpus, args.dtype, args.gpus_per_node,
                            stage_output, layout.tied, stream, embedding)
        for checkpointing in (False, True):
            pipeline = strategy == "pipeline"
            acts = activations_per_gpu(args.layers, args.seq_len, args.micro_batch, args.hidden,
                                       args.vocab, args.dtype, checkpointing,
                                       stage_layers if pipeline else None,
                                       min(args.gpus, micro_batches) if pipeline else 1)
            total = state + acts + gathered
            rows.append({"strategy": strategy, "checkpointing": checkpointing, "state": state,
                         "activations": acts + gathered, "total": total,
                         "fits": total <= args.gpu_mem * GB, "sent": sent,
                         "network": sent_across_nodes(strategy, sent, args.params, args.gpus,
                                                      args.dtype, args.gpus_per_node,
                                                      embedding),
                         "bubble": (args.gpus - 1) / (micro_batches + args.gpus - 1)
                         if pipeline else 0.0,
                         # a step's batch: one micro-batch a GPU, or m through the pipeline
                         "sequences": args.micro_batch * (micro_batches if pipeline
                                                          else args.gpus)})
    return rows + composed_rows(args, layout)


def choose(rows: list[dict]) -> dict | None:
    """The planner's pick, a decision matrix: of what fits, what fits without activation
    checkpointing if anything does (recomputing the forward costs about a third more compute);
    of those the fewest bytes a trained sequence across nodes (the slow link: none on one node,
    where NVLink makes bytes cheap); ties to the first in the table's order, the simplest (DDP,
    then the ZeRO stages, FSDP, ..., the composed layouts). It weighs neither a pipeline's
    bubble nor compute."""
    fitting = [r for r in rows if r["fits"]]
    plain = [r for r in fitting if not r["checkpointing"]] or fitting
    return min(plain, key=lambda r: round(r["network"] / r["sequences"]), default=None)


def row_name(row: dict) -> str:
    mesh = f" ({row['mesh']})" if row.get("mesh") else ""
    return f"{row['strategy']}{mesh}{' with activation checkpointing' * row['checkpointing']}"


def why_picked(rows: list[dict], best: dict, gpu_mem: float) -> str:
    """`choose`'s pick and why, in a sentence: what it needs, what the simplest (DDP) or
    anything without checkpointing would need, and across nodes, what it sends there against
    the next best that fits."""
    why = [f"{best['total'] / GB:,.1f} of {gpu_mem:g} GB a GPU"]
    ddp = rows[0]  # DDP without checkpointing: the whole model and its state on every GPU
    if best is not ddp:
        why.append(f"DDP needs {ddp['total'] / GB:,.1f}")
    if best["checkpointing"]:
        leanest = min((r for r in rows if not r["checkpointing"]), key=lambda r: r["total"])
        why.append(f"without checkpointing the leanest ({row_name(leanest)}) needs "
                   f"{leanest['total'] / GB:,.1f}")
    if any(r["network"] for r in rows):
        per_sequence = [r for r in rows if r["fits"] and r["checkpointing"] ==
                        best["checkpointing"] and r["strategy"] != best["strategy"]]
        line = (f"it sends {best['network'] / GB:,.2f} GB a GPU across nodes a step of "
                f"{best['sequences']} sequences")
        if per_sequence:
            other = min(per_sequence, key=lambda r: r["network"] / r["sequences"])
            line += (f" (the next fewest a sequence, {other['strategy']}: "
                     f"{other['network'] / GB:,.2f} GB for {other['sequences']})")
        why.append(line)
    else:
        why.append("on one node the simplest that fits")
    bubble = f"; its bubble idles {best['bubble']:.0%} of the step" if best["bubble"] else ""
    return f"{row_name(best)}: {'; '.join(why)}{bubble}."


def by_dim_text(row: dict) -> str:
    """A composed row's bytes by mesh dim, in GB: TP's inside the node, FSDP's (dp) and the
    pipeline's (pp) across nodes."""
    if "by_dim" not in row:
        return ""
    sent = row["by_dim"]
    return f"{row['mesh']}: " + " / ".join(f"{label} {sent[dim] / GB:,.2f}" for dim, label in
                                          (("tp", "TP"), ("dp", "FSDP"), ("pp", "PP"))
                                          if dim in sent)


def render_plan(args: argparse.Namespace) -> str:
    rows = plan_strategies(args)
    table = [[r["strategy"], "yes" if r["checkpointing"] else "no", f"{r['state'] / GB:,.1f}",
              f"{r['activations'] / GB:,.1f}", f"{r['total'] / GB:,.1f}",
              "yes" if r["fits"] else "no", r["sequences"], f"{r['sent'] / GB:,.2f}",
              f"{r['network'] / GB:,.2f}", f"{r['bubble']:.2f}" if r["bubble"] else "",
              by_dim_text(r)] for r in rows]
    fitting = [r for r in rows if r["fits"]]
    nodes = -(-args.gpus // args.gpus_per_node)
    lines = [f"{args.params:.3g} parameters ({'Llama' if args.llama else 'GPT-2'} layout), "
             f"{args.gpus} GPUs of {args.gpu_mem:g} GB ({nodes} node{'s' * (nodes > 1)} of "
             f"{args.gpus_per_node}), {args.dtype}, micro-batch {args.micro_batch} x "
             f"{args.seq_len} tokens", "",
             tabulate(table, ["strategy", "act. ckpt", "state GB", "activations (+gathered) GB",
                              "total GB", "fits", "sequences/step", "GB sent/GPU/step",
                              "of which across nodes", "bubble", "mesh: GB by dim"],
                      tablefmt="github"), ""]
    if fitting:
        # per sequence trained: a pipeline's step carries m micro-batches, a data-parallel one
        # one a GPU
        best = min(fitting, key=lambda r: (r["sent"] / r["sequences"], r["checkpointing"]))
        bubble = f"; its bubble idles {best['bubble']:.0%} of the step" if best["bubble"] else ""
        lines += [f"Fits: {', '.join(dict.fromkeys(r['strategy'] for r in fitting))}.",
                  f"Cheapest in communication that fits: {best['strategy']}"
                  f"{' with activation checkpointing' if best['checkpointing'] else ''} "
                  f"({best['sent'] / GB:,.2f} GB sent per GPU per step of {best['sequences']} "
                  f"sequences{bubble}).",
                  f"Pick: {why_picked(rows, choose(rows), args.gpu_mem)}"]
    else:
        least = min(rows, key=lambda r: r["total"])
        lines += [f"Nothing fits: the leanest ({least['strategy']} with checkpointing) needs "
                  f"{least['total'] / GB:,.1f} GB a GPU. Add GPUs (--gpus), shorten --seq-len "
                  f"or --micro-batch, or use bf16."]
    return "\n".join(lines)


# The seed guide's decision matrix, worked: each model at its real shape, on GPUs of 80 GB, bf16
CASES = [("ResNet-50 on 8 GPUs", {"params": 25.6e6, "gpus": 8, "layers": 16, "hidden": 1024,
                                  "vocab": 1000, "seq_len": 196, "micro_batch": 32},
          "a decoder-shaped stand-in: its 16 bottleneck blocks as layers of 1,024 units over 14 x "
          "14 = 196 positions, 1,000 classes, 32 images a GPU; its activations are a rough guess"),
         ("GPT-2 1.5B on 4 GPUs", {"params": 1.5e9, "gpus": 4, "layers": 48, "hidden": 1600,
                                   "vocab": 50257, "seq_len": 1024}, None),
         ("LLaMA-7B on 8 GPUs", {"params": 7e9, "gpus": 8, "layers": 32, "hidden": 4096,
                                 "vocab": 32000, "seq_len": 4096, "llama": True}, None),
         ("LLaMA-70B on 64 GPUs", {"params": 70e9, "gpus": 64, "layers": 80, "hidden": 8192,
                                   "vocab": 32000, "seq_len": 4096, "llama": True}, None)]
CASE_FLAGS = {"gpu_mem": 80.0, "gpus_per_node": 8, "micro_batch": 1, "micro_batches": None,
              "dtype": "bf16", "llama": False, "pp": None}


def render_cases() -> str:
    """Each of CASES with what the planner picks (`choose`) and why, one paragraph a case."""
    lines = [f"GPUs of {CASE_FLAGS['gpu_mem']:g} GB, {CASE_FLAGS['gpus_per_node']} a node, "
             f"{CASE_FLAGS['dtype']}, micro-batch {CASE_FLAGS['micro_batch']} a GPU unless said. "
             "Pick: what fits, without activation checkpointing if anything does; then the fewest "
             "bytes a sequence across nodes; then the simplest.", ""]
    for name, flags, note in CASES:
        args = argparse.Namespace(**{**CASE_FLAGS, **flags})
        rows = plan_strategies(args)
        best = choose(rows)
        pick = why_picked(rows, best, args.gpu_mem) if best else "nothing fits."
        count = f"{args.params / 1e9:g}B" if args.params >= 1e9 else f"{args.params / 1e6:g}M"
        lines.append(f"{name} ({count} parameters{f'; {note}' if note else ''}): {pick}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The recipes: every script with the first line (sentence) of its docstring, by folder
# ---------------------------------------------------------------------------------------------
def list_scripts(root: Path = common.ROOT) -> str:
    lines, width = [], max(len(s.name) for s in root.glob("[0-9][0-9]_*/*.py"))
    for folder in sorted(root.glob("[0-9][0-9]_*/")):
        lines += ["", f"{folder.name}/"]
        for script in sorted(folder.glob("*.py")):
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
            summary = " ".join(doc.split("\n\n")[0].split())  # its first line, wrapped or not
            lines.append(f"  {script.name:<{width}} {summary}")
    return "\n".join(lines[1:])


# ---------------------------------------------------------------------------------------------
# Runs seen from the Makefile: a failed run's one line and record, and `make smoke`
# ---------------------------------------------------------------------------------------------
_SCRIPT_ERROR = re.compile(r"^(\S+\.py: error: .*|rank \d+ failed: .*)$", re.M)
_FIRST_DEATH = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def failure_line(output: str, exit_code: int) -> str:
    """A failed run's cause in one line, from its output: the script's own error (a refused
    flag, or the line `run_main` prints before a traceback), else what torchrun saw of the
    first rank to die (a crash, a kill), else the exit code."""
    if found := _SCRIPT_ERROR.search(output):
        return found.group(1)
    # torchrun lists the other ranks' failures first, then the "Root Cause" (the first to die)
    found = _FIRST_DEATH.search(output, max(0, output.find("Root Cause")))
    who, code = (f"rank {found[1]}", int(found[2])) if found else ("a rank", exit_code)
    if code < 0:
        return f"{who} was killed by signal {-code}"
    return f"{who} exited with code {code}"


def _own_record(results: Path, script: Path, variant: str | None, since: float) -> dict | None:
    """The record the run of `script` (with `variant`) begun at `since` wrote, if any."""
    since_time = datetime.datetime.fromtimestamp(int(since), datetime.UTC)
    return next((rec for rec in reversed(common.load_results(results))
                 if (rec.get("folder"), rec.get("script"), rec.get("variant")) ==
                 (script.resolve().parent.name, script.stem, variant)
                 and datetime.datetime.fromisoformat(rec["time"]) >= since_time), None)


def _flags_of(script_args: Sequence[str]) -> tuple[argparse.Namespace, str | None]:
    """The shared flags of a run (for its results file and size) and its variant, also when
    the script refused them (then `--results`, `--size` read leniently and no variant)."""
    try:
        with contextlib.redirect_stderr(None):
            shared = common.parser(None)
            run_args, own_flags = shared.parse_known_args(script_args)
        return run_args, " ".join(shared.fill_shape(run_args) + own_flags) or None
    except SystemExit:
        lenient = argparse.ArgumentParser(add_help=False)
        lenient.add_argument("--results", type=Path, default=common.RESULTS)
        lenient.add_argument("--size")
        return lenient.parse_known_args(script_args)[0], None


def mark_failed(script: Path, script_args: Sequence[str], since: float, exit_code: int,
                log_path: Path, world_size: int, record: bool = True) -> str:
    """A run ended non-zero: the line to show (its output's `failure_line`), after writing a
    `failed` record when the run wrote none (a run that recorded itself keeps its own row: a
    failure's reason, or a result written before a crash in teardown)."""
    run_args, variant = _flags_of(script_args)
    own = _own_record(run_args.results, script, variant, since) if record else None
    if own and own["status"] == "failed":
        return own["reason"]
    reason = failure_line(log_path.read_text(errors="replace") if log_path.exists() else "",
                          exit_code)
    if own:
        return f"{reason}, after recording {own['status']}"
    if record:
        rec = common.base_record(run_args, None, None, "failed", reason)
        rec.update(folder=script.resolve().parent.name, script=script.stem,
                   world_size=world_size, variant=variant)
        common.append_record(run_args.results, rec)
    return reason


def _fork_rank(script: str, argv: list[str], env: dict[str, str], log_fd: int) -> int:
    """A process that runs `script` as one rank, as torchrun would start it, but forked from
    this interpreter: torch is imported once, not twice a run. CUDA cannot be used in a child
    forked after its parent initialised it, so this interpreter never touches torch.cuda."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(env)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.argv = [script, *argv]
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def smoke(runs: Sequence[str], nproc: int, flags: Sequence[str], out: Path,
          timeout: float) -> int:
    """`make smoke`: every run (a script and its flags) once, `nproc` ranks on this host, one
    line each: ok, over tolerance (its losses strayed from its baseline's, run just before, by
    more than its script allows), skipped (why) or FAILED (its error line). Returns 1 if any
    failed."""
    results, logs = out / "results.jsonl", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed, over, began = 0, 0, time.monotonic()
    width = max(map(len, runs), default=0)  # every verdict in one column
    for run in runs:
        script, *own = run.split()
        log_path = logs / (Path(script).stem + "".join(own).replace("/", "_") + ".log")
        argv = [*flags, *own, "--results", str(results)]
        since, port = time.time(), common.free_port()
        sys.stdout.flush()
        with open(log_path, "w") as log_file:
            pids = [_fork_rank(script, argv, {
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}, log_file.fileno()) for r in range(nproc)]
        codes, deadline = {}, time.monotonic() + timeout
        while len(codes) < nproc and time.monotonic() < deadline:
            for pid in set(pids) - set(codes):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        hung = set(pids) - set(codes)
        for pid in hung:  # past the timeout: a hang is a failure, not a wait
            os.kill(pid, signal.SIGKILL)
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        code = next((codes[pid] for pid in pids if codes[pid]), 0)
        own = _own_record(results, Path(script), _flags_of(argv)[1], since)
        base = next((rec for rec in reversed(common.load_results(results)) if own
                     and rec.get("script") == own.get("baseline")
                     and common.run_key(rec) == common.run_key(own)), None)
        if code == 0 and own and own["status"] == "ok" and over_tolerance(own, base):
            diff = max_loss_diff(own["losses"], base["losses"])
            line = f"over tolerance (max loss difference {diff:.2e} > {own['loss_tolerance']:g})" \
                if own.get("loss_tolerance_final_rel") is None else \
                f"over tolerance (final loss {own['losses'][-1]:.3f} against " \
                f"{base['losses'][-1]:.3f}, more than {own['loss_tolerance_final_rel']:.0%} apart)"
            over += 1
        elif code == 0 and own and own["status"] == "ok":
            line = f"ok ({own['step_ms']:.1f} ms/step, loss {own['losses'][-1]:.3f})" \
                if "losses" in own else f"ok ({len(own['sweep'])} sizes x ops timed)"
        elif code == 0 and own and own["status"] == "skipped":
            line = f"skipped: {own['reason']}"
        else:  # recorded by a Python of its own: this one must never touch CUDA (see above)
            reason = f"timed out after {timeout:.0f} s" if hung else subprocess.run(
                [sys.executable, __file__, "mark-failed", script, "--since", str(since),
                 "--exit-code", str(code or 1), "--log", str(log_path), "--world-size",
                 str(nproc), "--", *argv], capture_output=True, text=True).stdout.strip()
            line, failed = f"FAILED: {reason} (log: {log_path})", failed + 1
        print(f"{run:<{width}} {line}", flush=True)
    print(f"smoke: {len(runs)} runs, {failed} failed, {over} over tolerance, "
          f"{time.monotonic() - began:.0f} s ({nproc} processes each)", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Command line: the results schema (`--help` prints it), the subcommands
# ---------------------------------------------------------------------------------------------
RESULTS_SCHEMA = """\
results schema: each run appends one JSON object (rank 0) to outputs/results.jsonl.
Every record:
  folder, script        e.g. 01_ddp, optimized_ddp
  baseline              the script this one is compared with (null for a baseline)
  variant               the flags that make it another run of its script (null: defaults)
  status, reason        ok | skipped (why) | failed (the script's own error line); the report
                        adds `over tolerance` when max loss difference > loss_tolerance
  time, host            when (ISO 8601, UTC) and on which host it ran
  size, model, world_size, nnodes, link, backend, device
                        the setup; link is LINK's rate (null: unshaped)
  torch, torchao, torchvision, cuda, nccl
                        versions that change results (null where absent or unused)
A training run (status ok) also:
  params                model parameters, all ranks together
  step_ms, step_ms_p90, step_ms_iqr
                        median, p90 and [q1, q3] of the timed steps' milliseconds
  tokens_per_s | samples_per_s
                        global throughput
  peak_mem_mb, memory   the busiest rank's peak over the measured step (live tensor MB on
                        CPU, with its split by kind; the allocator's on CUDA)
  peak_rss_mb | reserved_mb
                        the process's resident peak (CPU) or the allocator's reserve (CUDA)
  state_mb              the busiest rank's parameters + gradients + optimizer state
  comm_mb               MB a rank sends per step, counted where the script hands tensors over
  losses, loss_tolerance | loss_tolerance_final_rel
                        every step's loss; the largest per-step difference from the baseline
                        allowed, or (a long lossy run) how far the final loss may be from the
                        baseline's final loss, as a fraction of it
  theory                what the technique predicts, computed, beside the measured keys
  steps, warmup, batch_size, seq_len, dtype, seed, lr, startup_s, warmup_s
  load_avg, cpus        the host's 1-minute load at the first timed step and after the last,
                        and its logical cores
A collectives sweep has `sweep`: one {op, bytes, ms, algbw_gbps, busbw_gbps} per op and size.
A script adds what its technique measures (compression, bubble, timeline, optim_mb, ...).
"""


class OneLineErrors(argparse.ArgumentParser):
    """Bad flags end with one line that names what to change, as the recipes' do."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str]) -> int:
    cli = OneLineErrors(prog="report.py", description=__doc__.split("\n\n")[0],
                        epilog=RESULTS_SCHEMA, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--results", type=Path, default=common.RESULTS)
    cli.add_argument("--out", type=Path, default=common.RESULTS.parent / "report.md")
    sub = cli.add_subparsers(dest="command", parser_class=OneLineErrors)
    sub.add_parser("report", help="the results table (the default)")
    sub.add_parser("traces", help="where each traced step's time went, per script and rank")
    sub.add_parser("list", help="every script with the first line of its docstring")
    plan = sub.add_parser("plan", help="which strategy fits a model on a cluster, and its bytes")
    plan.add_argument("--params", type=common.positive_float,
                      help="model parameters, e.g. 7e9 (required, as --gpus and --gpu-mem are)")
    plan.add_argument("--gpus", type=common.int_at_least(1))
    plan.add_argument("--gpu-mem", type=common.positive_float, help="GB of memory per GPU")
    plan.add_argument("--gpus-per-node", type=common.int_at_least(1), default=8,
                      help="FSDP hybrid shards within a node, TP stays within one (default 8)")
    plan.add_argument("--layers", type=common.int_at_least(1), default=32)
    plan.add_argument("--hidden", type=common.int_at_least(1), default=4096)
    plan.add_argument("--vocab", type=common.int_at_least(1), default=32000)
    plan.add_argument("--seq-len", type=common.int_at_least(1), default=4096)
    plan.add_argument("--micro-batch", type=common.int_at_least(1), default=1,
                      help="sequences per GPU per forward")
    plan.add_argument("--micro-batches", type=common.int_at_least(1), default=None,
                      help="a pipeline's micro-batches per step (default 4 x gpus; PP x FSDP x "
                           "TP: 2 x pp)")
    plan.add_argument("--dtype", choices=sorted(STATE_BYTES), default="bf16")
    plan.add_argument("--llama", action="store_true", help="a Llama's layout: untied head, "
                      "rotary positions (no position table), RMSNorm, no biases (default GPT-2's)")
    plan.add_argument("--pp", type=common.int_at_least(2), default=None,
                      help="PP x FSDP x TP's stages (default: the fewest at which it fits)")
    plan.add_argument("--cases", action="store_true", help="the decision matrix's worked cases "
                      "(ResNet-50, GPT-2 1.5B, LLaMA-7B, LLaMA-70B): what the planner picks and "
                      "why; the other flags are not read")
    fail = sub.add_parser("mark-failed", help="(the Makefile's) a run ended non-zero: print its "
                          "error line, and record it if the run could not", epilog="Give the "
                          "script's own flags after --, to record its size and find its results "
                          "file.")
    fail.add_argument("script", type=Path)
    fail.add_argument("--since", type=float, required=True, help="epoch seconds the run began")
    fail.add_argument("--exit-code", type=int, required=True)
    fail.add_argument("--log", type=Path, required=True, help="the run's output")
    fail.add_argument("--world-size", type=int, default=1)
    fail.add_argument("--no-record", action="store_true", help="print only (not node 0)")
    run = sub.add_parser("smoke", help="(`make smoke`) every run once, one line each",
                         epilog="Give the runs (a script and its flags, quoted) after --.")
    run.add_argument("--nproc", type=int, required=True)
    run.add_argument("--flags", default="", help="flags for every run")
    run.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    # after `--`: the failed run's flags, or smoke's runs (which argparse would read as flags)
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = cli.parse_args(argv[:split]), argv[split + 1:]
    if args.command == "smoke":
        return smoke(rest, args.nproc, args.flags.split(), args.out.parent / "smoke", args.timeout)
    if args.command == "mark-failed":
        print(mark_failed(args.script, rest, args.since, args.exit_code, args.log,
                          args.world_size, record=not args.no_record))
        return 0
    if args.command == "plan":
        if args.cases:
            print(render_cases())
            return 0
        if missing := [flag for flag in ("--params", "--gpus", "--gpu-mem")
                       if getattr(args, flag[2:].replace("-", "_")) is None]:
            plan.error(f"the following arguments are required: {', '.join(missing)} (or give "
                       "--cases)")
        layout = layout_of(args)
        if args.params <= layout.embedding + layout.head:
            tables = "2 x --vocab x --hidden" if args.llama else \
                "--vocab x --hidden + --seq-len x --hidden"
            plan.error(f"--params {args.params:g} is no more than the embeddings ({tables} = "
                       f"{layout.embedding + layout.head:g}): raise --params or lower "
                       "--vocab/--hidden")
        tp = tp_degree(args.gpus, args.gpus_per_node)
        if args.pp and (args.gpus // tp % args.pp or args.pp > args.layers):
            plan.error(f"--pp {args.pp} does not divide the {args.gpus // tp} GPUs that TP "
                       f"{tp} (in a node) leaves of --gpus {args.gpus}, or exceeds --layers "
                       f"{args.layers}: use a divisor of {args.gpus // tp} up to {args.layers}")
        print(render_plan(args))
        return 0
    if args.command == "list":
        print(list_scripts())
        return 0
    records = common.load_results(args.results)
    traces = render_traces(args.results.parent / "traces", records)
    if args.command == "traces":
        print(traces or f"No traces in {args.results.parent / 'traces'}: run with --trace "
                        "(make all TRACE=1) first.")
        return 0
    charts = write_charts(records, args.out.parent / "charts")
    links = ["## Charts", ""] + [f"![{path.stem}](charts/{path.name})" for path in charts]
    text = "\n".join(filter(None, [render_report(records), traces,
                                   "\n".join(links) + "\n" if charts else ""]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
