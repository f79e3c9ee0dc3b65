"""The results table: the latest run of each script, grouped by folder, each optimized row beside
its baseline (speedup, memory ratio, largest loss difference, theory beside measurement). Also
how a record is read back: its pairing, its tolerance, whether its host was busy."""

from __future__ import annotations

import re
import textwrap

from tabulate import tabulate

import common


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
def script_label(rec: dict) -> str:
    """The script, and its flags where they differ from the defaults."""
    return " ".join(filter(None, [rec.get("script"), rec.get("variant")]))


def row_label(rec: dict) -> str:
    """A row's name in the table and the charts: its script label, and `vs <its baseline>`
    where that is not one of its folder's `baseline_*` scripts (03's FP8 row is compared with
    optimized_fsdp, though it sits after baseline_fsdp's rows)."""
    baseline = rec.get("baseline")
    ours = f" vs {baseline}" if baseline and not baseline.startswith("baseline_") else ""
    return script_label(rec) + ours


def latest_runs(records: list[dict]) -> list[dict]:
    """The last record of each (folder, script and variant, size, model, world, device, link)."""
    latest = {}
    for rec in records:
        latest[common.run_key(rec) + (script_label(rec),)] = rec
    return list(latest.values())


def _fmt(value, spec: str = ",.1f") -> str:
    return "" if value is None else format(value, spec)


def _size_label(rec: dict) -> str:
    """The size, the model unless it is the GPT, and the link where LINK shaped it."""
    model, link = rec.get("model"), rec.get("link")
    return " ".join([str(rec.get("size"))] + ([model] if model not in (None, "gpt") else [])
                    + ([f"@{link}"] if link else []))


# A speedup rests on at least this many timed steps a run: fewer, and one slow step (a page
# fault, a neighbour's burst) moves the median by more than most techniques win.
MIN_TIMED_STEPS = 5
# An optimized row is compared with its baseline only if these settings match too.
COMPARED = ("dtype", "batch_size", "seq_len", "steps", "warmup", "seed", "lr", "nnodes",
            "clip_grad_norm", "moe_balance", "init_from")


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


def too_few_steps(rec: dict) -> str | None:
    """Why a compared run's speedup is not shown though its losses are: too few timed steps."""
    steps = rec.get("steps", MIN_TIMED_STEPS)
    return f"{steps} timed steps, fewer than a speedup rests on ({MIN_TIMED_STEPS})" \
        if steps < MIN_TIMED_STEPS else None


def flag_groups(variant: str | None) -> set[str]:
    """A variant's flags, each with its values: "--stage 3 --clip-grad-norm 0.5" -> two."""
    return set(re.findall(r"--\S+(?: (?!--)\S+)*", variant or ""))


def baseline_run(rec: dict, by_key: dict) -> dict | None:
    """The run `rec` is compared with: of its baseline's runs on the same setup, the one whose
    flags are the most of `rec`'s (06's `--batch-size 1 --seq-len 32` beside its
    `--replicated-optimizer`, a flag the baseline lacks), whatever its status, so that a row
    says why it is not compared (`baseline failed`) rather than pick another run."""
    ours = flag_groups(rec.get("variant"))
    theirs = [run for run in by_key.values() if run.get("script") == rec.get("baseline")
              and common.run_key(run) == common.run_key(rec)
              and flag_groups(run.get("variant")) <= ours]
    return max(theirs, key=lambda run: len(flag_groups(run.get("variant"))), default=None)


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


