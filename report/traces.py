"""Traces: where each traced step's time went, per script and rank, from the Chrome traces
`--trace` writes (`make traces`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

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
