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
import json
import math
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
        diff = common.max_loss_diff(rec.get("losses"), base.get("losses"))
        if diff is not None:
            tol = rec.get("loss_tolerance")
            verdict = "" if tol is None else (" (ok)" if diff <= tol else f" (> {tol:g})")
            dloss = f"{diff:.2e}{verdict}"
        if common.over_tolerance(rec, base):
            status = "over tolerance"
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


def trace_files(traces: Path) -> list[tuple[str, int, Path]]:
    """(folder_script, rank, path) of every per-rank trace `--trace` wrote."""
    found = []
    for path in sorted(traces.glob("*_rank*.json")):
        name, _, rank = path.stem.rpartition("_rank")
        if rank.isdigit():
            found.append((name, int(rank), path))
    return found


def render_traces(traces: Path) -> str:
    """Markdown: the breakdown of a traced step per script and rank, then its collectives."""
    files = trace_files(traces)
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


def compared_pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(optimized, baseline) of every training run the table compares: both ok, same settings."""
    runs = latest_runs(records)
    by_key = {common.run_key(r) + (_script_label(r),): r for r in runs}
    pairs = []
    for rec in runs:
        base = by_key.get(common.run_key(rec) + (rec.get("baseline"),))
        if base and rec.get("status") == base.get("status") == "ok" and "step_ms" in rec \
                and not [k for k in COMPARED if rec.get(k) != base.get(k)]:
            pairs.append((rec, base))
    return sorted(pairs, key=lambda pair: (str(pair[0]["folder"]), _script_label(pair[0])))


def _setup(rec: dict) -> str:
    return f"{rec.get('device')}, world {rec.get('world_size')}, size {rec.get('size')}"


def _setups(recs: list[dict]) -> tuple[str, list[str]]:
    """A chart's title part and each run's label suffix: the one setup they share in the title,
    or each run's own beside it when they differ."""
    if len({_setup(r) for r in recs}) == 1:
        return _setup(recs[0]), [""] * len(recs)
    return "runs on several setups", [f" [{_setup(r)}]" for r in recs]


def _speedup_chart(plt, records: list[dict], path: Path) -> bool:
    pairs = compared_pairs(records)
    if not pairs:
        return False
    setup, suffixes = _setups([r for r, _ in pairs])
    labels = [f"{r['folder']}  {_script_label(r)}" + (f" @{r['link']}" if r.get("link") else "")
              + suffix for (r, _), suffix in zip(pairs, suffixes, strict=True)]
    speedup = [b["step_ms"] / r["step_ms"] for r, b in pairs]
    memory = [r["peak_mem_mb"] / b["peak_mem_mb"] for r, b in pairs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(pairs) + 1.6), sharey=True)
    for ax, values, title in ((axes[0], speedup, "speedup over its baseline (step time)"),
                              (axes[1], memory, "peak memory / its baseline's")):
        better = [v >= 1 if ax is axes[0] else v <= 1 for v in values]
        ax.barh(range(len(values)), values, color=["#55a868" if b else "#c44e52" for b in better])
        ax.axvline(1.0, color="black", linewidth=0.8)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, max(values) * 1.2)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{setup}: green is better")
    return _save(plt, fig, path)


def _compression_chart(plt, records: list[dict], path: Path) -> bool:
    runs = [r for r in latest_runs(records)
            if r.get("folder") == "02_compression" and r.get("status") == "ok"]
    if not runs:
        return False
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
    return _save(plt, fig, path)


def _pipeline_chart(plt, records: list[dict], path: Path) -> bool:
    runs = [r for r in latest_runs(records) if r.get("folder") == "05_pipeline"
            and r.get("status") == "ok" and r.get("timeline")]
    if not runs:
        return False
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.0 + 0.45 * sum(
        len(r["timeline"]) + 1.5 for r in runs)), squeeze=False)
    for ax, rec in zip(axes[:, 0], runs, strict=True):
        t0 = min(a[3] for lane in rec["timeline"] for a in lane)
        for rank, lane in enumerate(rec["timeline"]):
            first_stage = min(a[2] for a in lane)
            for kind, mb, stage, start, end in lane:
                ax.broken_barh([(1e3 * (start - t0), 1e3 * (end - start))], (rank - 0.4, 0.8),
                               facecolor=KIND_COLOURS.get(kind, "grey"), edgecolor="white",
                               hatch="//" if stage != first_stage else None)
                ax.text(1e3 * ((start + end) / 2 - t0), rank, f"{mb}", ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(rec["timeline"])),
                      [f"rank {r}" for r in range(len(rec["timeline"]))])
        ax.invert_yaxis()
        bubble = rec.get("bubble")
        ax.set_title(f"{_script_label(rec)}: measured bubble "
                     f"{'?' if bubble is None else f'{bubble:.3f}'}", fontsize=10)
    axes[-1, 0].set_xlabel("ms into the step (blank: idle; hatched: the rank's second stage)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    fig.legend(handles, ["F forward", "B backward", "I input grad", "W weight grad"],
               loc="upper center", ncol=4, fontsize=8)
    return _save(plt, fig, path, top=1 - 0.35 / fig.get_figheight())