def _report_cells(rec: dict, base: dict | None) -> dict:
    """A row's figures by what they are: what both the narrow and the wide table print."""
    status = rec.get("status", "?")
    cells = {"script": row_label(rec), "size": _size_label(rec), "device": rec.get("device"),
             "world": str(rec.get("world_size")), "figures": []}
    if status != "ok":
        return {**cells, "status": f"{status}: {rec.get('reason') or ''}"}
    throughput = rec.get("tokens_per_s") or rec.get("samples_per_s")
    speedup = mem_ratio = dloss = ""
    few = None
    why = why_not_compared(rec, base)
    if why is None and base is not None:
        noise = "~" if within_noise(rec, base) else ""
        few = too_few_steps(rec)
        speedup = "" if few else f"{noise}{base['step_ms'] / rec['step_ms']:.2f}x"
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
    status += f"; no speedup: {few}" if few else ""
    status += f"; {rec['note']}" if rec.get("note") else ""  # what the host changed of the run
    return {**cells, "world": _world_label(rec), "step ms": f"{rec['step_ms']:.1f}",
            "p90 ms": f"{rec['step_ms_p90']:.1f}",
            "predicted ms": _predicted_cell(rec, base if speedup else None),
            "throughput": _fmt(throughput, ",.0f"), "speedup": speedup,
            "per s": "tok/s" if rec.get("tokens_per_s") else "img/s",
            "peak MB": _fmt(rec.get("peak_mem_mb"), ",.0f"), "mem vs base": mem_ratio,
            "state MB": _fmt(rec.get("state_mb")), "comm MB/step": _fmt(rec.get("comm_mb"), ",.2f"),
            "max Δloss": dloss, "theory": _theory_cell(rec), "figures": theory_figures(rec),
            "status": status}


def _wide_row(cells: dict) -> list[str]:
    """The row of `--wide`: every column."""
    if "step ms" not in cells:  # a run that did not train: its status alone
        return [cells["script"], cells["size"], cells["world"], cells["device"], *[""] * 10,
                cells["status"]]
    return [cells["script"], cells["size"], cells["world"], cells["device"],
            f"{cells['step ms']} ({cells['p90 ms']})", cells["predicted ms"], cells["throughput"],
            cells["speedup"], cells["peak MB"], cells["mem vs base"], cells["state MB"],
            cells["comm MB/step"], cells["max Δloss"], cells["theory"], cells["status"]]


