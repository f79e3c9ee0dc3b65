"""The strategy planner (`make plan`), its candidates: per-GPU memory and bytes sent per step of
each way to spread a decoder over G GPUs (every script's PLANNED formulas at the flags), each
one's step on a GPU by the step-time model, and which to pick. Printing is plan_print.py's; the
worked cases, plan_cases.py's."""

from __future__ import annotations

import argparse
import functools
import math
import re

import common
from report.costmodel import StepWork, predict_step
from report.gpus import ADAMW_BYTES, FITTED_ON, GPU, GPUS, LLAMA31, gpu_rates, llama_params
from report.plan_input import (
    FLAG_DEFAULTS,
    GB,
    STATE_BYTES,
    activations_per_gpu,
    attention_widths,
    import_script,
    plan_flops_per_token,
    plan_input,
    tp_degree,
)


def planned_strategies() -> list[dict]:
    """Every script's PLANNED entries, simplest first (by `place`): the scripts of the numbered
    folders whose source gives PLANNED entries, imported by path (their `__main__` guard keeps them
    from running). A new folder's script is picked up with no edit here."""
    entries = []
    for path in sorted(common.ROOT.glob("[0-9][0-9]_*/*.py")):
        # `PLANNED = []`: a script that adds no row (not imported: some need optional packages)
        if not path.name.startswith(("optimized_", "baseline_")) or \
                not re.search(r"^PLANNED = \[(?!\])", path.read_text(), re.MULTILINE):
            continue
        entries += [{**entry, "script": f"{path.parent.name}/{path.name}"}
                    for entry in import_script(path).PLANNED]
    return sorted(entries, key=lambda entry: entry["place"])


def pipeline_depths(args: argparse.Namespace, tp: int) -> list[int]:
    """The pp PP x FSDP x TP may take: --pp, else each divisor of the GPUs TP leaves (gpus/tp)
    from 2 up to the layers; none when TP takes them all."""
    if args.pp:
        return [args.pp]
    across = args.gpus // tp
    return [pp for pp in range(2, min(across, args.layers) + 1) if across % pp == 0]


def context_degrees(args: argparse.Namespace) -> list[int]:
    """The cp FSDP x CP may take: each divisor of a node's GPUs from 2 up (the ring of K/V
    blocks stays inside the node) that also divides the GPUs and cuts the sequence into 2 x cp
    equal chunks (zigzag); --cp, if given."""
    if getattr(args, "cp", None):
        return [args.cp]
    per_node = min(args.gpus, args.gpus_per_node)
    return [cp for cp in range(2, per_node + 1)
            if per_node % cp == 0 and args.gpus % cp == 0 and args.seq_len % (2 * cp) == 0]


def expert_degrees(args: argparse.Namespace) -> list[int]:
    """The ep EP may take, none for a dense model: the largest that divides the experts, the
    GPUs and a node's GPUs (the all-to-all stays on NVLink; the most experts it spreads), then,
    should that not fit, larger ones across nodes, each a multiple of it dividing the experts
    and the GPUs, the fewest nodes first."""
    if not args.experts:
        return []
    inside = math.gcd(args.experts, args.gpus, min(args.gpus, args.gpus_per_node))
    spread = math.gcd(args.experts, args.gpus)
    across = [ep for ep in range(inside + 1, spread + 1) if spread % ep == 0 and ep % inside == 0]
    return [ep for ep in [inside, *across] if ep > 1]