def _busbw_chart(plt, records: list[dict], path: Path) -> bool:
    sweeps = [r for r in latest_runs(records) if r.get("status") == "ok" and r.get("sweep")]
    ops = sorted({row["op"] for r in sweeps for row in r["sweep"]})
    if not ops:
        return False
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
    return _save(plt, fig, path, bottom=0.1)


def _save(plt, fig, path: Path, top: float = 1.0, bottom: float = 0.0) -> bool:
    fig.tight_layout(rect=(0, bottom, 1, top))  # room for a legend above or below the plots
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


CHARTS = {"speedup.png": _speedup_chart, "compression_bytes.png": _compression_chart,
          "pipeline_timelines.png": _pipeline_chart, "symmem_busbw.png": _busbw_chart}


def write_charts(records: list[dict], out_dir: Path) -> list[Path]:
    """Every chart the records have data for, as PNGs in `out_dir`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    return [out_dir / name for name, draw in CHARTS.items() if draw(plt, records, out_dir / name)]


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
    (token and position tables; the tied head repeats the token table on the last stage)."""
    w, g, o = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    return {"DDP": (w + g + o) * params,
            "ZeRO-1": (w + g) * params + o * params / n,
            "ZeRO-2": w * params + (g + o) * params / n,
            "ZeRO-3": (w + g + o) * params / n,
            "FSDP full": (w + g + o) * params / n,
            "FSDP grad-op": (w + g + o) * params / n,
            "FSDP hybrid": (w + g + o) * params / hybrid,
            "pipeline": (w + g + o) * ((params - embedding) / n + embedding)}[strategy]


