"""The strategy planner (`make plan`): per-GPU memory and bytes sent per step of each way to
spread a decoder over G GPUs, and which to pick."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import re
import types
from pathlib import Path

from tabulate import tabulate

import common
from report.gpus import ADAMW_BYTES, FITTED_ON, GPU, GPUS, LLAMA31, gpu_rates, llama_params

GB = 1e9
# Bytes per parameter: (weights, gradients, optimizer state) with AdamW, what the scripts keep:
# fp32 weights, gradients and two moments, 4 + 4 + 8, whatever they compute in. (The ZeRO paper's
# mixed precision, 16-bit weights and gradients beside fp32 masters, 2 + 2 + 12, is not theirs:
# the dry runs measured 4 + 4 + 8.)
STATE_BYTES = (4, 4, 8)
# A value's bytes in compute, by --dtype: bf16 runs keep the fp32 state above and compute under
# autocast (or FSDP's param_dtype), as every script's --dtype bf16 does
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}


@functools.cache
def import_script(path: Path) -> types.ModuleType:
    """A numbered folder's script imported by path, once, under a name of its own (its
    `__main__` guard keeps it from running). The scripts import only common, never each other:
    the planner is where they meet."""
    spec = importlib.util.spec_from_file_location(f"planned_{path.parent.name}_{path.stem}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Bytes a logit the loss adds to its bf16 logits at its peak, in backward (cast to fp32, cross-
# entropy and its gradient, in eager): plain F.cross_entropy 12; under loss_parallel (the
# vocabulary split over TP), whose backward is a chain of ops on each rank's shard, 68.
# MemTracker's counts under fake tensors, held by tests/test_dryrun.py, which measures both again.
LOSS_BYTES_PER_LOGIT = {"plain": 12, "loss_parallel": 68}


def activations_per_gpu(layers: int, seq: int, batch: int, hidden: int, vocab: int, dtype: str,
                        checkpointing: bool, llama: bool = False, heads: int | None = None,
                        stage_layers: int | None = None, in_flight: int = 1,
                        ffn: int | None = None, moe: tuple[int, int, int] | None = None,
                        loss: str | None = "plain", fp32_residual: bool = False,
                        q_width: int | None = None, kv_width: int | None = None) -> float:
    """Activation bytes a GPU keeps for backward: the blocks' (03_fsdp/optimized_fsdp_fp8.py's
    activation_bytes, a GPT's blocks or with `llama` a Llama's of SwiGLU width `ffn` (default
    llama_ffn_dim), `dtype`'s bytes a value; a pipeline stage keeps `in_flight` micro-batches of
    its `stage_layers`, 1F1B as many as there are stages) and, the planner's own term, which
    that script leaves out, the logits and the loss's backward: a value of `dtype` and
    LOSS_BYTES_PER_LOGIT of the `loss` the GPU computes ("plain", or "loss_parallel": its share of
    the vocabulary for as many more tokens; None: no loss). A MoE (`moe`: top_k, an expert's
    width, experts) keeps, in its MLP's place, what common.Experts saves a token: its top_k
    routed rows, their outputs and their weighted sum (3 x hidden each), each expert's SwiGLU
    (4 x width), and the router's fp32 logits and scores (2 x experts, 2 values of `dtype` each
    in bf16). `fp32_residual`: autocast over fp32 weights, whose residual stream stays fp32 in a
    bf16 run: the norms' inputs (2 a layer; with checkpointing, the blocks' inputs too) and a
    MoE's routed rows and their weighted outputs (2 x top_k) kept at 4 bytes, not 2. The
    attention's widths a token where they are not `hidden` (that script's): `q_width` (heads x
    head size: q, the attention's output and the output projection's input), `kv_width` (KV
    heads x head size: k and v)."""
    activation_bytes = import_script(common.ROOT / "03_fsdp" / "optimized_fsdp_fp8.py"
                                     ).activation_bytes
    # The flags give no head count: heads of 128 (Llama's), unless told. Their term, a
    # log-sum-exp a head and token, is about 1/2000 of the rest.
    heads = hidden // 128 if heads is None else heads
    if llama:
        ffn = common.llama_ffn_dim(hidden) if ffn is None else ffn
    if moe:
        top_k, expert_ffn, experts = moe
        # that script's MLP term is 4 x ffn values a token: the MoE's values, as a width
        ffn = (top_k * (3 * hidden + 4 * expert_ffn) + 4 * experts) / 4
    layers = stage_layers if stage_layers is not None else layers
    blocks = activation_bytes(layers, seq * batch, hidden, heads, 2 if dtype == "bf16" else 4,
                              checkpointing, ffn if llama else None)
    value_bytes = 2 if dtype == "bf16" else 4
    attention = 3 * ((q_width or hidden) - hidden) + 2 * ((kv_width or hidden) - hidden)
    blocks += value_bytes * seq * batch * attention * (1 if checkpointing else layers)
    if fp32_residual and dtype == "bf16":  # 2 bytes more for each value kept in fp32
        in_fp32 = (2 + (2 * moe[0] if moe else 0)) * hidden
        blocks += 2 * seq * batch * (layers * hidden + in_fp32 if checkpointing
                                     else layers * in_fp32)
    logits = seq * batch * vocab * (value_bytes + LOSS_BYTES_PER_LOGIT[loss]) if loss else 0.0
    return in_flight * blocks + logits


def tp_degree(gpus: int, per_node: int) -> int:
    """TP's group: the GPUs of a node, or fewer so that groups tile the nodes and the world
    (the largest common divisor): its gathers and scatters every layer stay on NVLink."""
    return math.gcd(gpus, per_node)


def expert_params(args: argparse.Namespace) -> float:
    """The routed experts' parameters: each of --experts a SwiGLU of --expert-ffn (gate, up,
    down: 3 x hidden x ffn) in each of --moe-layers (default every layer); 0 for a dense
    model."""
    moe_layers = args.layers if args.moe_layers is None else args.moe_layers
    return float(moe_layers * args.experts * 3 * args.hidden * args.expert_ffn)


def attention_widths(args: argparse.Namespace) -> tuple[int, int]:
    """(q's, k's) width a token: --heads (default: heads of 128) x --head-dim (default: --hidden
    / heads), --kv-heads (default: --heads) x --head-dim."""
    heads = getattr(args, "heads", None) or args.hidden // 128
    head_dim = getattr(args, "head_dim", None) or args.hidden // heads
    return heads * head_dim, (getattr(args, "kv_heads", None) or heads) * head_dim


def lora_params(args: argparse.Namespace) -> float:
    """--lora-rank r's adapters, r (d_in + d_out) a projection of every layer's attention: a
    GPT's fused qkv (h to 3h) and output projection, 6 r h a layer; a Llama's four, 8 r h a
    layer, its key and value projections taken as h x h (grouped-query attention's are
    narrower: fewer), unless the flags give the count (`lora_params`: a run's own). 0 without
    --lora-rank."""
    if getattr(args, "lora_params", None):
        return args.lora_params
    return float(args.layers * args.lora_rank * (8 if args.llama else 6) * args.hidden)


def plan_input(args: argparse.Namespace, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1
               ) -> common.PlanInput:
    """The planner's flags as the numbers a script's formulas take: GPT-2's layout (token and
    position tables, the head tied to the token table, LayerNorms with biases, 2 a layer and
    the final one, and the row-parallel Linears' biases, 2 a layer, which TP keeps whole), or
    with --llama a Llama's (a token table, an untied head, rotary positions, RMSNorm weights,
    no biases); with --experts a MoE's routed experts (expert_params) beside them."""
    h, layers = args.hidden, args.layers
    if args.llama:
        norms = (2 * layers + 1) * h
        parts = {"embedding": args.vocab * h, "head": args.vocab * h, "tied": 0.0,
                 "replicated": norms, "norms": norms, "position_table": False}
    else:
        norms = 2 * (2 * layers + 1) * h
        parts = {"embedding": (args.vocab + args.seq_len) * h, "head": 0.0,
                 "tied": args.vocab * h, "replicated": norms + 2 * layers * h, "norms": norms,
                 "position_table": True}
    return common.PlanInput(params=args.params, gpus=args.gpus, per_node=args.gpus_per_node,
                            state_bytes=STATE_BYTES,
                            compute_bytes=COMPUTE_BYTES[args.dtype], layers=layers, hidden=h,
                            vocab=args.vocab, seq=args.seq_len, micro_batch=args.micro_batch,
                            micro_batches=args.micro_batches, tp=tp, pp=pp, cp=cp, **parts,
                            experts=args.experts, top_k=args.top_k,
                            moe_layers=(layers if args.moe_layers is None else args.moe_layers)
                            if args.experts else 0, expert_params=expert_params(args), ep=ep,
                            lora_params=lora_params(args),
                            ffn=(args.ffn or common.llama_ffn_dim(h)) if args.llama else 4 * h,
                            kv_width=attention_widths(args)[1])


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


