"""The planner's printing (`make plan`): a table of every candidate at the flags, the pick in a
sentence with why, where expert parallelism and offload pay; a case's table; the GPUs and the
published runs the step-time model is held to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tabulate import tabulate

import common
from report.gpus import FITTED_ON, GPUS
from report.plan_input import GB, expert_params
from report.planner import PICK_MARGIN, achieved, choose, plan_strategies, predict_published


def seconds(value: float) -> str:
    return f"{value:,.2f} s" if value >= 1 else f"{value * 1e3:,.1f} ms"


def row_name(row: dict) -> str:
    mesh = f" ({row['mesh']})" if row.get("mesh") else ""
    return f"{row['strategy']}{mesh}{' with activation checkpointing' * row['checkpointing']}"


def speed(row: dict) -> str:
    """A row's predicted speed a GPU in its unit: tokens, or a CNN's images, a second."""
    return f"{row['per_gpu_s']:,.0f} {row['unit']}/s"


def why_picked(rows: list[dict], best: dict, gpu_mem: float) -> str:
    """`choose`'s pick and why, in a sentence: its predicted speed and what binds it, what it
    needs of a GPU's memory against DDP (if planned), the next fastest that fits, and across
    nodes what it sends there."""
    why = [f"{speed(best)} a GPU (MFU {best['mfu']:.0%}, a step "
           f"{seconds(best['step_s'])}, bound by {best['bound_by']})",
           f"{best['total'] / GB:,.1f} of {gpu_mem:g} GB a GPU"]
    # DDP without checkpointing: the whole model and its state on every GPU
    ddp = next((r for r in rows if r["strategy"] == "DDP" and not r["checkpointing"]), None)
    if ddp is not None and best is not ddp:
        why.append(f"DDP needs {ddp['total'] / GB:,.1f}")
    others = [r for r in rows if r["fits"] and r is not best]
    if others:
        other = max(others, key=lambda r: r["tokens_per_gpu_s"])
        ahead = other["tokens_per_gpu_s"] / best["tokens_per_gpu_s"] - 1
        why.append(f"{row_name(other)} is {ahead:.0%} faster, within {PICK_MARGIN:.0%}: the "
                   "simpler picked" if ahead > 0 else
                   f"the next fastest, {row_name(other)}: {speed(other)}")
    if any(r["network"] for r in rows):
        why.append(f"it sends {best['network'] / GB:,.2f} GB a GPU across nodes a step of "
                   f"{best['sequences']} sequences")
    bubble = f"; its bubble idles {best['bubble']:.0%} of the step" if best["bubble"] else ""
    return f"{row_name(best)}: {'; '.join(why)}{bubble}."


def by_dim_text(row: dict) -> str:
    """A composed row's bytes by mesh dim, in GB: TP's inside the node, FSDP's (dp) and the
    pipeline's (pp) across nodes; EP's all-to-all, and its dense part's data parallelism (DDP's
    when the row has no FSDP) with the experts' replicas'."""
    if "host" in row:  # offload: what the host holds, what crosses PCIe
        return f"host {row['host'] / GB:,.1f} GB, PCIe {row['host_link'] / GB:,.2f} GB/step"
    if "by_dim" not in row:
        return ""
    sent = row["by_dim"]
    dp = "FSDP" if "FSDP" in row["strategy"] else "DP"
    return f"{row['mesh']}: " + " / ".join(f"{label} {sent[dim] / GB:,.2f}" for dim, label in
                                          (("tp", "TP"), ("cp", "CP"), ("ep", "EP"), ("dp", dp),
                                                          ("pp", "PP"))
                                          if dim in sent)


def crossover_lines(rows: list[dict]) -> list[str]:
    """Where expert parallelism stops paying, a line an EP layout (its ep): its all-to-all's
    bytes at the plan's tokens a GPU beside what it saves (data parallelism's all-reduce of
    every expert's gradient, less its own over the experts' replicas), and the tokens a GPU a
    step at which the two meet (the script's planned_crossover)."""
    lines = {}
    for r in rows:
        if "crossover" not in r or r["checkpointing"]:
            continue
        lines.setdefault(r["mesh"], (
            f"EP's crossover ({r['mesh']}): at {r['tokens']:,} tokens a GPU a step its all-to-"
            f"alls send {r['alltoall'] / GB:,.2f} GB a GPU, where data parallelism's all-reduce "
            f"of every expert's gradient sends {r['experts_data_parallel'] / GB:,.2f} (EP's "
            f"over the experts' replicas: {r['experts_replicas'] / GB:,.2f}); the two meet at "
            f"{r['crossover']:,.0f} tokens a GPU a step. Under that EP sends fewer bytes than "
            "data parallelism; over it (longer sequences, larger micro-batches, gradient "
            "accumulation) its all-to-alls outweigh the expert gradients it keeps from the "
            "all-reduce, and EP pays in memory (1/ep of the experts a GPU), not in bytes."))
    return list(lines.values())


def offload_lines(rows: list[dict]) -> list[str]:
    """Where offloading the optimizer beats ZeRO-3 alone, a line: ZeRO-3 fits in no form (even
    with checkpointing), ZeRO-3 + offload does; what each needs of a GPU, what the host holds
    and what crosses PCIe a step."""
    def leanest(strategy):
        return min((r for r in rows if r["strategy"] == strategy), key=lambda r: r["total"],
                   default=None)
    alone, offloaded = leanest("ZeRO-3"), leanest("ZeRO-3 + offload")
    if alone is None or offloaded is None or alone["fits"] or not offloaded["fits"]:
        return []
    return [f"Offload: ZeRO-3 alone needs {alone['total'] / GB:,.1f} GB a GPU even with "
            f"activation checkpointing; with its optimizer offloaded, "
            f"{offloaded['total'] / GB:,.1f} (the host holding {offloaded['host'] / GB:,.1f} GB "
            f"a GPU, {offloaded['host_link'] / GB:,.2f} GB over PCIe a step) at "
            f"{offloaded['tokens_per_gpu_s']:,.0f} tokens/s a GPU, bound by "
            f"{offloaded['bound_by']}."]


def step_cells(row: dict) -> list[str]:
    """A row's predicted step: its time, tokens/s a GPU, MFU, what binds it."""
    return [seconds(row["step_s"]), f"{row['tokens_per_gpu_s']:,.0f}", f"{row['mfu']:.0%}",
            row["bound_by"]]


def step_note(args: argparse.Namespace) -> str:
    """Where the step times come from, in a line."""
    gpu = GPUS[args.gpu]
    return (f"Step times: report/costmodel.py's model on {gpu.name} "
            f"({gpu.bf16_flops / 1e12:,.0f} TFLOP/s bf16 peak, {args.run_as} at "
            f"{achieved(args.run_as):.0%} of it, as torchtitan's Llama 3.1 8B FSDP row on 8 GPUs "
            "gives; NVLink and the network at report/gpus.py's LINK_EFFICIENCY of their rate); "
            "MFU = 6 x the weights a token meets (4 x a frozen one: LoRA) + attention's 12 x "
            "layers x hidden x seq, a GPU's tokens/s, over the peak; bound by the largest part "
            "(compute, NVLink, network, bubble, optimizer; memory: it does not fit).")


def plan_json(args: argparse.Namespace) -> dict:
    """`make plan ARGS='... --json'`: the flags, every candidate row (bytes, seconds, the speed a
    GPU in its unit) and the pick with why, as render_plan prints them."""
    rows = plan_strategies(args)
    best = choose(rows)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "json", "dry_results",
                                                               "results", "out", "wide")}
    return {"flags": flags,
            "rows": rows, "pick": row_name(best) if best else None,
            "why": why_picked(rows, best, args.gpu_mem) if best else "nothing fits"}