def planned_row(args: argparse.Namespace, strategy: str, figures: dict, checkpointing: bool
                ) -> dict:
    """A table row from a strategy's figures (bytes a GPU): its activations
    (activations_per_gpu, a pipeline stage's layers and micro-batches in flight, a context-
    parallel GPU's 1/cp of each sequence, its loss, an fp32 residual stream; what a layer or a
    micro-batch keeps beyond them) beside the weights it holds gathered or autocast's copies of
    them; whether it fits; what a GPU sends across nodes (all of it, unless the figures say) for
    how many sequences a step (one a GPU, unless the figures say)."""
    q_width, kv_width = attention_widths(args)
    acts = activations_per_gpu(args.layers, args.seq_len // figures.get("cp", 1),
                               args.micro_batch, args.hidden,
                               args.vocab, args.dtype, checkpointing, args.llama,
                               stage_layers=figures.get("stage_layers"),
                               in_flight=figures.get("in_flight", 1), ffn=args.ffn,
                               loss=figures.get("loss", "plain"),
                               fp32_residual=figures.get("fp32_residual", False),
                               q_width=q_width, kv_width=kv_width,
                               moe=(args.top_k, args.expert_ffn, args.experts)
                               if args.experts else None)
    # what a layer keeps beyond those (sequence parallelism's gathered inputs), for each of
    # the layers a micro-batch keeps: every one, or, checkpointed, the one recomputing
    kept_layers = 1 if checkpointing else figures.get("stage_layers", args.layers)
    acts += figures.get("layer_extra", 0.0) * kept_layers * figures.get("in_flight", 1)
    # what a pipeline keeps a micro-batch beyond its layers' (its stage's output)
    acts += figures.get("micro_batch_extra", 0.0) * figures.get("in_flight", 1)
    # autocast's bf16 copies of fp32 weights, kept to backward: checkpointed, a layer's at once
    cast = figures.get("cast", 0.0) / (args.layers if checkpointing else 1)
    gathered = figures.get("gathered", 0.0) + cast
    total = figures["state"] + acts + gathered
    across = figures["sent"] if args.gpus > args.gpus_per_node else 0.0
    return {"strategy": strategy, "checkpointing": checkpointing, "state": figures["state"],
            "activations": acts + gathered, "total": total, "fits": total <= args.gpu_mem * GB,
            "sent": figures["sent"], "network": figures.get("network", across),
            "bubble": figures.get("bubble", 0.0),
            "sequences": figures.get("sequences", args.micro_batch * args.gpus),
            **{key: figures[key] for key in ("by_dim", "mesh", "crossover", "alltoall", "tokens",
                                             "sent_first",
                                             "experts_data_parallel", "experts_replicas",
                                             "host", "host_link")
               if key in figures}}


def planned_step(args: argparse.Namespace, row: dict, figures: dict, gpu: GPU, achieved: float,
                 async_tp: bool = False) -> dict:
    """A planned row's step on `gpu` by predict_step: a GPU's share of the step's FLOPs
    at `achieved` of the peak (a third more with checkpointing), each mesh dim's bytes over
    NVLink, or the network for what the row sends across nodes (data parallelism's first, then
    the pipeline's, then EP's), data parallelism's hidden under compute (FSDP's and ZeRO-3's
    prefetched gathers under the step, the others' gradients under backward), context
    parallelism's under its attention, TP's only with `async_tp`; the optimizer's step at the
    HBM bandwidth; the bubble. Adds tokens/s a GPU, MFU and what binds the step."""
    per_token, attention = plan_flops_per_token(args)
    tokens = row["sequences"] * args.seq_len / args.gpus
    collectives, network = {}, row["network"]
    for dim, sent in (figures.get("by_dim") or {"dp": figures["sent"]}).items():
        across = min(network, sent) if dim in ("dp", "pp", "ep") else 0.0
        network -= across
        collectives[f"{dim}/nvlink"] = (sent - across, 0)
        if across:
            collectives[f"{dim}/network"] = (across, 0)
    sharded = "FSDP" in row["strategy"] or "ZeRO-3" in row["strategy"]
    overlapped = {"dp": "step" if sharded else "backward", "cp": "step", "host": "forward",
                  **({"tp": "step"} if async_tp else {})}
    # a frozen weight's matmuls skip its gradient (LoRA: 4 FLOPs a weight of full training's 6),
    # and AdamW steps what trains
    matmul = (per_token - attention) * figures.get("matmul_share", 1.0)
    stepped = figures.get("stepped", figures["state"] / sum(STATE_BYTES))
    if "host_link" in figures:  # offloaded: AdamW in host memory under the next forward, none
        # of it on the GPU; the copies over PCIe counted exposed (they share that window)
        collectives |= {"pcie/offload": (figures["host_link"], 0),
                        "host/offload": (stepped * ADAMW_BYTES, 0)}
        stepped = 0.0
    # Muon's Newton-Schulz: matmuls the optimizer adds, a GPU's share (its owned matrices')
    work = StepWork(matmul * tokens + figures.get("optimizer_flops", 0.0), attention * tokens,
                    0.0, stepped, collectives, overlapped, row["checkpointing"],
                    figures.get("bubble", 0.0))
    step = predict_step(work, gpu_rates(gpu, achieved))
    tokens_per_s = tokens / (step["step_ms"] / 1e3)
    bound = step["bound_by"]
    if bound == "communication":  # the link that costs the most
        rates = gpu_rates(gpu, achieved)
        dim, where = max(collectives, key=lambda k: collectives[k][0] * rates.link(k)[1]
                         ).split("/")
        bound = {"pcie": "host link", "host": "host memory"}.get(dim) or \
            ("network" if where == "network" else "NVLink")
    per_item = getattr(args, "flops_per_item", None) and args.seq_len  # a CNN's image: seq_len
    return {"step_s": step["step_ms"] / 1e3, "tokens_per_gpu_s": tokens_per_s,
            "unit": "images" if per_item else "tokens",
            "per_gpu_s": tokens_per_s / per_item if per_item else tokens_per_s,
            "mfu": (matmul + attention) * tokens_per_s / gpu.bf16_flops,
            "bound_by": bound if row["fits"] else "memory"}