def plan_flops_per_token(args: argparse.Namespace) -> tuple[float, float]:
    """(all, attention's) training FLOPs a token at the planner's flags: the weights a token
    multiplies through are the parameters less the input tables (plus a tied head's, which
    the head multiplies by), a MoE's routed experts at top_k of them (common's
    train_flops_per_token: the records' count)."""
    layout = plan_input(args)
    routed_off = expert_params(args) * (1 - args.top_k / args.experts) if args.experts else 0.0
    matmul = args.params - layout.embedding + layout.tied - routed_off
    return common.train_flops_per_token(matmul, args.layers, args.hidden, args.seq_len)


def planned_step(args: argparse.Namespace, row: dict, figures: dict, gpu: GPU, achieved: float,
                 async_tp: bool = False) -> dict:
    """A planned row's step on `gpu` by common.predict_step: a GPU's share of the step's FLOPs
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
    work = common.StepWork(matmul * tokens, attention * tokens, 0.0, stepped, collectives,
                           overlapped, row["checkpointing"], figures.get("bubble", 0.0))
    step = common.predict_step(work, gpu_rates(gpu, achieved))
    tokens_per_s = tokens / (step["step_ms"] / 1e3)
    bound = step["bound_by"]
    if bound == "communication":  # the link that costs the most
        rates = gpu_rates(gpu, achieved)
        dim, where = max(collectives, key=lambda k: collectives[k][0] * rates.link(k)[1]
                         ).split("/")
        bound = {"pcie": "host link", "host": "host memory"}.get(dim) or \
            ("network" if where == "network" else "NVLink")
    return {"step_s": step["step_ms"] / 1e3, "tokens_per_gpu_s": tokens_per_s,
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
    return argparse.Namespace(**{**CASE_FLAGS, "params": params, "gpus": gpus, "layers": layers,
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
    """A dry run's step (its record's `dry_run`) on `gpu`, by common.predict_step: its FLOPs at
    the fraction of the peak the planner's fit achieves (`achieved`), its parameters stepped at
    the HBM's rate, what it sent within a node over NVLink and the rest over the network, all of
    it exposed (the record does not say what hides under compute: an upper bound on the link's
    share). {"step_ms", its parts, "bound_by"}."""
    sent = dry["sent_mb"]
    # gpu_rates names its links by mesh dim and place; the dry run's are by place alone
    work = common.StepWork(dry["flops"], 0.0, 0.0, dry["stepped_params"],
                           {"dp/nvlink": (sent["node"] * 2**20, 0),
                            "dp/network": (sent["network"] * 2**20, 0)}, {})
    return common.predict_step(work, gpu_rates(GPUS[gpu], achieved(run_as)))


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


def row_name(row: dict) -> str:
    mesh = f" ({row['mesh']})" if row.get("mesh") else ""
    return f"{row['strategy']}{mesh}{' with activation checkpointing' * row['checkpointing']}"


def why_picked(rows: list[dict], best: dict, gpu_mem: float) -> str:
    """`choose`'s pick and why, in a sentence: its predicted speed and what binds it, what it
    needs of a GPU's memory against DDP (if planned), the next fastest that fits, and across
    nodes what it sends there."""
    why = [f"{best['tokens_per_gpu_s']:,.0f} tokens/s a GPU (MFU {best['mfu']:.0%}, a step "
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
                   f"the next fastest, {row_name(other)}: {other['tokens_per_gpu_s']:,.0f}")
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


def add_moe_flags(plan: argparse.ArgumentParser) -> None:
    """`plan`'s flags for a Mixture of Experts (a Hugging Face config's names in the help)."""
    plan.add_argument("--experts", type=common.int_at_least(1), default=0,
                      help="routed experts a MoE layer (num_experts, n_routed_experts): plans "
                           "expert parallelism (EP, EP x FSDP) beside the rest (default: dense)")
    plan.add_argument("--top-k", type=common.int_at_least(1), default=0,
                      help="routed experts a token goes to (num_experts_per_tok)")
    plan.add_argument("--expert-ffn", type=common.int_at_least(1), default=0,
                      help="a routed expert's SwiGLU width (moe_intermediate_size)")
    plan.add_argument("--moe-layers", type=common.int_at_least(1), default=None,
                      help="layers with experts (default: every layer; DeepSeek-V3's first 3 "
                           "of 61 are dense)")


def moe_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the MoE flags, in a line, or None."""
    given = [flag for flag in ("--experts", "--top-k", "--expert-ffn")
             if getattr(args, flag[2:].replace("-", "_"))]
    if given and len(given) < 3 or args.moe_layers is not None and not given:
        return ("a MoE needs --experts, --top-k and --expert-ffn together (--moe-layers with "
                "them)")
    if not given:
        return None
    if args.top_k > args.experts:
        return f"--top-k {args.top_k} is more than --experts {args.experts}"
    if args.moe_layers is not None and args.moe_layers > args.layers:
        return f"--moe-layers {args.moe_layers} is more than --layers {args.layers}"
    layout = plan_input(args)
    if expert_params(args) >= args.params - layout.embedding - layout.head:
        return (f"the experts ({expert_params(args):.3g} parameters: --moe-layers x --experts x "
                f"3 x --hidden x --expert-ffn) leave nothing of --params {args.params:g} for the "
                "tables and attention: raise --params or check the expert flags")
    return None