def render_plan(args: argparse.Namespace) -> str:
    rows = plan_strategies(args)
    table = [[r["strategy"], "yes" if r["checkpointing"] else "no", f"{r['state'] / GB:,.1f}",
              f"{r['activations'] / GB:,.1f}", f"{r['total'] / GB:,.1f}",
              "yes" if r["fits"] else "no", r["sequences"], f"{r['sent'] / GB:,.2f}",
              f"{r['network'] / GB:,.2f}", f"{r['bubble']:.2f}" if r["bubble"] else "",
              *step_cells(r), by_dim_text(r)] for r in rows]
    fitting = [r for r in rows if r["fits"]]
    nodes = -(-args.gpus // args.gpus_per_node)
    moe = (f"; {args.experts} experts a layer, top-{args.top_k}, {expert_params(args):.3g} "
           "parameters in them" if args.experts else "")
    lines = [f"{args.params:.3g} parameters ({'Llama' if args.llama else 'GPT-2'} layout{moe}), "
             f"{args.gpus} GPUs of {args.gpu_mem:g} GB ({nodes} node{'s' * (nodes > 1)} of "
             f"{args.gpus_per_node}), {args.dtype}, micro-batch {args.micro_batch} x "
             f"{args.seq_len} tokens", "",
             tabulate(table, ["strategy", "act. ckpt", "state GB", "activations (+gathered) GB",
                              "total GB", "fits", "sequences/step", "GB sent/GPU/step",
                              "of which across nodes", "bubble", "step", "tok/s/GPU",
                              "MFU", "bound by", "mesh: GB by dim"],
                      tablefmt="github"), "", step_note(args), ""]
    crossovers = crossover_lines(rows)
    lines += [*crossovers, ""] if crossovers else []
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


# A case's table: one row a candidate, what a user compares across them
CASE_COLUMNS = ["strategy", "mesh", "GB a GPU", "fits", "step", "{unit}/s a GPU", "MFU",
                "bound by", "GB across nodes a step"]


def case_table(rows: list[dict]) -> str:
    """A case's candidates (plan_strategies' rows), one row each: the strategy, checkpointed or
    not, its mesh, what it needs of a GPU and whether that fits, its predicted step, tokens (a
    CNN's images) a second a GPU and MFU, what binds it, and what a GPU sends across nodes a
    step."""
    return tabulate([[r["strategy"] + (", checkpointed" if r["checkpointing"] else ""),
                      r.get("mesh", ""), f"{r['total'] / GB:,.1f}", "yes" if r["fits"] else "no",
                      seconds(r["step_s"]), f"{r['per_gpu_s']:,.0f}", f"{r['mfu']:.0%}",
                      r["bound_by"], f"{r['network'] / GB:,.2f}"] for r in rows],
                    [c.format(unit=rows[0]["unit"]) for c in CASE_COLUMNS], tablefmt="github",
                    disable_numparse=True)


PUBLISHED = common.ROOT / "tests" / "fixtures" / "published_steps.json"


def render_gpus() -> str:
    """report/gpus.py's table: each GPU's datasheet figures and their sources."""
    return tabulate([[f"`{key}`", gpu.name, f"{gpu.bf16_flops / 1e12:,.0f}",
                      f"{gpu.fp8_flops / 1e12:,.0f}" if gpu.fp8_flops else "none",
                      f"{gpu.memory_gb:g} GB, {gpu.hbm_bytes_per_s / 1e12:g} TB/s",
                      f"{gpu.nvlink_bytes_per_s / GB:g} GB/s",
                      f"{gpu.network_bytes_per_s / GB:g} GB/s",
                      f"{gpu.pcie_bytes_per_s / GB:g} GB/s",
                      f"{gpu.host_memory_bytes_per_s / GB:g} GB/s", gpu.sources]
                     for key, gpu in GPUS.items()],
                    ["--gpu", "GPU", "bf16 dense TFLOP/s", "fp8", "HBM", "NVLink a direction",
                     "network a GPU", "PCIe a direction", "host memory a GPU", "sources"],
                    tablefmt="github")


def render_published(path: Path = PUBLISHED) -> str:
    """The GPUs (render_gpus), then each published run the step-time model is held to (its
    sources in the file) beside the model's prediction: tokens/s a GPU (MFU where only that is
    published), and what binds it."""
    published = json.loads(path.read_text())
    table = []
    for row in published["rows"]:
        predicted = predict_published(row)
        if row["tokens_per_gpu_s"] is None:
            measured, ours = f"MFU {row['mfu']:.0%}", f"MFU {predicted['mfu']:.1%}"
            error = predicted["mfu"] / row["mfu"] - 1
        else:
            measured, ours = f"{row['tokens_per_gpu_s']:,.0f}", \
                f"{predicted['tokens_per_gpu_s']:,.0f}"
            error = predicted["tokens_per_gpu_s"] / row["tokens_per_gpu_s"] - 1
        table.append([row["table"], row["label"], measured, ours, f"{error:+.0%}",
                      predicted["bound_by"]])
    fitted = ", ".join(f"{mode} {achieved(mode):.1%}" for mode in FITTED_ON)
    return "\n".join([render_gpus(), "",
                      tabulate(table, ["published run", "row", "tokens/s a GPU", "predicted",
                                       "off by", "bound by"], tablefmt="github"), "",
                      f"The share of the bf16 peak a step's compute achieves, fitted on "
                      f"torchtitan's Table 1 (Llama 3.1 8B, FSDP on 8 GPUs) and used unchanged "
                      f"above: {fitted}. Sources: tests/fixtures/published_steps.json."])
