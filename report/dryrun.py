"""`make dryrun`'s table: each dry run's record (outputs/dryrun.jsonl, `--dry-run N`), one rank
of a world this host does not have, as its fake tensors and fake process group counted it, and
its step on an H100 as the planner's step-time model prices that work (planner.dry_run_step)."""

from __future__ import annotations

from tabulate import tabulate

from report.planner import dry_run_step

KINDS = ("params", "grads", "optim", "activations", "other")


def gb(mb: float | None) -> str:
    return "" if mb is None else f"{mb / 1024:,.1f}"


def by_dim(rec: dict) -> str:
    """The MB a step sent, by mesh dim where the script names them (else all of it as `dp`), in
    GB."""
    sent = rec.get("comm_mb_by_dim") or {"dp": rec.get("comm_mb") or 0.0}
    return ", ".join(f"{dim} {gb(mb)}" for dim, mb in sent.items())


def shape(rec: dict) -> str:
    """The model, its size, and the variant's flags: `llama llama2-70b --tp 8`."""
    return " ".join(str(part) for part in (rec["model"], rec["size"], rec.get("variant"))
                    if part)


def render_dry_runs(records: list[dict]) -> str:
    """The newest dry run of each (script, variant, size, model, world), as a table of peak GB a
    rank by kind, state, GB sent by mesh dim, TFLOPs and the seconds this host took; a run that
    skipped or failed, its one line instead."""
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
        rows.append([name, shape(rec), dry["world"],
                     f"{gb(rec['peak_mem_mb'])} ("
                     + " / ".join(gb(memory.get(kind)) for kind in KINDS) + ")",
                     gb(rec["state_mb"]), by_dim(rec), f"{(dry['flops'] or 0) / 1e12:,.1f} "
                     f"({dry_run_step(dry)['step_ms'] / 1e3:,.2f})", f"{dry['host_s']:.0f}"])
    table = tabulate(rows, headers=["script", "model", "world",
                                    "peak GB (" + " / ".join(KINDS) + ")", "state GB",
                                    "sent GB by dim", "TFLOP (H100 s)", "host s"],
                     tablefmt="github", disable_numparse=True)
    return table + ("\n\nNot dry-run:\n" + "\n".join(sorted(set(notes))) if notes else "")