def seconds(value: float) -> str:
    return f"{value:,.2f} s" if value >= 1 else f"{value * 1e3:,.1f} ms"


def step_cells(row: dict) -> list[str]:
    """A row's predicted step: its time, tokens/s a GPU, MFU, what binds it."""
    return [seconds(row["step_s"]), f"{row['tokens_per_gpu_s']:,.0f}", f"{row['mfu']:.0%}",
            row["bound_by"]]


def step_note(args: argparse.Namespace) -> str:
    """Where the step times come from, in a line."""
    gpu = GPUS[args.gpu]
    return (f"Step times: common.predict_step on {gpu.name} ({gpu.bf16_flops / 1e12:,.0f} "
            f"TFLOP/s bf16 peak, {args.run_as} at {achieved(args.run_as):.0%} of it, as "
            "torchtitan's Llama 3.1 8B FSDP row on 8 GPUs gives; NVLink and the network at "
            "report/gpus.py's LINK_EFFICIENCY of their rate); MFU = 6 x the weights a token "
            "meets (4 x a frozen one: LoRA) + attention's 12 x layers x hidden x seq, a GPU's "
            "tokens/s, over the peak; "
            "bound by the largest part (compute, NVLink, network, bubble, optimizer; memory: "
            "it does not fit).")


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