def optimized_runs(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """(run, its baseline's latest run on the same setup or None) of every training run that
    names a baseline, as the table pairs them; by folder and script."""
    runs = latest_runs(records)
    by_key = {common.run_key(r) + (script_label(r),): r for r in runs}
    found = [(rec, baseline_run(rec, by_key)) for rec in runs
             if rec.get("baseline") is not None and "sweep" not in rec]
    return sorted(found, key=lambda pair: (str(pair[0]["folder"]), script_label(pair[0])))


def compared_pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(optimized, baseline) of every run the table shows a speedup for: both ok, the same
    settings, enough timed steps."""
    return [(rec, base) for rec, base in optimized_runs(records)
            if why_not_compared(rec, base) is None and not too_few_steps(rec)]


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


def theory_figures(rec: dict) -> list[tuple[str, str, str]]:
    """(figure, predicted, measured or "") of each predicted figure, by mesh dim where it is a
    dict (`comm_mb tp`); measured where the record carries it under the same name."""
    figures = []
    for key, predicted in (rec.get("theory") or {}).items():
        if isinstance(predicted, dict):
            measured = rec[key] if isinstance(rec.get(key), dict) else {}
            figures += [(f"{key} {dim}", _number(value),
                         _number(measured[dim]) if dim in measured else "")
                        for dim, value in predicted.items()]
        else:
            measured = rec.get(key)
            figures.append((key, _number(predicted), _number(measured)
                            if isinstance(measured, (int, float)) else ""))
    return figures


def prediction_error(rec: dict) -> float | None:
    """How far the cost model's step time is from the measured one, as a fraction of it."""
    predicted = rec.get("predicted_step_ms")
    return None if predicted is None or not rec.get("step_ms") else \
        predicted / rec["step_ms"] - 1


def _predicted_cell(rec: dict, base: dict | None = None) -> str:
    """The predicted step time, how far from the measured one, and what binds it; beside a
    baseline, the speedup predicted over it (`; 1.07x`)."""
    error = prediction_error(rec)
    if error is None:
        return ""
    ratio = predicted_speedup(rec, base) if base is not None else None
    return (f"{rec['predicted_step_ms']:.1f} ({error:+.0%} {rec['prediction']['bound_by']}"
            + (f"; {ratio:.2f}x" if ratio else "") + ")")


def predicted_speedup(rec: dict, base: dict) -> float | None:
    """The speedup the model predicts over the baseline: the baseline's predicted step over
    this one's, both priced from the same `make` run's calibration, as the measured speedup
    divides two steps timed on the same host within minutes: its drift cancels in both."""
    ours, theirs = rec.get("predicted_step_ms"), base.get("predicted_step_ms")
    return theirs / ours if ours and theirs else None


def speedup_error(rec: dict, base: dict) -> float | None:
    """How far the predicted speedup is from the measured one, as a fraction of it."""
    predicted = predicted_speedup(rec, base)
    return None if predicted is None else predicted / (base["step_ms"] / rec["step_ms"]) - 1


# The cost model's target on the runs it can see: a prediction this close to the measured step
PREDICTION_BAND, PREDICTION_MISS = 0.15, 0.30


def prediction_summary(runs: list[dict]) -> str:
    """How many of the table's predicted rows fall within PREDICTION_BAND of the measured step,
    from which calibration, and each row off by more than PREDICTION_MISS."""
    predicted = [r for r in runs if prediction_error(r) is not None]
    if not predicted:
        return ""
    near = [r for r in predicted if abs(prediction_error(r)) <= PREDICTION_BAND]
    misses = sorted((r for r in predicted if abs(prediction_error(r)) > PREDICTION_MISS),
                    key=prediction_error)
    used = sorted({r["prediction"]["calibration"] for r in predicted})
    line = (f"predicted = the step-time model's (report/costmodel.py: compute, exposed "
            f"collectives, optimizer, bubble) at this host's calibration ({'; '.join(used)}): "
            f"{len(near)} of {len(predicted)} rows within ±{PREDICTION_BAND:.0%} of the "
            f"measured step, the part named the largest.")
    if misses:
        line += f" Off by more than {PREDICTION_MISS:.0%}: " + ", ".join(
            f"{row_label(r)} ({_size_label(r)}, {r['world_size']}: "
            f"{prediction_error(r):+.0%})" for r in misses) + "."
    return line


def speedup_summary(pairs: list[tuple[dict, dict]]) -> str:
    """How many of the compared runs' predicted speedups fall within PREDICTION_BAND of the
    measured ones, and each off by more than PREDICTION_MISS."""
    errors = [(rec, speedup_error(rec, base)) for rec, base in pairs]
    errors = [(rec, error) for rec, error in errors if error is not None]
    if not errors:
        return ""
    near = [rec for rec, error in errors if abs(error) <= PREDICTION_BAND]
    misses = sorted(((rec, e) for rec, e in errors if abs(e) > PREDICTION_MISS),
                    key=lambda pair: pair[1])
    line = (f"predicted speedup (after the predicted step) = the baseline's predicted step over "
            f"the run's: {len(near)} of {len(errors)} within ±{PREDICTION_BAND:.0%} of the "
            f"measured speedup.")
    if misses:
        line += f" Off by more than {PREDICTION_MISS:.0%}: " + ", ".join(
            f"{row_label(r)} ({_size_label(r)}, {r['world_size']}: {e:+.0%})"
            for r, e in misses) + "."
    return line


def json_rows(records: list[dict]) -> list[dict]:
    """`python -m report --json`: every measured run of the table (priced: costmodel.priced),
    with its measured and predicted step and, beside a baseline it is compared with
    (compared_pairs'), both steps and the measured and predicted speedups."""
    bases = {id(rec): base for rec, base in compared_pairs(records)}
    rows = []
    for rec in latest_runs(records):
        if rec.get("status") != "ok" or "sweep" in rec or rec.get("step_ms") is None:
            continue
        base, prediction = bases.get(id(rec)), rec.get("prediction") or {}
        predicted = base and predicted_speedup(rec, base)
        rows.append({
            **{k: rec.get(k) for k in ("folder", "script", "variant", "baseline", "size",
                                       "model", "world_size", "device", "dtype", "time")},
            "step_ms": rec["step_ms"], "predicted_step_ms": rec.get("predicted_step_ms"),
            "bound_by": prediction.get("bound_by"), "calibration": prediction.get("calibration"),
            "why_not_predicted": prediction.get("why"),
            "baseline_step_ms": base and base["step_ms"],
            "baseline_predicted_step_ms": base and base.get("predicted_step_ms"),
            "speedup": base and round(base["step_ms"] / rec["step_ms"], 4),
            "predicted_speedup": round(predicted, 4) if predicted else None})
    return rows


# The table a reader scans: what the technique won, at what memory and bytes, at which losses;
# the setup above it, the theory and the spread below it (`--wide`: every column in one table).
REPORT_HEADERS = ["script", "step ms", "speedup", "peak MB (x)", "state MB", "comm MB",
                  "max Δloss", "status"]
WIDE_HEADERS = ["script", "size", "world", "device", "step ms (p90)", "predicted ms",
                "tok/s (img/s)", "speedup", "peak MB", "mem vs base", "state MB", "comm MB/step",
                "max Δloss", "theory", "status"]
SETUP = ("size", "world", "device")  # the table's caption; a row that differs says so


def _most_common(values: list[str]) -> str:
    return max(dict.fromkeys(values), key=values.count)


def _wrapped(text: str) -> list[str]:
    """A markdown list item, wrapped so that no line of a README runs past 100 columns."""
    return textwrap.wrap(text, 100, initial_indent="- ", subsequent_indent="  ",
                         break_on_hyphens=False, break_long_words=False)


def _unlike(key: str, ours: str, shared: str) -> str:
    """How a row's setup differs from its table's: `world 4 (dp 2 x tp 2)`; of the size label,
    the words the table's lacks (`llama`, `@1gbit`; the whole label where the size differs)."""
    if key == "world":
        return f"world {ours}"
    extra = [word for word in ours.split() if word not in shared.split()]
    return " ".join(extra) if key == "size" and ours.split()[0] == shared.split()[0] else ours


def narrow_tables(rows: list[dict]) -> str:
    """One folder's runs (each `_report_cells`): the setup most of them share, the main table
    (REPORT_HEADERS), each status's detail as a numbered note, and below, each run's spread,
    throughput, predicted step and theory beside measurement."""
    shared = {key: _most_common([str(row[key]) for row in rows]) for key in SETUP}
    notes: dict[str, int] = {}
    table, detail = [], []
    for row in rows:
        unlike = [_unlike(key, str(row[key]), shared[key]) for key in SETUP
                  if str(row[key]) != shared[key]]
        # a path in the flags by its last part: the row stays one line of the screen
        label = re.sub(r"\S+/(?=[^/\s]+)", ".../", row["script"]) + \
            (f" [{', '.join(unlike)}]" if unlike else "")
        status = re.split(r"[;:]", row["status"])[0]
        if status != row["status"]:
            status += f" [{notes.setdefault(row['status'], len(notes) + 1)}]"
        if "step ms" not in row:
            table.append([label, *[""] * 6, status])
            continue
        peak = row["peak MB"] + (f" ({row['mem vs base']})" if row["mem vs base"] else "")
        table.append([label, row["step ms"], row["speedup"], peak, row["state MB"],
                      row["comm MB/step"], row["max Δloss"], status])
        measured = [f"p90 {row['p90 ms']} ms", f"{row['throughput']} {row['per s']}"]
        measured += [f"predicted {row['predicted ms']} ms"] if row["predicted ms"] else []
        theory = [f"{figure} {predicted}" + (f" (measured {seen})" if seen else "")
                  for figure, predicted, seen in row["figures"]]
        detail += _wrapped(f"`{label}`: {', '.join(measured)}"
                           + (f"; theory: {', '.join(theory)}" if theory else ""))
    out = [f"{shared['size']} · world {shared['world']} · {shared['device']}", "",
           tabulate(table, REPORT_HEADERS, tablefmt="github", disable_numparse=True,
                    colalign=("left", *["right"] * 5, "left", "left")), ""]
    for text, number in notes.items():
        out += _wrapped(f"[{number}] {text}")
    return "\n".join(out + ([""] if notes else []) + detail)


SWEEP_HEADERS = ["op", "bytes", "world", "device", "baseline", "ms", "busbw GB/s", "script",
                 "ms ", "busbw GB/s ", "speedup"]
NARROW_SWEEP_HEADERS = ["op", "bytes", "baseline ms", "baseline busbw GB/s", "ms", "busbw GB/s",
                        "speedup"]


def _sweep_table(sweeps: list[dict], by_key: dict, wide: bool) -> str:
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
                          rec.get("device"), script_label(base) if base else "",
                          _fmt(other and other["ms"], ",.3f"),
                          _fmt(other and other["busbw_gbps"], ",.2f"), script_label(rec),
                          f"{row['ms']:,.3f}", f"{row['busbw_gbps']:,.2f}",
                          f"{other['ms'] / row['ms']:.2f}x" if other else ""])
        # what only the baseline swept (on CUDA symmetric memory runs all-reduce alone)
        table += [[op, f"{nbytes:,}", rec.get("world_size"), rec.get("device"),
                   script_label(base), f"{other['ms']:,.3f}", f"{other['busbw_gbps']:,.2f}",
                   script_label(rec), "", "", ""] for (op, nbytes), other in theirs.items()]
    for rec in sweeps:  # a baseline nothing was compared with still shows its figures
        if rec.get("baseline") is None and not any(
                r.get("baseline") == rec.get("script") and common.run_key(r) == common.run_key(rec)
                for r in sweeps):
            table += [[row["op"], f"{row['bytes']:,}", rec.get("world_size"), rec.get("device"),
                       script_label(rec), f"{row['ms']:,.3f}", f"{row['busbw_gbps']:,.2f}",
                       "", "", "", ""] for row in rec["sweep"]]
    legend = ("busbw = bytes / time x 2(N-1)/N (all-reduce), (N-1)/N (all-gather, "
              "reduce-scatter, all-to-all), 1 (send/recv); speedup = baseline time / this time.")
    if wide:
        return tabulate(table, SWEEP_HEADERS, tablefmt="github") + "\n\n" + legend
    # narrow: the world, device and the two scripts, which every row of a sweep shares, above it
    shared = {i: _most_common([str(row[i]) for row in table if row[i]]) for i in (2, 3, 4, 7)}
    caption = (f"{shared[4]} (baseline) against {shared[7]} · world {shared[2]} · "
               f"{shared[3]}")
    return "\n".join([caption, "", tabulate([[row[i] for i in (0, 1, 5, 6, 8, 9, 10)]
                                            for row in table], NARROW_SWEEP_HEADERS,
                                           tablefmt="github"), "",
                      textwrap.fill(legend, 100)])


