"""The strategy planner (`make plan`): per-GPU memory and bytes sent per step of each way to
spread a decoder over G GPUs, and which to pick."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import re
import types
from pathlib import Path

from tabulate import tabulate

import common

GB = 1e9
# Bytes per parameter: (weights, gradients, optimizer state) with AdamW. fp32: 4 + 4 + 8 (two
# moments), what every folder measures on CPU. Mixed precision, as the ZeRO paper counts it:
# 16-bit weights and gradients, and fp32 master weights + two moments in the optimizer, 2+2+12.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


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


def activations_per_gpu(layers: int, seq: int, batch: int, hidden: int, vocab: int, dtype: str,
                        checkpointing: bool, llama: bool = False, heads: int | None = None,
                        stage_layers: int | None = None, in_flight: int = 1) -> float:
    """Activation bytes saved for backward: the blocks' (03_fsdp/optimized_fsdp_fp8.py's
    activation_bytes, a GPT's blocks or with `llama` a Llama's, `dtype`'s bytes a value; a
    pipeline stage keeps `in_flight` micro-batches of its `stage_layers`, 1F1B as many as
    there are stages) and, the planner's own term for the loss, the logits and their gradient
    in fp32 (2 x seq x batch x vocab x 4), which that script leaves out."""
    activation_bytes = import_script(common.ROOT / "03_fsdp" / "optimized_fsdp_fp8.py"
                                     ).activation_bytes
    # The flags give no head count: heads of 128 (Llama's), unless told. Their term, a
    # log-sum-exp a head and token, is about 1/2000 of the rest.
    heads = hidden // 128 if heads is None else heads
    blocks = activation_bytes(stage_layers if stage_layers is not None else layers,
                              seq * batch, hidden, heads, 2 if dtype == "bf16" else 4,
                              checkpointing, common.llama_ffn_dim(hidden) if llama else None)
    return in_flight * blocks + 8 * seq * batch * vocab


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
                            state_bytes=STATE_BYTES[args.dtype], layers=layers, hidden=h,
                            vocab=args.vocab, seq=args.seq_len, micro_batch=args.micro_batch,
                            micro_batches=args.micro_batches, tp=tp, pp=pp, cp=cp, **parts,
                            experts=args.experts, top_k=args.top_k,
                            moe_layers=(layers if args.moe_layers is None else args.moe_layers)
                            if args.experts else 0, expert_params=expert_params(args), ep=ep)


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
    equal chunks (zigzag)."""
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
    parallel GPU's 1/cp of each sequence) beside the weights it holds gathered; whether it fits;
    what a GPU sends across nodes (all of it, unless the figures say) for how many sequences a
    step (one a GPU, unless the figures say)."""
    acts = activations_per_gpu(args.layers, args.seq_len // figures.get("cp", 1),
                               args.micro_batch, args.hidden,
                               args.vocab, args.dtype, checkpointing, args.llama,
                               stage_layers=figures.get("stage_layers"),
                               in_flight=figures.get("in_flight", 1))
    gathered = figures.get("gathered", 0.0)
    total = figures["state"] + acts + gathered
    across = figures["sent"] if args.gpus > args.gpus_per_node else 0.0
    return {"strategy": strategy, "checkpointing": checkpointing, "state": figures["state"],
            "activations": acts + gathered, "total": total, "fits": total <= args.gpu_mem * GB,
            "sent": figures["sent"], "network": figures.get("network", across),
            "bubble": figures.get("bubble", 0.0),
            "sequences": figures.get("sequences", args.micro_batch * args.gpus),
            **{key: figures[key] for key in ("by_dim", "mesh", "crossover", "alltoall", "tokens",
                                             "experts_data_parallel", "experts_replicas")
               if key in figures}}


def plan_strategies(args: argparse.Namespace) -> list[dict]:
    """Every planned strategy, with and without activation checkpointing, at the planner's
    flags. A pipelined one (PP x FSDP x TP) at the smallest pp at which it fits (fewest stages:
    the least bubble), else at the largest (the leanest); none if no pp divides the GPUs. A
    context-parallel one (FSDP x CP) likewise at the smallest cp (the fewest K/V blocks passed);
    an expert-parallel one (EP, EP x FSDP) at the first ep of expert_degrees at which it fits."""
    tp = tp_degree(args.gpus, args.gpus_per_node)
    rows = []
    for entry in planned_strategies():
        if entry.get("context_parallel"):
            figures = [entry["figures"](plan_input(args, cp=cp)) for cp in context_degrees(args)]
        elif entry.get("expert_parallel"):
            figures = [entry["figures"](plan_input(args, ep=ep)) for ep in expert_degrees(args)]
        else:
            depths = pipeline_depths(args, tp) if entry.get("pipelined") else [1]
            figures = [entry["figures"](plan_input(args, tp, pp)) for pp in depths]
        for checkpointing in (False, True) if figures else ():
            tried = [planned_row(args, entry["strategy"], f, checkpointing) for f in figures]
            rows.append(next((r for r in tried if r["fits"]), tried[-1]))
    return rows


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
    """`choose`'s pick and why, in a sentence: what it needs, what the simplest (DDP, if
    planned) or anything without checkpointing would need, and across nodes, what it sends
    there against the next best that fits."""
    why = [f"{best['total'] / GB:,.1f} of {gpu_mem:g} GB a GPU"]
    # DDP without checkpointing: the whole model and its state on every GPU
    ddp = next((r for r in rows if r["strategy"] == "DDP" and not r["checkpointing"]), None)
    if ddp is not None and best is not ddp:
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
    pipeline's (pp) across nodes; EP's all-to-all, and its dense part's data parallelism (DDP's
    when the row has no FSDP) with the experts' replicas'."""
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
    step at which the two meet (the script's crossover_tokens)."""
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


def render_plan(args: argparse.Namespace) -> str:
    rows = plan_strategies(args)
    table = [[r["strategy"], "yes" if r["checkpointing"] else "no", f"{r['state'] / GB:,.1f}",
              f"{r['activations'] / GB:,.1f}", f"{r['total'] / GB:,.1f}",
              "yes" if r["fits"] else "no", r["sequences"], f"{r['sent'] / GB:,.2f}",
              f"{r['network'] / GB:,.2f}", f"{r['bubble']:.2f}" if r["bubble"] else "",
              by_dim_text(r)] for r in rows]
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
                              "of which across nodes", "bubble", "mesh: GB by dim"],
                      tablefmt="github"), ""]
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
         ("LLaMA-70B on 64 GPUs", {"params": 70e9, "gpus": 64, "layers": 80, "hidden": 8192,
                                   "vocab": 32000, "seq_len": 4096, "llama": True}, None),
         # Qwen3-30B-A3B, from its Hugging Face config.json (Qwen/Qwen3-30B-A3B): 48 layers,
         # hidden_size 2048, 128 experts a layer (every layer: mlp_only_layers empty), 8 a
         # token, moe_intermediate_size 768, vocab 151,936, untied head; its model card: 30.5B
         # parameters, 3.3B activated
         ("Qwen3-30B-A3B on 16 GPUs", {"params": 30.5e9, "gpus": 16, "layers": 48,
                                       "hidden": 2048, "vocab": 151936, "seq_len": 4096,
                                       "llama": True, "experts": 128, "top_k": 8,
                                       "expert_ffn": 768},
          "a MoE: its activations counted as a Llama's of its width")]
CASE_FLAGS = {"gpu_mem": 80.0, "gpus_per_node": 8, "micro_batch": 1, "micro_batches": None,
              "dtype": "bf16", "llama": False, "pp": None, "experts": 0, "top_k": 0,
              "expert_ffn": 0, "moe_layers": None}


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
        lines.append(f"{name} ({count} parameters{f'; {note}' if note else ''}): {pick}"
                     + "".join(f" {line}" for line in crossover_lines(rows)))
    return "\n".join(lines)