# The seed guide's decision matrix, worked: each model at its real shape, on GPUs of 80 GB, bf16
CASES = [("ResNet-50 on 8 GPUs", {"params": 25.6e6, "gpus": 8, "layers": 16, "hidden": 1024,
                                  "vocab": 1000, "seq_len": 196, "micro_batch": 32},
          "a decoder-shaped stand-in: its 16 bottleneck blocks as layers of 1,024 units over 14 x "
          "14 = 196 positions, 1,000 classes, 32 images a GPU; its activations are a rough guess"),
         ("GPT-2 1.5B on 4 GPUs", {"params": 1.5e9, "gpus": 4, "layers": 48, "hidden": 1600,
                                   "vocab": 50257, "seq_len": 1024}, None),
         ("LLaMA-7B on 8 GPUs", {"params": 7e9, "gpus": 8, "layers": 32, "hidden": 4096,
                                 "vocab": 32000, "seq_len": 4096, "llama": True}, None),
         # where offload beats ZeRO-3 alone: GPUs too small for 16 bytes a parameter / 8
         ("LLaMA-7B on 8 16-GB GPUs", {"params": 7e9, "gpus": 8, "gpu_mem": 16.0,
                                       "layers": 32, "hidden": 4096, "vocab": 32000,
                                       "seq_len": 4096, "llama": True}, None),
         # Llama 2 70B's SwiGLU is 28,672 wide (its config.json), not the 8/3 rule's 22,016;
         # its 64 heads share 8 K/V heads
         ("LLaMA-70B on 64 GPUs", {"params": 70e9, "gpus": 64, "layers": 80, "hidden": 8192,
                                   "vocab": 32000, "seq_len": 4096, "llama": True,
                                   "ffn": 28672, "kv_heads": 8}, None),
         # Qwen3-30B-A3B, from its Hugging Face config.json (Qwen/Qwen3-30B-A3B): 48 layers,
         # hidden_size 2048, 128 experts a layer (every layer: mlp_only_layers empty), 8 a
         # token, moe_intermediate_size 768, vocab 151,936, untied head, 32 heads of 128 (q is
         # twice hidden_size wide) sharing 4 K/V heads; its model card: 30.5B parameters, 3.3B
         # activated
         ("Qwen3-30B-A3B on 16 GPUs", {"params": 30.5e9, "gpus": 16, "layers": 48,
                                       "hidden": 2048, "vocab": 151936, "seq_len": 4096,
                                       "llama": True, "experts": 128, "top_k": 8,
                                       "expert_ffn": 768, "heads": 32, "kv_heads": 4,
                                       "head_dim": 128},
          "a MoE: its activations what common.Experts keeps a token"),
         # the seed guide's fine-tuning row (FSDP + LoRA), on two GPUs of a workstation's size
         ("Fine-tuning LLaMA-7B on 2 GPUs", {"params": 7e9, "gpus": 2, "gpu_mem": 24.0,
                                             "layers": 32, "hidden": 4096, "vocab": 32000,
                                             "seq_len": 4096, "llama": True, "lora_rank": 8},
          "24 GB GPUs; LoRA of rank 8 on the attention allowed beside full training")]
