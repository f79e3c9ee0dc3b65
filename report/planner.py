"""The strategy planner (`make plan`): per-GPU memory and bytes sent per step of each way to
spread a decoder over G GPUs, and which to pick."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tabulate import tabulate

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn, not for the table
    pass



GB = 1e9
# Bytes per parameter: (weights, gradients, optimizer state) with AdamW. fp32: 4 + 4 + 8 (two
# moments), what every folder measures on CPU. Mixed precision, as the ZeRO paper counts it:
# 16-bit weights and gradients, and fp32 master weights + two moments in the optimizer, 2+2+12.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


def state_per_gpu(strategy: str, params: float, gpus: int, dtype: str = "fp32",
                  per_node: int = 8, embedding: float = 0.0) -> float:
    """Bytes of weights + gradients + optimizer state one GPU keeps between steps.
    `embedding`: the parameters a pipeline's end stages hold besides their share of the blocks
    (token and position tables; the tied head repeats the token table on the last stage), and
    that tensor parallelism replicates (it splits the blocks' heads and hidden units)."""
    w, g, o = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    return {"DDP": (w + g + o) * params,
            "ZeRO-1": (w + g) * params + o * params / n,
            "ZeRO-2": w * params + (g + o) * params / n,
            "ZeRO-3": (w + g + o) * params / n,
            "FSDP full": (w + g + o) * params / n,
            "FSDP grad-op": (w + g + o) * params / n,
            "FSDP hybrid": (w + g + o) * params / hybrid,
            "pipeline": (w + g + o) * ((params - embedding) / n + embedding),
            "TP": (w + g + o) * ((params - embedding) / n + embedding),
            "TP x DP": (w + g + o) * ((params - embedding) / hybrid + embedding)}[strategy]


def sent_per_gpu(strategy: str, params: float, gpus: int, dtype: str = "fp32",
                 per_node: int = 8, stage_output_bytes: float = 0.0,
                 tied_params: float = 0.0, stream: float = 0.0, replicated: float = 0.0
                 ) -> float:
    """Bytes the busiest GPU sends per optimizer step, ring collectives: an all-reduce sends
    2(n-1)/n of the message, an all-gather or reduce-scatter (n-1)/n. A pipeline: a middle
    stage sends the activations it hands on in a step (`stage_output_bytes`, every
    micro-batch's) and as many gradients back; an end stage one of the two, and the gradient of
    the token table tied to the head (`tied_params`), all-reduced with the other end.
    Tensor parallelism over t GPUs (all of them, or a node's with data parallelism across
    nodes): per layer 4 all-gathers and 4 reduce-scatters of the t GPUs' batch, t x `stream`
    (s x b x h, one GPU's micro-batch, summed over the layers) in the weights' dtype, and an
    all-reduce of the gradients of the `replicated` parameters (embedding tables); across
    nodes, each GPU's gradients all-reduced with its peers in the other replicas."""
    w, g, _ = STATE_BYTES[dtype]
    n, hybrid = gpus, min(per_node, gpus)
    share, replicas = (n - 1) / n, max(1, n // hybrid)

    def tensor_parallel(t: int) -> float:
        return (t - 1) / t * (8 * t * stream * w + 2 * g * replicated)

    return {"DDP": 2 * share * g * params,  # all-reduce the gradients
            "ZeRO-1": share * (g + w) * params,  # reduce-scatter grads, all-gather weights
            "ZeRO-2": share * (g + w) * params,
            "ZeRO-3": share * (2 * w + g) * params,  # gather twice (forward, backward)
            "FSDP full": share * (2 * w + g) * params,
            "FSDP grad-op": share * (w + g) * params,  # kept gathered from forward to backward
            "FSDP hybrid": (hybrid - 1) / hybrid * (2 * w + g) * params
            + 2 * (replicas - 1) / replicas * g * params / hybrid,
            "pipeline": 0.0 if n == 1 else max(stage_output_bytes + g * tied_params,
                                               2 * stage_output_bytes if n > 2 else 0.0),
            "TP": tensor_parallel(n),
            "TP x DP": tensor_parallel(hybrid) + 2 * (replicas - 1) / replicas * g
            * ((params - replicated) / hybrid + replicated)}[strategy]


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


# The composed layouts: 03_fsdp/optimized_fsdp_tp.py (FSDP2 x TP on a ("dp", "tp") mesh) and
# 05_pipeline/optimized_pipeline_3d.py (pipeline x FSDP2 x TP on ("pp", "dp", "tp")). TP stays
# inside a node: its traffic every layer needs NVLink, FSDP's and the pipeline's cross nodes.
@dataclass(frozen=True)
class Layout:
    """The decoder's parts (parameter counts) that TP and a pipeline treat apart."""

    params: float
    layers: int
    hidden: int
    vocab: int
    seq: int
    embedding: float  # the first stage's tables (token, and position): TP splits them by rows
    head: float  # an untied output head (the Llama's lm_head), split by columns; 0 if tied
    tied: float  # the token table a tied head repeats on the last stage; 0 if untied
    replicated: float  # kept whole on every TP rank: the norms (and row-parallel biases)
    norms: float  # of those, the norms, whose gradients (each TP rank's tokens') TP all-reduces
    position_table: bool  # a learned (seq x hidden) table, its lookup reduce-scattered

    @property
    def blocks(self) -> float:
        """The layers' parameters (the final norm counted with them: a few hidden units)."""
        return self.params - self.embedding - self.head


def gpt_layout(params: float, layers: int, hidden: int, vocab: int, seq: int) -> Layout:
    """GPT-2's layout (the project's GPT): token and position tables, the head tied to the token
    table, LayerNorms with biases (2 a layer and the final one) and the biases of the
    row-parallel Linears (attention's and the MLP's output, 2 a layer), which TP keeps whole."""
    norms = 2 * (2 * layers + 1) * hidden
    return Layout(params, layers, hidden, vocab, seq, embedding=(vocab + seq) * hidden,
                  head=0.0, tied=vocab * hidden, replicated=norms + 2 * layers * hidden,
                  norms=norms, position_table=True)


def llama_layout(params: float, layers: int, hidden: int, vocab: int, seq: int) -> Layout:
    """A Llama's layout: a token table, an untied head, rotary positions (no table), RMSNorm
    weights (2 a layer and the final one) and no biases."""
    norms = (2 * layers + 1) * hidden
    return Layout(params, layers, hidden, vocab, seq, embedding=vocab * hidden,
                  head=vocab * hidden, tied=0.0, replicated=norms, norms=norms,
                  position_table=False)


def tp_degree(gpus: int, per_node: int) -> int:
    """TP's group: the GPUs of a node, or fewer so that groups tile the nodes and the world
    (the largest common divisor): its gathers and scatters every layer stay on NVLink."""
    return math.gcd(gpus, per_node)


def tp_activation_bytes(tp: int, micro_batch: int, seq: int, width: int, nbytes: int) -> float:
    """One all-gather or reduce-scatter of a TP group's activations of `width` units: the group
    works on t x `micro_batch` sequences (one GPU's batch each, as data parallelism gives it),
    each GPU sends (t-1)/t of them."""
    return (tp - 1) / tp * tp * micro_batch * seq * width * nbytes


def fsdp_tp_state(layout: Layout, dp: int, tp: int, dtype: str = "fp32") -> float:
    """FSDP x TP, bytes a GPU keeps: (w+g+o) x [(P - R)/(dp tp) + R/dp]. TP splits every weight
    but the R it replicates (`layout.replicated`); FSDP shards each TP rank's piece dp ways."""
    w, g, o = STATE_BYTES[dtype]
    r = layout.replicated
    return (w + g + o) * ((layout.params - r) / (dp * tp) + r / dp)


def fsdp_tp_sent(layout: Layout, dp: int, tp: int, dtype: str = "fp32", micro_batch: int = 1
                 ) -> dict[str, float]:
    """FSDP x TP, bytes a GPU sends a step, by mesh dim (ring collectives; w: the weights' and
    activations' bytes, gradients reduced in fp32 as the scripts' MixedPrecisionPolicy does).
    tp (in a node): per layer 4 all-gathers and 4 reduce-scatters of the group's activations
    (sequence parallelism: gathered before attention and the MLP, scattered after, and the
    backward's twins); at the ends 4 more (the embedding's scatter, the head's input gather,
    and twins), the loss over logits split by vocabulary (loss_parallel: 3 all-reduces of 4
    bytes a token, 2 (t-1)/t x 3 x 4 x t.b.s), a position table's lookup (2 (t-1)/t x s.h) and
    the norms' gradients all-reduced, 2 (t-1)/t x 4 x N.
    dp (across nodes): (dp-1)/dp x [w x (2 blocks + root) + 4 x (blocks + root)] of each
    weight's TP piece: FULL_SHARD gathers a block twice, the root (tables, head) once, and
    reduce-scatters every gradient once."""
    w = STATE_BYTES[dtype][0]
    stream = tp_activation_bytes(tp, micro_batch, layout.seq, layout.hidden, w)
    positions = 2 * (tp - 1) / tp * layout.seq * layout.hidden * w if layout.position_table \
        else 0.0
    tp_bytes = (8 * layout.layers + 4) * stream + positions \
        + 2 * 3 * tp_activation_bytes(tp, micro_batch, layout.seq, 1, 4) \
        + 2 * (tp - 1) / tp * 4 * layout.norms
    blocks = (layout.blocks - layout.replicated) / tp + layout.replicated
    root = (layout.embedding + layout.head) / tp
    dp_bytes = (dp - 1) / dp * (w * (2 * blocks + root) + 4 * (blocks + root))
    return {"tp": tp_bytes, "dp": dp_bytes}


def stage_pieces(layout: Layout, pp: int, tp: int, end: float) -> float:
    """Parameters one GPU of a pipeline stage holds after TP, before FSDP shards them: the
    stage's ceil(L/pp) layers (their replicated norms whole, the rest split t ways) and `end`,
    its tables or head, split t ways."""
    share = math.ceil(layout.layers / pp) / layout.layers
    return ((layout.blocks - layout.replicated) * share + end) / tp + layout.replicated * share


def pp_fsdp_tp_state(layout: Layout, pp: int, dp: int, tp: int, dtype: str = "fp32") -> float:
    """PP x FSDP x TP, the busiest stage's bytes a GPU: (w+g+o) x its TP pieces / dp, that is
    (w+g+o) x [(P - E - R)/(pp dp tp) + E/(dp tp) + R/(pp dp)], E the heavier end: the first
    stage's tables, or the last's head (and a tied head's copy of the token table)."""
    w, g, o = STATE_BYTES[dtype]
    end = max(layout.embedding, layout.head + layout.tied)
    return (w + g + o) * stage_pieces(layout, pp, tp, end) / dp


def pp_fsdp_tp_sent(layout: Layout, pp: int, dp: int, tp: int, microbatches: int,
                    dtype: str = "fp32", micro_batch: int = 1) -> dict[str, float]:
    """PP x FSDP x TP, bytes the first stage's GPU sends a step, by mesh dim (what the script
    records for rank 0; the last stage runs loss_parallel where the first scatters its tables).
    pp: m micro-batches' activations, each GPU its 1/t sequence shard of the group's t x b
    sequences (b.s.h x w), and a tied token table's gradient shard all-reduced with the last
    stage's (4 x V.h / (dp t)). tp: m x the stage's TP terms a micro-batch (8 a layer, the
    embedding's 2, a position table's), the norms' gradients all-reduced once a step. dp:
    (dp-1)/dp x (w + 4) x the stage's TP pieces: FSDP keeps the stage gathered from the first
    forward to the last backward (one gather), one fp32 reduce-scatter."""
    w = STATE_BYTES[dtype][0]
    m, layers = microbatches, math.ceil(layout.layers / pp)
    positions = 2 * (tp - 1) / tp * layout.seq * layout.hidden * w if layout.position_table \
        else 0.0
    per_micro_batch = (8 * layers + 2) * tp_activation_bytes(tp, micro_batch, layout.seq,
                                                              layout.hidden, w) + positions
    tp_bytes = m * per_micro_batch + 2 * (tp - 1) / tp * 4 * layout.norms * layers / layout.layers
    dp_bytes = (dp - 1) / dp * (w + 4) * stage_pieces(layout, pp, tp, layout.embedding)
    pp_bytes = m * micro_batch * layout.seq * layout.hidden * w + 4 * layout.tied / (dp * tp)
    return {"pp": pp_bytes, "dp": dp_bytes, "tp": tp_bytes}


def layout_of(args: argparse.Namespace) -> Layout:
    """The planner's flags as a Layout: GPT-2's, or with --llama a Llama's."""
    layout = llama_layout if args.llama else gpt_layout
    return layout(args.params, args.layers, args.hidden, args.vocab, args.seq_len)


def sent_across_nodes(strategy: str, sent: float, params: float, gpus: int, dtype: str,
                      per_node: int, replicated: float) -> float:
    """Of the bytes the busiest GPU sends a step, those that leave its node: none on one node;
    a hybrid layout's all-reduce between its replicas (FSDP hybrid; TP x DP, with the tables TP
    replicates); every other strategy's rings and stage boundaries span the nodes: all of it."""
    if gpus <= per_node:
        return 0.0
    g, hybrid = STATE_BYTES[dtype][1], min(per_node, gpus)
    replicas = gpus // hybrid
    allreduce = 2 * (replicas - 1) / replicas * g
    return {"FSDP hybrid": allreduce * params / hybrid,
            "TP x DP": allreduce * ((params - replicated) / hybrid + replicated)
            }.get(strategy, sent)


def composed_row(args: argparse.Namespace, layout: Layout, checkpointing: bool, tp: int,
                 pp: int = 1) -> dict:
    """One FSDP x TP (pp 1) or PP x FSDP x TP row. Memory a GPU: the state; the weights FSDP
    holds gathered (FSDP x TP: a block and the next's prefetch; the pipeline keeps its stage
    gathered for the whole step); activations: sequence parallelism leaves each GPU 1/t of its
    group's t x micro-batch sequences, one micro-batch's worth (a pipeline's first stage: its
    layers, min(pp, m) micro-batches in flight under 1F1B); the logits stay split by
    vocabulary (loss_parallel), a GPU's V/t of its group's t x micro-batch sequences: one
    micro-batch's whole logits, as activations_per_gpu counts them."""
    dp, mb, w = args.gpus // (pp * tp), args.micro_batch, STATE_BYTES[args.dtype][0]
    if pp == 1:
        m, mesh = 1, f"dp {dp} x tp {tp}"
        state = fsdp_tp_state(layout, dp, tp, args.dtype)
        sent = fsdp_tp_sent(layout, dp, tp, args.dtype, mb)
        gathered = 2 * w * ((layout.blocks - layout.replicated) / tp + layout.replicated) \
            / layout.layers
        acts = activations_per_gpu(layout.layers, layout.seq, mb, layout.hidden, layout.vocab,
                                   args.dtype, checkpointing)
    else:
        m = args.micro_batches or 2 * pp
        mesh = f"pp {pp} x dp {dp} x tp {tp}, m {m}"
        state = pp_fsdp_tp_state(layout, pp, dp, tp, args.dtype)
        sent = pp_fsdp_tp_sent(layout, pp, dp, tp, m, args.dtype, mb)
        end = max(layout.embedding, layout.head + layout.tied)
        gathered = w * stage_pieces(layout, pp, tp, end)
        acts = activations_per_gpu(layout.layers, layout.seq, mb, layout.hidden, layout.vocab,
                                   args.dtype, checkpointing, math.ceil(layout.layers / pp),
                                   min(pp, m))
    total = state + gathered + acts
    return {"strategy": "FSDP x TP" if pp == 1 else "PP x FSDP x TP",
            "checkpointing": checkpointing, "state": state,
            "activations": gathered + acts, "total": total,
            "fits": total <= args.gpu_mem * GB, "sent": sum(sent.values()), "by_dim": sent,
            "network": sent["dp"] + sent.get("pp", 0.0) if args.gpus > args.gpus_per_node
            else 0.0, "mesh": mesh, "bubble": (pp - 1) / (m + pp - 1),
            "sequences": dp * m * tp * mb}


def pipeline_depths(args: argparse.Namespace, tp: int) -> list[int]:
    """The pp PP x FSDP x TP may take: --pp, else each divisor of the GPUs TP leaves (gpus/tp)
    from 2 up to the layers; none when TP takes them all."""
    if args.pp:
        return [args.pp]
    across = args.gpus // tp
    return [pp for pp in range(2, min(across, args.layers) + 1) if across % pp == 0]


def composed_rows(args: argparse.Namespace, layout: Layout) -> list[dict]:
    """FSDP x TP, then PP x FSDP x TP at the smallest pp at which it fits (fewest stages: the
    least bubble), else at the largest (the leanest), with and without checkpointing."""
    tp, rows = tp_degree(args.gpus, args.gpus_per_node), []
    for checkpointing in (False, True):
        rows.append(composed_row(args, layout, checkpointing, tp))
    depths = pipeline_depths(args, tp)
    for checkpointing in (False, True) if depths else ():
        tried = [composed_row(args, layout, checkpointing, tp, pp) for pp in depths]
        rows.append(next((r for r in tried if r["fits"]), tried[-1]))
    return rows


def plan_strategies(args: argparse.Namespace) -> list[dict]:
    """Every strategy, with and without activation checkpointing, at the planner's flags."""
    layout = layout_of(args)
    embedding = layout.embedding
    stage_layers = -(-args.layers // args.gpus)
    micro_batches = args.micro_batches or 4 * args.gpus
    stage_output = micro_batches * args.seq_len * args.micro_batch * args.hidden * \
        (2 if args.dtype == "bf16" else 4)
    w = STATE_BYTES[args.dtype][0]
    rows = []
    stream = args.layers * args.seq_len * args.micro_batch * args.hidden
    for strategy in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full", "FSDP grad-op",
                     "FSDP hybrid", "pipeline", "TP", "TP x DP"):
        # weights gathered during the step: a block and the next one's prefetch, or all of them
        block = w * (args.params - embedding) / args.layers
        gathered = {"ZeRO-3": 2 * block, "FSDP full": 2 * block, "FSDP hybrid": 2 * block,
                    "FSDP grad-op": w * args.params}.get(strategy, 0.0)
        state = state_per_gpu(strategy, args.params, args.gpus, args.dtype, args.gpus_per_node,
                              embedding)
        sent = sent_per_gpu(strategy, args.params, args.gpus, args.dtype, args.gpus_per_node,
                            stage_output, layout.tied, stream, embedding)
        for checkpointing in (False, True):
            pipeline = strategy == "pipeline"
            acts = activations_per_gpu(args.layers, args.seq_len, args.micro_batch, args.hidden,
                                       args.vocab, args.dtype, checkpointing,
                                       stage_layers if pipeline else None,
                                       min(args.gpus, micro_batches) if pipeline else 1)
            total = state + acts + gathered
            rows.append({"strategy": strategy, "checkpointing": checkpointing, "state": state,
                         "activations": acts + gathered, "total": total,
                         "fits": total <= args.gpu_mem * GB, "sent": sent,
                         "network": sent_across_nodes(strategy, sent, args.params, args.gpus,
                                                      args.dtype, args.gpus_per_node,
                                                      embedding),
                         "bubble": (args.gpus - 1) / (micro_batches + args.gpus - 1)
                         if pipeline else 0.0,
                         # a step's batch: one micro-batch a GPU, or m through the pipeline
                         "sequences": args.micro_batch * (micro_batches if pipeline
                                                          else args.gpus)})
    return rows + composed_rows(args, layout)


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
    """`choose`'s pick and why, in a sentence: what it needs, what the simplest (DDP) or
    anything without checkpointing would need, and across nodes, what it sends there against
    the next best that fits."""
    why = [f"{best['total'] / GB:,.1f} of {gpu_mem:g} GB a GPU"]
    ddp = rows[0]  # DDP without checkpointing: the whole model and its state on every GPU
    if best is not ddp:
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
    pipeline's (pp) across nodes."""
    if "by_dim" not in row:
        return ""
    sent = row["by_dim"]
    return f"{row['mesh']}: " + " / ".join(f"{label} {sent[dim] / GB:,.2f}" for dim, label in
                                          (("tp", "TP"), ("dp", "FSDP"), ("pp", "PP"))
                                          if dim in sent)


def render_plan(args: argparse.Namespace) -> str:
    rows = plan_strategies(args)
    table = [[r["strategy"], "yes" if r["checkpointing"] else "no", f"{r['state'] / GB:,.1f}",
              f"{r['activations'] / GB:,.1f}", f"{r['total'] / GB:,.1f}",
              "yes" if r["fits"] else "no", r["sequences"], f"{r['sent'] / GB:,.2f}",
              f"{r['network'] / GB:,.2f}", f"{r['bubble']:.2f}" if r["bubble"] else "",
              by_dim_text(r)] for r in rows]
    fitting = [r for r in rows if r["fits"]]
    nodes = -(-args.gpus // args.gpus_per_node)
    lines = [f"{args.params:.3g} parameters ({'Llama' if args.llama else 'GPT-2'} layout), "
             f"{args.gpus} GPUs of {args.gpu_mem:g} GB ({nodes} node{'s' * (nodes > 1)} of "
             f"{args.gpus_per_node}), {args.dtype}, micro-batch {args.micro_batch} x "
             f"{args.seq_len} tokens", "",
             tabulate(table, ["strategy", "act. ckpt", "state GB", "activations (+gathered) GB",
                              "total GB", "fits", "sequences/step", "GB sent/GPU/step",
                              "of which across nodes", "bubble", "mesh: GB by dim"],
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
                                   "vocab": 32000, "seq_len": 4096, "llama": True}, None)]
CASE_FLAGS = {"gpu_mem": 80.0, "gpus_per_node": 8, "micro_batch": 1, "micro_batches": None,
              "dtype": "bf16", "llama": False, "pp": None}


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
        lines.append(f"{name} ({count} parameters{f'; {note}' if note else ''}): {pick}")
    return "\n".join(lines)
