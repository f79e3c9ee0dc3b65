"""Expert parallelism: each rank holds E/ep of every layer's experts; tokens travel to them.

What it does: every MoE layer's experts are cut into `--ep` contiguous groups, one a rank of an
ep group; the rest of the model stays data-parallel over the world. In each layer a rank routes
its own tokens as the model does, sorts the routed (token, choice) slots by expert, and tells
each peer how many rows it has for each of that peer's experts (an all-to-all of E counts). It
then dispatches the rows (all_to_all_single, uneven splits), runs each local expert once on all
its rows and sends the outputs back the same way (combine), where each is weighted and summed into
its token. Backward runs both exchanges in reverse. Dropless: nothing is capped or dropped. An
expert's gradient then holds its ep group's tokens: summed over its replicas (the dp ranks at
its ep place) and scaled to the world's mean, it is data parallelism's. `--fsdp` shards the
dense part with FSDP2 over the world (EP x FSDP on a dp x ep mesh).
Why it helps: the experts, most of a MoE's weights, are neither replicated nor all-reduced:
state falls to dense + experts/ep, and a step sends each routed token's hidden vector (four
times: dispatch, combine, their gradients) instead of every expert's gradient. It stops paying
when a step's tokens outweigh the expert weights (`make plan`'s crossover).
Run:        torchrun --nproc_per_node=2 08_moe/optimized_moe_ep.py --size small
            torchrun --nproc_per_node=4 08_moe/optimized_moe_ep.py --ep 2 --fsdp
Look for:   `make moe report`: speedup, comm MB and state MB against baseline_moe at the same
            losses; alltoall_mb equal to the theory from the measured counts.
Theory:     all-to-all bytes a layer = 2 x (rows sent to peers + rows received) x d_model x
            bytes a value, plus E x (ep-1)/ep counts; uniform routing: tokens x k x (ep-1)/ep rows
            each way. State: 16 bytes x (dense, /N with --fsdp, + experts / ep).
"""

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Exact arithmetic but for the order of sums (an expert's rows batched with other ranks', its
# gradient summed before the mean): the layer matches every expert on every rank to fp32
# rounding (tests/test_moe.py), `tiny` trains to the baseline's losses exactly. But rounding
# flips a near-tie of the top-k now and then (the loads then differ from the baseline's in the
# third digit), a token sent to another expert moves the loss by about 1e-4, and the bias
# balancing, fed the moved counts, moves more. Measured at `small` over 11 steps: 1.3e-3 at ep
# 2, 2.8e-4 at ep 4, at most 2e-4 of the loss; 5e-3 is 7e-4 of it. bf16: the dtype's resolution.
LOSS_TOLERANCE = {"fp32": 5e-3, "bf16": 5e-2}


# Shapes: T tokens, K top-k, D d_model, E experts (P ranks x L), N = T x K rows sent, R received
# Copied from 07_context/optimized_context_ulysses.py: AllToAll, changed: uneven splits
class AllToAll(torch.autograd.Function):
    """Rows to the P ranks of `group`: send_P[p] of them (in order) to rank p, recv_P[p] from
    it. Backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows_ND: torch.Tensor, send_P: list[int], recv_P: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.counts, ctx.group = (send_P, recv_P), group
        rows_RD = rows_ND.new_empty((sum(recv_P), rows_ND.shape[1]))
        dist.all_to_all_single(rows_RD, rows_ND.contiguous(), recv_P, send_P, group=group)
        return rows_RD

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        send_P, recv_P = ctx.counts
        grad_ND = grad_RD.new_empty((sum(send_P), grad_RD.shape[1]))
        dist.all_to_all_single(grad_ND, grad_RD.contiguous(), send_P, recv_P, group=ctx.group)
        return grad_ND, None, None, None


class ExpertParallel(torch.nn.Module):
    """A drop-in for a MoE layer's `experts`, called as HuggingFace calls them (tokens,
    top_k_index, top_k_weights): keeps this rank's E/ep of `experts` (global experts
    [rank x E/ep, (rank + 1) x E/ep), rank this one's in `group`) as `local`, and sends each
    routed row to the rank that holds its expert. `experts` is the layer's own, cut in place: a
    list of modules, one an expert (the project's `common.Experts`), or HuggingFace's fused
    module, every parameter (E, ...) an expert's slice on dim 0, called as its layer calls it,
    so that it computes as the model does (its activation, biases, `experts_implementation`).
    A layout it cannot cut that way is refused in one line."""

    def __init__(self, experts: torch.nn.Module, group: dist.ProcessGroup):
        super().__init__()
        ep, me = dist.get_world_size(group), dist.get_rank(group)
        fused = not isinstance(experts, torch.nn.ModuleList)
        if fused:
            params = dict(experts.named_parameters())
            n_experts = getattr(experts, "num_experts", None) or next(
                (p.shape[0] for p in params.values()), 0)
            for name, p in params.items():
                if p.shape[:1] != (n_experts,):
                    raise ValueError(f"experts' {name} {tuple(p.shape)} is not one slice an "
                                     f"expert on dim 0 ({n_experts} experts): ExpertParallel "
                                     f"cannot cut it")
            if buffers := [name for name, _ in experts.named_buffers()]:
                raise ValueError(f"experts' buffers {buffers}: ExpertParallel cuts parameters "
                                 f"only")
        else:
            n_experts = len(experts)
        if not n_experts or n_experts % ep:
            raise ValueError(f"ep {ep} does not divide the {n_experts} experts: use an ep that "
                             f"divides {n_experts}")
        local = n_experts // ep
        kept = slice(me * local, (me + 1) * local)
        if fused:
            for name, p in params.items():
                owner, _, leaf = name.rpartition(".")
                setattr(experts.get_submodule(owner), leaf,
                        torch.nn.Parameter(p.detach()[kept].clone(), p.requires_grad))
            if hasattr(experts, "num_experts"):  # HuggingFace's forward reads it
                experts.num_experts = local
        else:  # the list keeps its class, renumbered from 0
            del experts[kept.stop:], experts[:kept.start]
        self.local, self.n_experts, self.group = experts, n_experts, group
        self.exchanged = (0, 0, 0)  # the last forward's rows sent to peers, received, value bytes

    def forward(self, tokens_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                top_k_weights_TK: torch.Tensor) -> torch.Tensor:
        ep, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        local = self.n_experts // ep
        # the routed slots sorted by expert, so by the rank that holds it
        slot_N = top_k_index_TK.flatten().argsort(stable=True)
        token_N = slot_N // top_k_index_TK.shape[1]
        send_counts_E = common.expert_counts(top_k_index_TK, self.n_experts)
        recv_counts_E = torch.empty_like(send_counts_E)  # [p x L + e]: rank p's rows for my e
        dist.all_to_all_single(recv_counts_E, send_counts_E, group=self.group)
        # the exchanges' split sizes, read on the host at once (one sync a layer on a GPU)
        if common.dry_run():  # no counts to read: an even share of the slots for every expert
            send_PL = recv_PL = common.even_routing(top_k_index_TK.numel(), ep, local)
        else:
            send_PL, recv_PL = torch.stack([send_counts_E, recv_counts_E]).view(2, ep,
                                                                                local).tolist()
        send_P, recv_P = [sum(row) for row in send_PL], [sum(row) for row in recv_PL]
        routed_input_ND = tokens_TD[token_N]
        if torch.is_autocast_enabled(tokens_TD.device.type):  # the experts compute in it: send it
            routed_input_ND = routed_input_ND.to(torch.get_autocast_dtype(tokens_TD.device.type))
        expert_input_RD = AllToAll.apply(routed_input_ND, send_P, recv_P, self.group)
        # rows arrive by source rank, then expert: each one's local expert
        expert_R = torch.arange(local, device=tokens_TD.device).repeat(ep).repeat_interleave(
            recv_counts_E, output_size=len(expert_input_RD))
        rows_per_expert_L = [sum(column) for column in zip(*recv_PL, strict=True)]
        expert_output_RD = self.compute(expert_input_RD, expert_R, rows_per_expert_L)
        routed_output_ND = AllToAll.apply(expert_output_RD, recv_P, send_P, self.group)
        self.exchanged = (sum(send_P) - send_P[me], sum(recv_P) - recv_P[me],
                          expert_input_RD.element_size())
        weighted_ND = routed_output_ND * top_k_weights_TK.flatten()[slot_N, None]
        return torch.zeros_like(tokens_TD).index_add_(0, token_N, weighted_ND.to(tokens_TD.dtype))

    def compute(self, rows_RD: torch.Tensor, expert_R: torch.Tensor,
                rows_per_expert_L: list[int]) -> torch.Tensor:
        """Each row through its local expert, the outputs in the rows' order. A list: grouped
        by expert, each expert runs once on its rows (`rows_per_expert_L`, on the host
        already), even on none, so its weights always get a gradient. Fused: the module
        itself, each row routed to its expert at weight 1."""
        if isinstance(self.local, torch.nn.ModuleList):
            by_expert_R = expert_R.argsort(stable=True)
            out_RD = torch.cat([expert(part) for expert, part in zip(
                self.local, rows_RD[by_expert_R].split(rows_per_expert_L), strict=True)])
            return torch.empty_like(out_RD).index_copy(0, by_expert_R, out_RD)
        if not len(rows_RD):  # its output would be zeros outside the graph, and the combine's
            return rows_RD.clone()  # backward a collective this rank would then skip
        return self.local(rows_RD, expert_R[:, None], rows_RD.new_ones(len(rows_RD), 1))


def shard_experts(blocks: list[torch.nn.Module], group: dist.ProcessGroup) -> list:
    """Keep this rank's E/ep experts of each block's MoE (`block.mlp.experts`; a block without
    one stays as it is) behind an ExpertParallel over `group`, sliced from what this rank
    holds: every rank must hold the same weights. Returns the local experts' parameters; a
    model with no experts is refused in one line."""
    moes = [block.mlp for block in blocks if hasattr(getattr(block, "mlp", None), "experts")]
    if not moes:
        raise ValueError("no block has an mlp.experts: expert parallelism needs a MoE model")
    for moe in moes:
        moe.experts = ExpertParallel(moe.experts, group)
    return [p for moe in moes for p in moe.experts.parameters()]


def reduce_expert_grads(expert_params: list[torch.Tensor], dp_group: dist.ProcessGroup,
                        world: int) -> None:
    """An expert's gradient summed its ep group's tokens: summed over its dp replicas too (one
    all-reduce, none when ep = world) and divided by the world, it is the mean DDP takes. A
    fused slice whose experts got no row this step has no gradient: it gets zeros, what DDP's
    whole tensor holds there (AdamW still steps it)."""
    for p in expert_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in expert_params]
    if dist.get_world_size(dp_group) > 1:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=dp_group)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split(
            [g.numel() for g in grads]), grads, strict=True)])
    torch._foreach_div_(grads, world)


def wrap_dense(model: torch.nn.Module, blocks: list[torch.nn.Module], expert_params: list,
               topo: common.Topology, fsdp: bool) -> torch.nn.Module:
    """The dense part data-parallel over the world, the experts left out: DDP (they are this
    rank's own), or FSDP2 on each block then the root. Returns the model to train."""
    if not fsdp:
        experts = {id(p) for p in expert_params}
        # DDP has no public way to leave parameters out; this is the one its tests use
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if id(p) in experts])
        return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
                   gradient_as_bucket_view=True, **common.DDP_NO_BUFFER_SYNC)
    mesh = init_device_mesh(topo.device.type, (topo.world_size,))
    for module in [*blocks, model]:
        fully_shard(module, mesh=mesh, ignored_params=set(expert_params))
    return model