CASE_FLAGS = {"gpu_mem": 80.0, "gpus_per_node": 8, "micro_batch": 1, "micro_batches": None,
              "dtype": "bf16", "llama": False, "pp": None, "experts": 0, "top_k": 0,
              "expert_ffn": 0, "moe_layers": None, "gpu": "h100", "run_as": "eager",
              "lora_rank": 0, "ffn": None, "cp": None, "heads": None, "kv_heads": None,
              "head_dim": None}


# Each seed case's layout run by its script, at the case's world on the published shape it stands
# for, as `make dryrun` runs it (its DRY_SEED_RUNS, held equal by tests/test_dryrun.py), and the
# planner's flags for what the script runs where they are not the case's: the pipeline's default
# batch, 8 micro-batches of 4 sequences (the case's 64 of one take a dry run minutes a step)
CASE_DRY_RUNS = {
    "LLaMA-7B on 8 GPUs": ("FSDP full", "03_fsdp/optimized_fsdp.py --size llama2-7b --dry-run 8",
                           {}),
    "LLaMA-7B on 8 16-GB GPUs": ("ZeRO-3 + offload", "04_zero/optimized_zero3_offload.py --size "
                                 "llama2-7b --dry-run 8", {}),
    "LLaMA-70B on 64 GPUs": ("FSDP x TP", "03_fsdp/optimized_fsdp_tp.py --size llama2-70b "
                             "--dry-run 64 --tp 8", {}),
    "Qwen3-30B-A3B on 16 GPUs": ("pipeline", "05_pipeline/optimized_pipeline_1f1b.py --size "
                                 "qwen3-30b-a3b --dry-run 16",
                                 {"micro_batch": 4, "micro_batches": 8}),
    "Fine-tuning LLaMA-7B on 2 GPUs": ("FSDP + LoRA", "03_fsdp/optimized_fsdp_lora.py --size "
                                       "llama2-7b --dry-run 2", {}),
}
# How near a dry run's memory beyond its state must come to the planner's activations (with the
# weights it holds gathered or cast): the planner counts a layer's activations by formula
DRY_RUN_ACTIVATIONS_TOLERANCE = 0.15


def dry_run_record(run: str, records: list[dict]) -> dict | None:
    """The newest record of `run` (a script and its flags, CASE_DRY_RUNS') among `records`."""
    path, *flags = run.split()
    folder, script = path.removesuffix(".py").split("/")
    size, world = flags[flags.index("--size") + 1], int(flags[flags.index("--dry-run") + 1])
    own = " ".join(f for i, f in enumerate(flags) if f not in ("--size", "--dry-run") and
                   flags[i - 1] not in ("--size", "--dry-run")) or None
    matching = [r for r in records if (r["folder"], r["script"], r["size"], r.get("variant"),
                                       r["world_size"]) == (folder, script, size, own, world)]
    return matching[-1] if matching else None


def beside_dry_run(args: argparse.Namespace, strategy: str, rec: dict) -> dict[str, tuple]:
    """A dry run's figures and the planner's for the same strategy at the dry run's exact
    parameter count (the flags `args` give the rest), in bytes a GPU: {"state", "activations",
    "sent": (dry run's, planner's)}. Activations: the dry run's peak beyond the state alive at it
    (`beyond_state_mb`) against the planner's activations and the weights it holds gathered or
    cast. Sent: rank 0's, an end stage's in a pipeline. A LoRA run's adapters are its own (the
    base model's count without them)."""
    adapters = float(rec["trainable_params"]) if rec.get("lora_rank") else 0.0
    exact = argparse.Namespace(**{**vars(args), "params": rec["params"] - adapters,
                                  **({"lora_params": adapters} if adapters else {})})
    row = next(r for r in plan_strategies(exact) if r["strategy"] == strategy and
               not r["checkpointing"])
    return {"state": (rec["state_mb"] * 2**20, row["state"]),
            "activations": (rec["dry_run"]["beyond_state_mb"] * 2**20, row["activations"]),
            "sent": ((rec["comm_mb"] or 0.0) * 2**20, row.get("sent_first", row["sent"]))}