def sent_per_gpu(strategy: str, params: float, gpus: int, dtype: str = "fp32",
                 per_node: int = 8, stage_output_bytes: float = 0.0,
                 tied_params: float = 0.0) -> float:
    """Bytes the busiest GPU sends per optimizer step, ring collectives: an all-reduce sends
    2(n-1)/n of the message, an all-gather or reduce-scatter (n-1)/n. A pipeline: a middle
    stage sends the activations it hands on in a step (`stage_output_bytes`, every
    micro-batch's) and as many gradients back; an end stage one of the two, and the gradient of
    the token table tied to the head (`tied_params`), all-reduced with the other end."""
    w, g, _ = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    share, replicas = (n - 1) / n, max(1, n // hybrid)
    return {"DDP": 2 * share * g * params,  # all-reduce the gradients
            "ZeRO-1": share * (g + w) * params,  # reduce-scatter grads, all-gather weights
            "ZeRO-2": share * (g + w) * params,
            "ZeRO-3": share * (2 * w + g) * params,  # gather twice (forward, backward)
            "FSDP full": share * (2 * w + g) * params,
            "FSDP grad-op": share * (w + g) * params,  # kept gathered from forward to backward
            "FSDP hybrid": (hybrid - 1) / hybrid * (2 * w + g) * params
            + 2 * (replicas - 1) / replicas * g * params / hybrid,
            "pipeline": 0.0 if n == 1 else max(stage_output_bytes + g * tied_params,
                                               2 * stage_output_bytes if n > 2 else 0.0)
            }[strategy]


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


def plan_strategies(args: argparse.Namespace) -> list[dict]:
    """Every strategy, with and without activation checkpointing, at the planner's flags."""
    embedding = args.vocab * args.hidden + args.seq_len * args.hidden
    stage_layers = -(-args.layers // args.gpus)
    micro_batches = args.micro_batches or 4 * args.gpus
    stage_output = micro_batches * args.seq_len * args.micro_batch * args.hidden * \
        (2 if args.dtype == "bf16" else 4)
    w = STATE_BYTES[args.dtype][0]
    rows = []
    for strategy in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full", "FSDP grad-op",
                     "FSDP hybrid", "pipeline"):
        # weights gathered during the step: a block and the next one's prefetch, or all of them
        block = w * (args.params - embedding) / args.layers
        gathered = {"ZeRO-3": 2 * block, "FSDP full": 2 * block, "FSDP hybrid": 2 * block,
                    "FSDP grad-op": w * args.params}.get(strategy, 0.0)
        state = state_per_gpu(strategy, args.params, args.gpus, args.dtype, args.gpus_per_node,
                              embedding)
        for checkpointing in (False, True):
            pipeline = strategy == "pipeline"
            acts = activations_per_gpu(args.layers, args.seq_len, args.micro_batch, args.hidden,
                                       args.vocab, args.dtype, checkpointing,
                                       stage_layers if pipeline else None,
                                       min(args.gpus, micro_batches) if pipeline else 1)
            total = state + acts + gathered
            rows.append({"strategy": strategy, "checkpointing": checkpointing, "state": state,
                         "activations": acts + gathered, "total": total,
                         "fits": total <= args.gpu_mem * GB,
                         "sent": sent_per_gpu(strategy, args.params, args.gpus, args.dtype,
                                              args.gpus_per_node, stage_output,
                                              args.vocab * args.hidden),
                         "bubble": (args.gpus - 1) / (micro_batches + args.gpus - 1)
                         if pipeline else 0.0,
                         # a step's batch: one micro-batch a GPU, or m through the pipeline
                         "sequences": args.micro_batch * (micro_batches if pipeline
                                                          else args.gpus)})
    return rows


def render_plan(args: argparse.Namespace) -> str:
    rows = plan_strategies(args)
    table = [[r["strategy"], "yes" if r["checkpointing"] else "no", f"{r['state'] / GB:,.1f}",
              f"{r['activations'] / GB:,.1f}", f"{r['total'] / GB:,.1f}",
              "yes" if r["fits"] else "no", r["sequences"], f"{r['sent'] / GB:,.2f}",
              f"{r['bubble']:.2f}" if r["bubble"] else ""] for r in rows]
    fitting = [r for r in rows if r["fits"]]
    lines = [f"{args.params:.3g} parameters, {args.gpus} GPUs of {args.gpu_mem:g} GB, "
             f"{args.dtype}, micro-batch {args.micro_batch} x {args.seq_len} tokens", "",
             tabulate(table, ["strategy", "act. ckpt", "state GB", "activations (+gathered) GB",
                              "total GB", "fits", "sequences/step", "GB sent/GPU/step",
                              "bubble"],
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
                  f"sequences{bubble})."]
    else:
        least = min(rows, key=lambda r: r["total"])
        lines += [f"Nothing fits: the leanest ({least['strategy']} with checkpointing) needs "
                  f"{least['total'] / GB:,.1f} GB a GPU. Add GPUs (--gpus), shorten --seq-len "
                  f"or --micro-batch, or use bf16."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The recipes: every script with the first line (sentence) of its docstring, by folder
# ---------------------------------------------------------------------------------------------
def list_scripts(root: Path = common.ROOT) -> str:
    lines = []
    for folder in sorted(root.glob("[0-9][0-9]_*/")):
        lines += ["", f"{folder.name}/"]
        for script in sorted(folder.glob("*.py")):
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
            summary = " ".join(doc.split("\n\n")[0].split())  # its first line, wrapped or not
            lines.append(f"  {script.name:<36} {summary}")
    return "\n".join(lines[1:])


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
class OneLineErrors(argparse.ArgumentParser):
    """Bad flags end with one line that names what to change, as the recipes' do."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str]) -> int:
    cli = OneLineErrors(prog="report.py", description=__doc__.split("\n\n")[0])
    cli.add_argument("--results", type=Path, default=common.RESULTS)
    cli.add_argument("--out", type=Path, default=common.RESULTS.parent / "report.md")
    sub = cli.add_subparsers(dest="command", parser_class=OneLineErrors)
    sub.add_parser("report", help="the results table (the default)")
    sub.add_parser("traces", help="where each traced step's time went, per script and rank")
    sub.add_parser("list", help="every script with the first line of its docstring")
    plan = sub.add_parser("plan", help="which strategy fits a model on a cluster, and its bytes")
    plan.add_argument("--params", type=common.positive_float, required=True,
                      help="model parameters, e.g. 7e9")
    plan.add_argument("--gpus", type=common.int_at_least(1), required=True)
    plan.add_argument("--gpu-mem", type=common.positive_float, required=True,
                      help="GB of memory per GPU")
    plan.add_argument("--gpus-per-node", type=common.int_at_least(1), default=8,
                      help="FSDP hybrid shards within a node (default 8)")
    plan.add_argument("--layers", type=common.int_at_least(1), default=32)
    plan.add_argument("--hidden", type=common.int_at_least(1), default=4096)
    plan.add_argument("--vocab", type=common.int_at_least(1), default=32000)
    plan.add_argument("--seq-len", type=common.int_at_least(1), default=4096)
    plan.add_argument("--micro-batch", type=common.int_at_least(1), default=1,
                      help="sequences per GPU per forward")
    plan.add_argument("--micro-batches", type=common.int_at_least(1), default=None,
                      help="a pipeline's micro-batches per step (default 4 x gpus)")
    plan.add_argument("--dtype", choices=sorted(STATE_BYTES), default="bf16")
    args = cli.parse_args(argv)
    if args.command == "plan":
        embedding = args.vocab * args.hidden + args.seq_len * args.hidden
        if args.params <= embedding:
            plan.error(f"--params {args.params:g} is no more than the embeddings (--vocab x "
                       f"--hidden + --seq-len x --hidden = {embedding:g}): raise --params or "
                       "lower --vocab/--hidden")
        print(render_plan(args))
        return 0
    if args.command == "list":
        print(list_scripts())
        return 0
    traces = render_traces(args.results.parent / "traces")
    if args.command == "traces":
        print(traces or f"No traces in {args.results.parent / 'traces'}: run with --trace "
                        "(make all TRACE=1) first.")
        return 0
    records = common.load_results(args.results)
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