def layout_args(shape: dict, gpus: int, seq: int, micro_batch: int,
                micro_batches: int | None = None, gpu: str = "h100", run_as: str = "eager",
                llama: bool = True) -> argparse.Namespace:
    """The planner's flags for a model of `shape` (gpus.LLAMA31's keys; a GPT's with
    `llama` False: a 4x MLP, tied head, a position table) on `gpus` GPUs, 8 a node, bf16."""
    h, layers, vocab = shape["hidden"], shape["layers"], shape["vocab"]
    params = llama_params(shape)[0] if llama else \
        layers * (12 * h * h + 13 * h) + (vocab + seq) * h + 2 * h
    return argparse.Namespace(**{**FLAG_DEFAULTS, "params": params, "gpus": gpus, "layers": layers,
                                 "hidden": h, "vocab": vocab, "seq_len": seq,
                                 "micro_batch": micro_batch, "micro_batches": micro_batches,
                                 "llama": llama, "gpu_mem": 1e9, "gpu": gpu,
                                 "run_as": run_as})


def predict_layout(args: argparse.Namespace, tp: int = 1, pp: int = 1,
                   checkpointing: bool = False, async_tp: bool = False,
                   bubble: float | None = None, achieved_fraction: float | None = None) -> dict:
    """One layout's step (planned_step) at the planner's flags, not the planner's pick: FSDP
    over every GPU, FSDP x TP with `tp`, or PP x FSDP x TP with `pp` stages; its bytes from
    the script's own PLANNED formulas. `bubble` in place of the formula's (a schedule the
    scripts do not run: interleaved 1F1B), `achieved_fraction` in place of the fitted one."""
    strategy = "PP x FSDP x TP" if pp > 1 else "FSDP x TP" if tp > 1 else "FSDP full"
    entry = next(e for e in planned_strategies() if e["strategy"] == strategy)
    figures = entry["figures"](plan_input(args, tp, pp))
    if bubble is not None:
        figures = {**figures, "bubble": bubble}
    row = planned_row(args, strategy, figures, checkpointing)
    return {**row, **planned_step(args, row, figures, GPUS[args.gpu], achieved(args.run_as)
                                  if achieved_fraction is None else achieved_fraction, async_tp)}


# Published shapes beside gpus.LLAMA31: Megatron-LM's 70B GPT (its README's model table)
PUBLISHED_SHAPES = {**LLAMA31, "megatron-70b": {"layers": 84, "hidden": 8192, "heads": 64,
                                                "vocab": 131072}}