def dry_run_line(args: argparse.Namespace, strategy: str, run: str, rec: dict | None) -> str:
    """A case's dry run beside the planner's row for the same strategy (beside_dry_run), in GB
    a GPU."""
    head = f"Dry run of {strategy} (`{run}`, rank 0): "
    if rec is None:
        return head + "none yet (`make dryrun`)."
    if rec["status"] != "ok":
        return head + f"{rec['status']}, {rec['reason']}"
    if "beyond_state_mb" not in rec.get("dry_run", {}):
        return head + "older than this planner (`make dryrun` again)."
    pairs = beside_dry_run(args, strategy, rec)
    (state, planned_state), (beyond, acts), (sent, planned_sent) = (
        (dry / GB, planned / GB) for dry, planned in pairs.values())
    return head + (f"state {state:,.1f} GB (planner {planned_state:,.1f}), its peak beyond the "
                   f"state {beyond:,.1f} GB (planner's activations {acts:,.1f}, "
                   f"{beyond / acts - 1:+.0%}), sent {sent:,.2f} GB a step (planner "
                   f"{planned_sent:,.2f}).")


# A case's table: one row a candidate, what a user compares across them
CASE_COLUMNS = ["strategy", "mesh", "GB a GPU", "fits", "step", "tokens/s a GPU", "MFU",
                "bound by", "GB across nodes a step"]


def case_table(rows: list[dict]) -> str:
    """A case's candidates (plan_strategies' rows), one row each: the strategy, checkpointed or
    not, its mesh, what it needs of a GPU and whether that fits, its predicted step, tokens/s a
    GPU and MFU, what binds it, and what a GPU sends across nodes a step."""
    return tabulate([[r["strategy"] + (", checkpointed" if r["checkpointing"] else ""),
                      r.get("mesh", ""), f"{r['total'] / GB:,.1f}", "yes" if r["fits"] else "no",
                      seconds(r["step_s"]), f"{r['tokens_per_gpu_s']:,.0f}", f"{r['mfu']:.0%}",
                      r["bound_by"], f"{r['network'] / GB:,.2f}"] for r in rows],
                    CASE_COLUMNS, tablefmt="github", disable_numparse=True)


def render_cases(dry_results: Path = common.DRY_RESULTS) -> str:
    """Each of CASES: a table of its candidates (case_table), then what the planner picks
    (`choose`) and why in a sentence, and its dry run (CASE_DRY_RUNS) from `dry_results` beside
    the formula."""
    lines = [f"GPUs of {CASE_FLAGS['gpu_mem']:g} GB, {CASE_FLAGS['gpus_per_node']} a node, "
             f"{CASE_FLAGS['dtype']}, micro-batch {CASE_FLAGS['micro_batch']} a GPU unless said, "
             f"{GPUS[CASE_FLAGS['gpu']].name}, eager. Pick: of what fits, the most tokens/s a GPU "
             f"the step-time model predicts; within {PICK_MARGIN:.0%} of it, the simplest.", ""]
    dry_runs = common.load_results(dry_results)
    for name, flags, note in CASES:
        args = argparse.Namespace(**{**CASE_FLAGS, **flags})
        rows = plan_strategies(args)
        best = choose(rows)
        pick = why_picked(rows, best, args.gpu_mem) if best else "nothing fits."
        count = f"{args.params / 1e9:g}B" if args.params >= 1e9 else f"{args.params / 1e6:g}M"
        lines += [f"{name} ({count} parameters{f'; {note}' if note else ''})", "",
                  case_table(rows), "",
                  f"Pick: {pick}" + "".join(f" {line}" for line in
                                            crossover_lines(rows) + offload_lines(rows))]
        if name in CASE_DRY_RUNS:
            strategy, run, configured = CASE_DRY_RUNS[name]
            lines.append(dry_run_line(argparse.Namespace(**{**vars(args), **configured}),
                                      strategy, run, dry_run_record(run, dry_runs)))
        lines.append("")
    return "\n".join(lines).rstrip("\n")