def render_report(records: list[dict], wide: bool = False) -> str:
    """Markdown: one table per folder; baselines first, each optimized row after its baseline.
    Narrow (REPORT_HEADERS, the detail below it) or `wide` (WIDE_HEADERS, all in one)."""
    runs = latest_runs(records)
    if not runs:
        return "No results yet: run `make all` (or `make ddp`) first.\n"
    by_key = {common.run_key(r) + (script_label(r),): r for r in runs}
    out = ["# Distributed Training Playbook: results", ""]
    for folder in sorted({str(r.get("folder")) for r in runs}):
        rows = sorted((r for r in runs if str(r.get("folder")) == folder),
                      key=lambda r: (str(r.get("size")), str(r.get("model")), r.get("link") or "",
                                     r.get("world_size") or 0, str(r.get("device")),
                                     (r.get("baseline") or r.get("script") or ""),
                                     r.get("baseline") is not None, r.get("variant") or ""))
        sweeps = [r for r in rows if "sweep" in r]
        cells = [_report_cells(r, baseline_run(r, by_key) if r.get("baseline") else None)
                 for r in rows if r not in sweeps]
        out += [f"## {folder}", ""]
        if cells and wide:
            out += [tabulate([_wide_row(c) for c in cells], WIDE_HEADERS, tablefmt="github"), ""]
        elif cells:
            out += [narrow_tables(cells), ""]
        if sweeps:
            out += [_sweep_table(sweeps, by_key, wide), ""]
    notes = []
    if any("sweep" not in r for r in runs):
        notes.append("speedup = baseline step time / this step time (same size, world, device "
                     "and link); " + ("mem vs base" if wide else "peak MB (x)") + " = peak "
                     "memory ratio; max Δloss = largest per-step loss difference from the "
                     "baseline, checked against the script's stated tolerance (`final +x%`: a "
                     "long run's final loss against its baseline's, checked against its stated "
                     "relative tolerance).")
    notes.append(prediction_summary([r for r in runs if "sweep" not in r]))
    notes.append(speedup_summary(compared_pairs(records)))
    if any(busy_host(r) for r in runs) or \
            any(within_noise(rec, base) for rec, base in compared_pairs(records)):
        notes.append(NOISE_NOTE)
    for note in filter(None, notes):
        out += [note if wide else textwrap.fill(note, 100, break_on_hyphens=False), ""]
    return "\n".join(out)