def adamw(model: torch.nn.Module, expert_params: list, **kwargs) -> torch.optim.AdamW:
    """AdamW with the experts in a parameter group of their own: under --fsdp the dense part's
    parameters are FSDP2's DTensors and the experts plain tensors, and a foreach step (AdamW's
    default on GPUs) over a list that mixes them raises "got mixed torch.Tensor and DTensor";
    each group steps alone. `kwargs`: AdamW's (lr, foreach, ...)."""
    experts = {id(p) for p in expert_params}
    dense = [p for p in model.parameters() if id(p) not in experts]
    return torch.optim.AdamW([{"params": dense}, {"params": expert_params}], **kwargs)


# Copied from 08_moe/baseline_moe.py: balance_experts
def balance_experts(routers: list[torch.nn.Module], rate: float,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """After an optimizer step: the tokens each router sent to each expert, summed over `group`
    (every rank whose tokens it routed), returned as (layers, experts). With rate > 0 each
    expert's selection bias moves toward equal load, up under the mean and down over it, by
    `rate` x its distance from the mean, relative (DeepSeek-V3 moves it by a fixed step, the
    distance's sign, over thousands of steps; in proportion it settles in the tens a CPU run
    has). No gradient; the same on every rank, since the counts are. The counts restart.
    Computed where the counts are: no value is read back to the host (a sync a step on a GPU)."""
    counts = torch.stack([router.tokens_per_expert for router in routers])
    dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for router, count in zip(routers, counts, strict=True):
            mean = count.double().mean()
            if rate:  # no token routed (no forward since the last step): no news, no move
                router.expert_bias += torch.where(mean > 0, rate * (mean - count) / mean, 0.0)
            router.tokens_per_expert.zero_()
    return counts


# Copied from 08_moe/baseline_moe.py: load_figures
def load_figures(loads: list[torch.Tensor], warmup: int) -> dict:
    """What the record says of the balance, from each step's (layers, experts) counts, over the
    timed steps: each layer's busiest expert against the mean, over the steps together
    (`expert_load`, 1 when even: what balancing evens out) and a step at a time
    (`expert_load_step`, the mean over steps: a batch's own spread is in it), the worst layer's
    of each; and the busiest expert's tokens a step (what sets a step's pace)."""
    timed = torch.stack(loads[warmup:]).double()  # (steps, layers, experts)
    together = timed.sum(0)
    by_layer = (together.max(-1).values / together.mean(-1)).tolist()
    by_step = (timed.max(-1).values / timed.mean(-1)).mean(0)
    return {"expert_load": round(max(by_layer), 4),
            "expert_load_by_layer": [round(x, 4) for x in by_layer],
            "expert_load_step": round(float(by_step.max()), 4),
            "busiest_expert_tokens": round(float(timed.max(-1).values.mean()), 1)}


# Copied from 08_moe/baseline_moe.py: moe_parser
def moe_parser(doc: str) -> argparse.ArgumentParser:
    """The folder's flags: the MoE model alone (any other --model is skipped, saying why), the
    folder's steps (`make moe` in ~2 minutes) and how the routers balance. A script adds its
    own, then add_long_run_flag."""
    parser = common.parser(doc, skips={
        model: "expert parallelism needs a model with experts: run --model moe"
        for model in common.MODELS if model != "moe"})
    parser.set_defaults(model="moe", steps=8, warmup=3)
    parser.add_argument("--moe-balance", choices=common.MOE_BALANCING, default="bias",
                        help="bias: DeepSeek-V3's aux-loss-free bias; aux: the auxiliary loss; "
                             "none: plain top-k (default: bias)")
    parser.add_argument("--bias-rate", type=common.positive_float, default=0.2,
                        help="how far an expert's bias moves a step, x its relative distance "
                             "from the mean load (--moe-balance bias)")
    return parser


# Copied from 08_moe/baseline_moe.py: add_long_run_flag
def add_long_run_flag(parser: argparse.ArgumentParser) -> None:
    """`--long-run`: 40 steps (10 untimed, 30 timed) instead of the folder's 11, long enough for
    the model to learn past its first, clustered routing and for the routers' bias to settle: the
    balance rows of `make moe`. A --warmup or --steps given still wins. Added after the script's
    other flags (it reads the command line to set defaults)."""
    parser.add_argument("--long-run", action="store_true",
                        help="40 steps (10 untimed, 30 timed) instead of 11: `make moe`'s "
                             "balance rows, with bias balancing and without")
    if parser.parse_known_args()[0].long_run:
        parser.set_defaults(warmup=10, steps=30)


def choose_ep(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> int:
    """--ep, or the largest that divides both the world and the experts. An --ep that does not
    divide the experts is refused in one line; a world that holds no ep group is skipped, saying
    why (the host's world, not the flag, is short or odd)."""
    n_experts = common.SIZES[args.size].n_experts
    ep = args.ep or math.gcd(world, n_experts)
    if n_experts % ep:
        parser.error(f"--ep {ep} does not divide the {n_experts} experts of --size "
                     f"{args.size}: use an --ep that divides {n_experts}")
    if ep == 1:  # every rank would hold every expert: data parallelism, baseline_moe
        raise common.Skip(f"no ep > 1 divides both the world ({world}) and the {n_experts} "
                          f"experts: launch a world that shares a factor with {n_experts}")
    if world % ep:
        raise common.Skip(f"--ep {ep} groups need a world of a multiple of {ep} ranks, this "
                          f"one has {world}: launch --nproc_per_node={ep * max(1, world // ep)}")
    return ep


def comm_by_dim(stats: common.Stats) -> dict[str, float]:
    """The measured bytes of each mesh dim: ep's, the all-to-alls (nothing else sends one; at ep
    = world its group is the world's, so it is not told by group); dp's, the rest, the data
    parallelism's (the dense part over all ranks, the experts over their replicas, the counts),
    as the planner splits them."""
    ep = sum(mb for kind, mb in stats.comm_mb_by_kind.items() if kind.startswith("alltoall"))
    return {"ep": round(ep, 3), "dp": round(stats.comm_mb - ep, 3)}


# Copied from 03_fsdp/optimized_fsdp.py: padded_numel
def padded_numel(p: torch.Tensor, group: int) -> int:
    """Elements FSDP allocates for `p` across a shard group: dim 0 rounded up to the group."""
    return math.ceil(p.shape[0] / group) * group * math.prod(p.shape[1:])


def alltoall_bytes(rows_sent: float, rows_received: float, d_model: int, value_bytes: int,
                   n_experts: int, ep: int) -> float:
    """Bytes a rank hands one MoE layer's all-to-alls a step: its rows out and the outputs it
    returns (forward), their gradients (backward), and the E counts, (ep-1)/ep of them sent."""
    return (2 * (rows_sent + rows_received) * d_model * value_bytes
            + n_experts * 8 * (ep - 1) / ep)


def uniform_alltoall_bytes(tokens: float, top_k: int, d_model: int, value_bytes: int,
                           n_experts: int, ep: int) -> float:
    """alltoall_bytes when routing is uniform: (ep-1)/ep of a rank's tokens x k slots go out,
    as many come in."""
    rows = tokens * top_k * (ep - 1) / ep
    return alltoall_bytes(rows, rows, d_model, value_bytes, n_experts, ep)


def dense_bytes(model: torch.nn.Module, blocks: list[torch.nn.Module], expert_params: list,
                world: int, fsdp: bool) -> dict[str, float]:
    """The theory of wrap_dense's dense part, from the model as built: the bytes its collectives
    send a step (DDP's all-reduce, or FSDP2's gathers and reduce-scatters of the blocks and the
    root, padded as FSDP2 pads) and the state a rank keeps."""
    experts = {id(p) for p in expert_params}
    dense = [p for p in model.parameters() if id(p) not in experts]
    if not fsdp:
        values = sum(p.numel() for p in dense)
        return {"sent": common.ring_allreduce_mb(4 * values, world) * 2**20,
                "state": 16.0 * values}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    counts = {"blocks": 0, "root": 0}
    for p in dense:
        counts["blocks" if id(p) in in_blocks else "root"] += padded_numel(p, world)
    predicted = fsdp_bytes(counts["blocks"], counts["root"], world)
    return {"sent": predicted["sent"], "state": predicted["state"]}


# Copied from 03_fsdp/optimized_fsdp.py: fsdp_bytes
def fsdp_bytes(blocks: float, root: float, group: int, replicas: int = 1, reshard: bool = True,
               gather: float = 4, reduce: float = 4, state: float = 16, fp32: float = 0.0,
               largest_block: float = 0.0) -> dict[str, float]:
    """FSDP's bytes a rank, from value counts (padded as FSDP pads them): the blocks' values,
    the root's (FSDP2 never reshards it) and `fp32`'s (BatchNorm's under bf16: fp32, gathered
    again for backward), sharded over `group` ranks, `state` bytes each. Sent a step, (g-1)/g
    of each: every block all-gathered twice with reshard (FULL_SHARD), once without
    (SHARD_GRAD_OP), `gather` bytes a value, the root once, every gradient reduce-scattered,
    `reduce` bytes; HSDP's `replicas` all-reduce each shard (`across_replicas`). Held gathered
    beyond the shards: the root and a block with its prefetched next (`largest_block` each),
    or, without reshard, everything. The planner's figures are ZeRO-3's
    (04_zero/optimized_zero3.py's zero3_bytes), yet the two stay apart: each counts its own
    implementation's padding, here FSDP2's (each parameter's dim 0 rounded up to the group)."""
    share, gathers, values = (group - 1) / group, 2 if reshard else 1, blocks + root + fp32
    across_replicas = 2 * (replicas - 1) / replicas * values / group * reduce
    sent = share * (blocks * (gathers * gather + reduce) + root * (gather + reduce)
                    + fp32 * (2 * 4 + reduce)) + across_replicas
    return {"state": state * values / group, "sent": sent, "across_replicas": across_replicas,
            "gathered": gather * (root + 2 * largest_block) if reshard else gather * values}


def ep_theory(args: argparse.Namespace, ep: int, world: int, exchanged: list[tuple],
              expert_params: list, routers: list, dense: dict[str, float]) -> dict:
    """The record's theory: the all-to-alls' bytes from the rows each layer exchanged in the
    step the record counts (`exchanged`: rows sent, received, bytes a value, a layer each) and
    for uniform routing; dp's, the experts' gradients all-reduced over their replicas, the dense
    part's collectives (`dense`: dense_bytes) and the routers' counts over the world; the state
    a rank keeps; the busiest expert's tokens a step were the load even."""
    size = common.SIZES[args.size]
    alltoall = sum(alltoall_bytes(sent, received, size.d_model, value_bytes, size.n_experts, ep)
                   for sent, received, value_bytes in exchanged)
    uniform = size.n_layers * uniform_alltoall_bytes(
        args.batch_size * args.seq_len, size.top_k, size.d_model, exchanged[0][2],
        size.n_experts, ep)
    expert_bytes = 4 * sum(p.numel() for p in expert_params)
    count_bytes = sum(r.tokens_per_expert.numel() * 8 for r in routers)
    replicas = common.ring_allreduce_mb(expert_bytes, world // ep) if world > ep else 0.0
    everyone = dense["sent"] / 2**20 + common.ring_allreduce_mb(count_bytes, world)
    tokens = world * args.batch_size * args.seq_len
    return {"comm_mb": alltoall / 2**20 + replicas + everyone,
            "comm_mb_by_dim": {"ep": round(alltoall / 2**20, 3),
                               "dp": round(replicas + everyone, 3)},
            "state_mb": (dense["state"] + 4 * expert_bytes) / 2**20,
            "alltoall_mb": alltoall / 2**20,
            "alltoall_uniform_mb": uniform / 2**20,
            # the busiest expert's tokens if the load were even: the mean
            "busiest_expert_tokens": tokens * size.top_k / size.n_experts}


def expert_parallel_bytes(plan: "PlanInput") -> dict[str, float]:
    """EP's bytes a GPU a step at the planner's model and cluster, by what sends them: the all-
    to-alls of `moe_layers` layers for uniform routing at a GPU's micro_batch x seq tokens
    (uniform_alltoall_bytes), the experts' gradients all-reduced over their gpus/ep replicas,
    the routers' counts (8 bytes an expert a layer) all-reduced over the world; and what data
    parallelism would send for the experts instead, every one's gradient over every GPU."""
    _, g, _ = plan.state_bytes
    replicas = plan.gpus // plan.ep
    tokens = plan.micro_batch * plan.seq
    return {"alltoall": plan.moe_layers * uniform_alltoall_bytes(
                tokens, plan.top_k, plan.hidden, plan.compute_bytes, plan.experts, plan.ep),
            "replicas": common.ring_allreduce_mb(g * plan.expert_params / plan.ep, replicas)
            * 2**20,
            "counts": common.ring_allreduce_mb(8 * plan.moe_layers * plan.experts, plan.gpus)
            * 2**20,
            "data_parallel": common.ring_allreduce_mb(g * plan.expert_params, plan.gpus) * 2**20,
            "tokens": tokens}


def planned_crossover(plan: "PlanInput") -> float:
    """Tokens a GPU a step at which EP's all-to-all bytes equal what it saves: data
    parallelism's all-reduce of every expert's gradient less EP's over the experts' replicas.
    The all-to-all grows with the tokens (a line through its bytes at no token and at one),
    the all-reduce does not: below this EP sends fewer bytes, above it more."""
    sent = expert_parallel_bytes(plan)
    at = [plan.moe_layers * uniform_alltoall_bytes(n, plan.top_k, plan.hidden,
                                                   plan.compute_bytes, plan.experts, plan.ep)
          for n in (0, 1)]
    return (sent["data_parallel"] - sent["replicas"] - at[0]) / (at[1] - at[0])


def planned_ep(plan: "PlanInput", fsdp: bool = False) -> dict:
    """The planner's EP rows (this script, and its --fsdp): each layer's experts over ep GPUs of
    a node (the all-to-all on NVLink) or, where a node's GPUs are too few, across nodes; the
    dense part (the rest: tables, attention, routers, shared experts, norms) data-parallel
    over every GPU, DDP's or FSDP's (fsdp_bytes, as 03_fsdp/optimized_fsdp.py plans it). State:
    state bytes x (dense, /gpus with FSDP, + experts / ep)."""
    w, g, o = plan.state_bytes
    sent = expert_parallel_bytes(plan)
    dense = plan.params - plan.expert_params
    if fsdp:
        final_norm = plan.norms / (2 * plan.layers + 1)  # the root holds it: a layer holds two
        root = plan.embedding + plan.head + final_norm
        # no param_dtype: FSDP gathers the fp32 weights, and autocast casts them as the rest
        predicted = fsdp_bytes(dense - root, root, plan.gpus, 1, True, w, g, w + g + o,
                               largest_block=(dense - root) / plan.layers)
        data_parallel = {"sent": predicted["sent"],
                         "state": predicted["state"] + (w + g + o) * plan.expert_params / plan.ep,
                         "gathered": predicted["gathered"],
                         "cast": plan.cast(dense + plan.expert_params / plan.ep),
                         "fp32_residual": True}
    else:
        data_parallel = {"sent": common.ring_allreduce_mb(g * dense, plan.gpus) * 2**20,
                         "state": (w + g + o) * (dense + plan.expert_params / plan.ep),
                         "cast": plan.cast(dense + plan.expert_params / plan.ep),
                         "fp32_residual": True}
    dp = data_parallel["sent"] + sent["replicas"] + sent["counts"]
    # the all-to-all's rows to peers in other nodes, when ep spans them (uniform routing)
    off_node = max(plan.ep - plan.per_node, 0) / (plan.ep - 1)
    return {**data_parallel, "sent": dp + sent["alltoall"],
            "network": dp + off_node * sent["alltoall"] if plan.gpus > plan.per_node else 0.0,
            "by_dim": {"ep": sent["alltoall"], "dp": dp},
            "mesh": f"dp {plan.gpus // plan.ep} x ep {plan.ep}",
            "crossover": planned_crossover(plan), "alltoall": sent["alltoall"],
            "tokens": sent["tokens"], "experts_data_parallel": sent["data_parallel"],
            "experts_replicas": sent["replicas"]}


def planned_ep_fsdp(plan: "PlanInput") -> dict:
    """The planner's EP x FSDP row (--fsdp): planned_ep with the dense part sharded."""
    return planned_ep(plan, fsdp=True)


def main():
    parser = moe_parser(__doc__)
    parser.add_argument("--ep", type=common.int_at_least(2), default=None,
                        help="ranks a layer's experts are spread over (default: the largest "
                             "that divides both the world and the experts); the world is then "
                             "dp = world/ep groups of them")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the dense part with FSDP2 over the world instead of "
                             "replicating it with DDP")
    add_long_run_flag(parser)
    args = parser.parse_args()
    world = common.launch_world_size()
    ep = choose_ep(parser, args, world)
    topo = common.setup(args)
    mesh = init_device_mesh(topo.device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    model, batches = common.workload(args, topo)
    blocks = common.transformer_blocks(model)
    routers = [block.mlp.gate for block in blocks]
    expert_params = shard_experts(blocks, mesh.get_group("ep"))
    dense = dense_bytes(model, blocks, expert_params, world, args.fsdp)
    wrapped = wrap_dense(model, blocks, expert_params, topo, args.fsdp)
    opt = adamw(wrapped, expert_params, lr=args.lr)
    rate = args.bias_rate if args.moe_balance == "bias" else 0.0
    loads, exchanged = [], []  # a step's tokens per expert, and rows each layer exchanged

    def after_step(*_):
        loads.append(balance_experts(routers, rate))
        exchanged.append([block.mlp.experts.exchanged for block in blocks])

    opt.register_step_post_hook(after_step)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(inputs, targets)
        loss.backward()
        reduce_expert_grads(expert_params, mesh.get_group("dp"), world)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(wrapped, opt))
    by_dim = comm_by_dim(stats)
    common.record(args, topo, stats, baseline="baseline_moe", model=model, optimizer=opt,
                  overlapped={**common.DDP_OVERLAP, **common.FSDP_OVERLAP},
                  comm_mb=stats.comm_mb,
                  # the model's, not this rank's: every ep rank holds as many experts as this one
                  params=sum(p.numel() for p in model.parameters()) + (ep - 1) * sum(
                      p.numel() for p in expert_params),
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], moe_balance=args.moe_balance,
                  ep=ep, mesh=[world // ep, ep], strategy="EP x FSDP" if args.fsdp else "EP",
                  alltoall_mb=by_dim["ep"], comm_mb_by_dim=by_dim,
                  **({} if common.dry_run() else load_figures(loads, args.warmup)),  # values
                  # exchanged[warmup - 1]: the step whose bytes the record counts
                  theory=ep_theory(args, ep, world, exchanged[args.warmup - 1], expert_params,
                                   routers, dense))


# The planner's rows, for MoE models only (its --experts; report/planner.py reads this, the
# script never does): EP, its dense part DDP's, then EP x FSDP (--fsdp).
PLANNED = [{"strategy": "EP", "place": 130, "figures": planned_ep, "expert_parallel": True},
           {"strategy": "EP x FSDP", "place": 140, "figures": planned_ep_fsdp,
            "expert_parallel": True}]


if __name__ == "__main__":
    common.run_main(main)