def predict_published(row: dict) -> dict:
    """A published run (tests/fixtures/published_steps.json) as predict_layout sees it: its
    model, GPUs, mesh and `local_batch` sequences a data-parallel rank (a TP group's together,
    a pipeline's micro-batches of one sequence); a pipeline's bubble that of its schedule with
    one micro-batch a sequence, (p-1)/(m+p-1), interleaved 1F1B two stages a GPU, (p-1)/(2m+
    p-1)."""
    tp, pp, local = row["tp"], row["pp"], row["local_batch"]
    llama = row["model"] in LLAMA31
    if pp > 1:  # the script's micro-batch: a TP group's tp sequences, one a GPU
        args = layout_args(PUBLISHED_SHAPES[row["model"]], row["gpus"], row["seq"], 1,
                           local // tp, row["gpu"], row["run_as"], llama)
        stages = 2 if row.get("schedule") == "Interleaved 1F1B" else 1
        bubble = (pp - 1) / (stages * local + pp - 1)
    else:
        args = layout_args(PUBLISHED_SHAPES[row["model"]], row["gpus"], row["seq"], local / tp,
                           None, row["gpu"], row["run_as"], llama)
        bubble = None
    return predict_layout(args, tp, pp, row["checkpointing"], row.get("async_tp", False),
                          bubble)


@functools.cache
def achieved(run_as: str) -> float:
    """The fraction of the bf16 peak a GPU's matmuls and attention achieve in a training step,
    run `run_as` ("eager", "compiled": torch.compile, "float8": compiled with float8 matmuls,
    counted against the bf16 peak as MFU is): the one that makes the cost model give
    torchtitan's Table 1 row (gpus.FITTED_ON: Llama 3.1 8B, FSDP on 8 of its H100s, 2
    sequences of 8,192 a GPU), found by bisection. Everything else the model predicts on GPUs,
    the other published rows included, uses it unchanged."""
    args = layout_args(LLAMA31["8B"], 8, 8192, 2, gpu="h100-96gb-500w", run_as=run_as)
    low, high = 0.01, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        faster = predict_layout(args, achieved_fraction=mid)["tokens_per_gpu_s"] > \
            FITTED_ON[run_as]
        low, high = (low, mid) if faster else (mid, high)
    return (low + high) / 2


def dry_run_step(dry: dict, gpu: str = "h100", run_as: str = "eager") -> dict:
    """A dry run's step (its record's `dry_run`) on `gpu`, by predict_step: its FLOPs at
    the fraction of the peak the planner's fit achieves (`achieved`), its parameters stepped at
    the HBM's rate, what it sent within a node over NVLink and the rest over the network, all of
    it exposed (the record does not say what hides under compute: an upper bound on the link's
    share). {"step_ms", its parts, "bound_by"}."""
    sent = dry["sent_mb"]
    # gpu_rates names its links by mesh dim and place; the dry run's are by place alone
    work = StepWork(dry["flops"], 0.0, 0.0, dry["stepped_params"],
                           {"dp/nvlink": (sent["node"] * 2**20, 0),
                            "dp/network": (sent["network"] * 2**20, 0)}, {})
    return predict_step(work, gpu_rates(GPUS[gpu], achieved(run_as)))


def plan_strategies(args: argparse.Namespace) -> list[dict]:
    """Every planned strategy, with and without activation checkpointing, at the planner's
    flags. A pipelined one (PP x FSDP x TP) at the smallest pp at which it fits (fewest stages:
    the least bubble), else at the largest (the leanest); none if no pp divides the GPUs. A
    context-parallel one (FSDP x CP) likewise at the smallest cp (the fewest K/V blocks passed);
    an expert-parallel one (EP, EP x FSDP) at the first ep of expert_degrees at which it fits."""
    tp = tp_degree(args.gpus, args.gpus_per_node)
    rows = []
    for entry in planned_strategies():
        if entry.get("fine_tuning") and not args.lora_rank:
            continue
        if bool(entry.get("muon")) != bool(args.muon):  # one optimizer's rows: AdamW's or Muon's
            continue
        if entry.get("context_parallel"):
            figures = [entry["figures"](plan_input(args, cp=cp)) for cp in context_degrees(args)]
        elif entry.get("expert_parallel"):
            figures = [entry["figures"](plan_input(args, ep=ep)) for ep in expert_degrees(args)]
        else:
            depths = pipeline_depths(args, tp) if entry.get("pipelined") else [1]
            figures = [entry["figures"](plan_input(args, tp, pp)) for pp in depths]
        figures = [f for f in figures if f is not None]  # None: the layout cannot run here
        for checkpointing in (False, True) if figures else ():
            tried = [(planned_row(args, entry["strategy"], f, checkpointing), f) for f in figures]
            row, f = next(((r, f) for r, f in tried if r["fits"]), tried[-1])
            rows.append({**row, **planned_step(args, row, f, GPUS[args.gpu],
                                               achieved(args.run_as))})
    return rows


# Step times within this fraction of the fastest are no reason to choose a more complex layout
PICK_MARGIN = 0.05


def choose(rows: list[dict]) -> dict | None:
    """The planner's pick: of what fits, the most tokens/s a GPU by the step-time model (which
    prices checkpointing's recompute, the bytes on their links, the bubble and the optimizer);
    within PICK_MARGIN of that, the first in the table's order, the simplest (DDP, then the
    ZeRO stages, FSDP, ..., the composed layouts; without checkpointing before with)."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None
    fastest = max(r["tokens_per_gpu_s"] for r in fitting)
    near = [r for r in fitting if r["tokens_per_gpu_s"] >= (1 - PICK_MARGIN) * fastest]
    return min(near, key=lambda r: r["checkpointing"])
