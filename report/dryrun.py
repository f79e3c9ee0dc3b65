"""`make dryrun`'s table: each dry run's record (outputs/dryrun.jsonl, `--dry-run N`), one rank
of a world this host does not have, as its fake tensors and fake process group counted it, and
its step on an H100 as the planner's step-time model prices that work (planner.dry_run_step)."""

from __future__ import annotations

from tabulate import tabulate

from report.planner import dry_run_step

KINDS = ("params", "grads", "optim", "activations", "other")


def amount(mb: float | None, unit: str) -> str:
    """A record's MB (2^20 bytes) in `unit`, GB (10^9 bytes, the planner's) or MB (10^6)."""
    if mb is None:
        return ""
    return f"{mb * 2**20 / 1e9:,.1f}" if unit == "GB" else f"{mb * 2**20 / 1e6:,.0f}"


def figure(value: float) -> str:
    """Three significant digits under 100, whole numbers with commas from there."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def unit_of(mb: float) -> str:
    """GB from 1 GB up, MB under it: a tiny run and a 70B one in one table, each readable."""
    return "GB" if mb * 2**20 >= 1e9 else "MB"


def by_dim(rec: dict) -> str:
    """What a step sent, by mesh dim where the script names them, else in all."""
    sent = rec.get("comm_mb_by_dim") or {"": rec.get("comm_mb") or 0.0}
    unit = unit_of(max(sent.values()))
    return ", ".join(f"{dim} {amount(mb, unit)}".strip() for dim, mb in sent.items()) + f" {unit}"


def shape(rec: dict) -> str:
    """The model, its size, and the variant's flags: `llama llama2-70b --tp 8`."""
    return " ".join(str(part) for part in (rec["model"], rec["size"], rec.get("variant"))
                    if part)


def render_dry_runs(records: list[dict]) -> str:
    """The newest dry run of each (script, variant, size, model, world), as a table of the peak a
    rank holds by kind, its state, what it sends a step (by mesh dim where the script names
    them), its TFLOPs and its step on an H100 (planner.dry_run_step), and the seconds this host
    took; a run that skipped or failed, its one line instead."""
    newest = {}
    for rec in records:
        world = (rec.get("dry_run") or {}).get("world", rec.get("world_size"))
        newest[(rec["folder"], rec["script"], rec.get("variant"), rec.get("size"),
                rec.get("model"), world)] = rec
    rows, notes = [], []
    for rec in newest.values():
        name = f"{rec['folder']}/{rec['script']}"
        if rec["status"] != "ok":
            notes.append(f"- {name} ({shape(rec)}, world {rec['world_size']}): {rec['status']}, "
                         f"{rec['reason']}")
            continue
        dry, memory = rec["dry_run"], rec.get("memory", {})
        unit = unit_of(rec["peak_mem_mb"])
        rows.append([name, shape(rec), dry["world"],
                     f"{amount(rec['peak_mem_mb'], unit)} ("
                     + " / ".join(amount(memory.get(kind), unit) for kind in KINDS) + f") {unit}",
                     f"{amount(rec['state_mb'], unit_of(rec['state_mb']))} "
                     f"{unit_of(rec['state_mb'])}", by_dim(rec),
                     f"{figure((dry['flops'] or 0) / 1e12)} "
                     f"({figure(dry_run_step(dry)['step_ms'])})",
                     f"{dry['host_s']:.0f}"])
    table = tabulate(rows, headers=["script", "model", "world",
                                    "peak (" + " / ".join(KINDS) + ")", "state",
                                    "sent a step", "TFLOP (H100 ms)", "host s"],
                     tablefmt="github", disable_numparse=True)
    return table + ("\n\nNot dry-run:\n" + "\n".join(sorted(set(notes))) if notes else "")
