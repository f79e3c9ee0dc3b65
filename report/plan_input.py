"""The planner's inputs: its flags as the numbers a script's PLANNED formulas take (PlanInput),
and the formulas of its own that the scripts' leave out (a GPU's activations and loss, the FLOPs
a token); the flags' defaults and the MoE flags' checks."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import types
from dataclasses import dataclass
from pathlib import Path

import common

GB = 1e9
# Bytes per parameter: (weights, gradients, optimizer state) with AdamW, what the scripts keep:
# fp32 weights, gradients and two moments, 4 + 4 + 8, whatever they compute in. (The ZeRO paper's
# mixed precision, 16-bit weights and gradients beside fp32 masters, 2 + 2 + 12, is not theirs:
# the dry runs measured 4 + 4 + 8.)
STATE_BYTES = (4, 4, 8)
# A value's bytes in compute, by --dtype: bf16 runs keep the fp32 state above and compute under
# autocast (or FSDP's param_dtype), as every script's --dtype bf16 does
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}


# The planner's flags a case or a published run does not give: GPUs of 80 GB, 8 a node, bf16,
# a sequence a GPU, dense, eager on an H100
FLAG_DEFAULTS = {"gpu_mem": 80.0, "gpus_per_node": 8, "micro_batch": 1, "micro_batches": None,
                 "dtype": "bf16", "llama": False, "pp": None, "experts": 0, "top_k": 0,
                 "expert_ffn": 0, "moe_layers": None, "gpu": "h100", "run_as": "eager",
                 "lora_rank": 0, "ffn": None, "cp": None, "heads": None, "kv_heads": None,
                 "head_dim": None, "flops_per_item": None, "muon": False}


# What report/planner.py hands a script's formulas. A script lists its strategies in a
# module-level PLANNED: [{"strategy": name, "place": its row's position, "figures": a function
# of one PlanInput giving that strategy's per-GPU figures}], formulas its own theory shares;
# the planner imports the script, the script never the planner (it names PlanInput only for
# type checkers).
@dataclass(frozen=True)
class PlanInput:
    """A decoder on a cluster, in plain numbers (parameter counts, bytes, degrees): the
    planner's flags, or the configuration a run recorded. A Mixture of Experts adds its routed
    experts (the rest of it, shared experts and routers included, is dense); a dense model
    leaves them at 0."""

    params: float
    gpus: int
    per_node: int  # GPUs a node
    state_bytes: tuple[int, int, int]  # a parameter's: weights, gradients, optimizer state
    layers: int
    hidden: int
    vocab: int
    seq: int
    micro_batch: int  # sequences one GPU computes at once
    micro_batches: int | None  # a pipeline's m; None: the strategy's default
    tp: int  # the composed layouts' tensor-parallel degree
    pp: int  # PP x FSDP x TP's stages (1 for the other layouts)
    cp: int  # FSDP x CP's context-parallel degree: the ranks a sequence is cut across (else 1)
    embedding: float  # the input tables: token, and position if learned
    head: float  # an untied output head's (0 if tied to the token table)
    tied: float  # the token table a tied head repeats on the last stage (0 if untied)
    replicated: float  # what TP keeps whole in the blocks: norms (and row-parallel biases)
    norms: float  # of those, the norms (their gradients are each TP rank's tokens')
    position_table: bool  # a learned seq x hidden table
    experts: int = 0  # routed experts a MoE layer (0: a dense model)
    top_k: int = 0  # the routed experts a token goes to
    moe_layers: int = 0  # the layers with experts
    expert_params: float = 0.0  # the routed experts' parameters, all MoE layers together
    ep: int = 1  # EP's degree: the GPUs a layer's experts are spread over
    lora_params: float = 0.0  # LoRA fine-tuning's adapters, all layers (0: no LoRA row)
    # a value's bytes in compute: what autocast casts fp32 weights to, FSDP gathers them in, and
    # activations are kept in (bf16: 2)
    compute_bytes: int = 4
    ffn: int = 0  # the MLP's width: a Llama's SwiGLU's, a GPT's 4 x hidden
    kv_width: float = 0.0  # K's (and V's) width a token: KV heads x head size (0: hidden)

    @property
    def blocks(self) -> float:
        """The layers' parameters (with the final norm: a few hidden units)."""
        return self.params - self.embedding - self.head

    def cast(self, weights: float) -> float:
        """Bytes of autocast's copies of `weights` kept in fp32 and computed in bf16: each
        forward casts every weight it multiplies by and keeps the copy for its backward (none
        in fp32)."""
        return weights * self.compute_bytes if self.compute_bytes < self.state_bytes[0] else 0.0


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
               ) -> PlanInput:
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
    return PlanInput(params=args.params, gpus=args.gpus, per_node=args.gpus_per_node,
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


def plan_flops_per_token(args: argparse.Namespace) -> tuple[float, float]:
    """(all, attention's) training FLOPs a token at the planner's flags: the weights a token
    multiplies through are the parameters less the input tables (plus a tied head's, which
    the head multiplies by), a MoE's routed experts at top_k of them (common's
    train_flops_per_token: the records' count). A CNN stand-in's (`flops_per_item`: an image's,
    counted by FlopCounterMode) spread over its `seq_len` positions, none of it attention's."""
    if getattr(args, "flops_per_item", None):
        return args.flops_per_item / args.seq_len, 0.0
    layout = plan_input(args)
    routed_off = expert_params(args) * (1 - args.top_k / args.experts) if args.experts else 0.0
    matmul = args.params - layout.embedding + layout.tied - routed_off
    return common.train_flops_per_token(matmul, args.layers, args.hidden, args.seq_len)


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
