"""Muon on FSDP2's shards: each matrix's gradient gathered to its owner only, orthogonalized there.

What it does: FSDP2 (`fully_shard` on each block, then on the model) keeps each weight as a
`Shard(0)` DTensor, a slice of its rows a rank, and leaves backward's averaged gradients so.
Newton-Schulz needs each matrix whole, so `ShardedMuon(model, blocks, lr=...)` gives every
hidden matrix one owner (dealt out by Newton-Schulz FLOPs, as optimized_zero1_muon.py) and
`step()` runs: (1) one all-to-all, each rank sending its rows of every gradient to that
matrix's owner (its own rows stay); (2) on the owner, Muon's update of the whole matrix, written
out here as torch.optim.Muon computes it (Nesterov momentum, five Newton-Schulz iterations in
bf16, Moonlight's learning-rate scale); (3) a second all-to-all, the bf16 update's rows back to
the ranks that hold them; (4) on every rank, decoupled weight decay and the update on its own
rows. AdamW runs on the other parameters' shards, as under FSDP2 alone.
Why it helps: an all-gather of every gradient to everyone would move N - 1 copies of each
matrix a rank and leave each rank to repeat the others' Newton-Schulz; the all-to-all moves
each row once, to the one rank that needs it, and each rank orthogonalizes ~1/N of the FLOPs.
Momentum is kept for the owned matrices only, whole. The losses are baseline_muon's.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_fsdp_muon.py --size small [--model llama]
Look for:   comm_mb = theory.comm_mb, split in theory as FSDP2's gathers and reduce-scatters
            plus Muon's two all-to-alls; optimizer_ms against baseline_muon's; equal losses.
Theory:     Muon's bytes a rank r: sent b x (rows r holds of the matrices others own) x their
            width, then 2 bytes x (the rows others hold of the matrices r owns) x their width
            (the bf16 update); FSDP2's (N-1)/N x b x (2 x the blocks' + the root's values)
            gathered and (N-1)/N x bP reduce-scattered. State: bP/N x 3 (weights, gradients,
            Adam's moments of the rest's share) + b x the owned matrices' values (momentum).
"""

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Muon's settings in every script of the folder: AdamW's learning rate for both (Muon's update
# scaled to AdamW's RMS, Moonlight's rule) and Moonlight's weight decay, 0.1, for both.
MUON = {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1, "ns_steps": 5}
SKIPS = {"resnet": "Muon orthogonalizes a decoder's hidden matrices; a ResNet's are "
                   "convolutions: run --model gpt or llama",
         "moe": "an expert no token reached has no gradient, which torch.optim.Muon skips and a "
                "flat gradient buffer cannot tell from a zero one: run --model gpt or llama"}
# torch.optim.Muon's defaults (torch/optim/_muon.py): Keller Jordan's quintic coefficients
NS_COEFFICIENTS, NS_EPS, MOMENTUM = (3.4445, -4.7750, 2.0315), 1e-7, 0.95
# Exact in fp32: the same update on the same gradient, averaged in another order at most.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


# Copied from 04_zero/baseline_muon.py: hidden_matrices
def hidden_matrices(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Parameter]:
    """Muon's parameters: every 2-D weight of the repeated blocks (attention's and the MLP's
    projections), in the model's order. The embeddings and the head are 2-D too but take AdamW:
    a row of an embedding is looked up, not multiplied, and the head's output is the loss's."""
    in_blocks = {p for block in blocks for p in block.parameters()}
    return [p for p in model.parameters() if p in in_blocks and p.ndim == 2]


# Copied from 04_zero/optimized_zero1_muon.py: deal_out
def deal_out(matrices: list[nn.Parameter], world: int) -> list[list[nn.Parameter]]:
    """Each rank's matrices, dealt out by Newton-Schulz FLOPs: each to the rank with the least
    so far, largest first, lowest rank on a tie (longest-processing-time-first: the busiest rank
    has at most 4/3 of the best split's load). Each rank's list keeps the given order."""
    if world > len(matrices):
        raise ValueError(f"{len(matrices)} Muon matrices for {world} ranks: a rank would own "
                         f"none; run at most {len(matrices)} ranks")
    flops, owner = [0.0] * world, {}
    for p in sorted(matrices, key=lambda p: -newton_schulz_flops(p.shape, MUON["ns_steps"])):
        rank = min(range(world), key=lambda r: (flops[r], r))
        owner[p] = rank
        flops[rank] += newton_schulz_flops(p.shape, MUON["ns_steps"])
    return [[p for p in matrices if owner[p] == rank] for rank in range(world)]


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `x`, roughly (singular values near 1, not at it):
    torch.optim.Muon's quintic iteration, op for op, so that the bits are its. In bf16, on the
    short side (X X^T is then the small Gram matrix), scaled first to spectral norm <= 1."""
    a, b, c = NS_COEFFICIENTS
    tall = x.size(0) > x.size(1)
    y = x.bfloat16().T if tall else x.bfloat16()
    y = y.div_(y.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def muon_lr(lr: float, shape: torch.Size) -> float:
    """Moonlight's scale (adjust_lr_fn "match_rms_adamw"): an update of AdamW's RMS."""
    return lr * 0.2 * max(shape[0], shape[1]) ** 0.5


def row_counts(rows: int, world: int) -> list[int]:
    """The rows each rank's Shard(0) holds: torch.chunk's split, ceil(rows / N) each from rank
    0 on, the last ones short or empty (FSDP2 pads the rest internally, not in the shard)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


class ShardedMuon:
    """baseline_muon's optimizer on a `fully_shard`ed model: Muon on `matrices` (default the
    blocks' 2-D weights) by owners, AdamW on the other parameters' shards. `zero_grad()`,
    `loss.backward()`, `step()`; every collective on `group` (default: the world), the group
    FSDP2's mesh was made from. `param_groups` and `state` are both halves' (what common counts)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None,
                 matrices: list[nn.Parameter] | None = None):
        matrices = hidden_matrices(model, blocks) if matrices is None else matrices
        names = {p: name for name, p in model.named_parameters()}
        for p in matrices:
            if p.ndim != 2:
                raise ValueError(f"{names.get(p, 'a parameter')} has shape {tuple(p.shape)}: "
                                 "Muon orthogonalizes matrices; give it only 2-D weights")
        self.lr, self.group = lr, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.matrices = matrices
        self.owner = {p: r for r, owned in enumerate(deal_out(matrices, self.world)) for p in owned}
        self.mine = [p for p in matrices if self.owner[p] == self.rank]
        self.momentum = {p: torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device)
                         for p in self.mine}  # whole, for the owned matrices only
        self.adamw = torch.optim.AdamW([p for p in model.parameters()
                                        if all(p is not q for q in matrices)],
                                       lr=lr, weight_decay=MUON["weight_decay"])
        self.param_groups = [{"params": matrices}] + self.adamw.param_groups

    @property
    def state(self) -> dict:
        return {**{p: {"momentum_buffer": m} for p, m in self.momentum.items()},
                **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        for p in self.matrices:
            p.grad = None

    def rows_of(self, p: nn.Parameter, rank: int) -> int:
        return row_counts(p.shape[0], self.world)[rank] * p.shape[1]  # values

    def exchange(self, pieces: list[list[torch.Tensor]], receive: list[int],
                 dtype: torch.dtype) -> list[torch.Tensor]:
        """One all-to-all: `pieces[r]` (flattened, back to back) to rank r, `receive[r]` values
        from it; nothing to or from this rank itself. Returns what came from each rank."""
        device = self.matrices[0].to_local().device
        sends = [torch.cat([t.flatten() for t in ts]) if ts else torch.empty(0, device=device)
                 for ts in pieces]
        out = torch.empty(sum(receive), dtype=dtype, device=device)
        dist.all_to_all_single(out, torch.cat(sends).to(dtype), receive, [s.numel() for s in sends],
                               group=self.group)
        return list(out.split(receive))

    def update(self, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """torch.optim.Muon's update of one whole matrix from its whole gradient, in bf16."""
        momentum = self.momentum[p]
        momentum.lerp_(grad, 1 - MOMENTUM)
        return newton_schulz(grad.lerp(momentum, MOMENTUM), MUON["ns_steps"])

    @torch.no_grad()
    def step(self) -> None:
        me, others = self.rank, [r for r in range(self.world) if r != self.rank]
        # (1) each gradient's rows to its owner, all in one all-to-all
        to_owner = [[p.grad.to_local() for p in self.matrices if self.owner[p] == r]
                    if r != me else [] for r in range(self.world)]
        came = self.exchange(to_owner, [sum(self.rows_of(p, r) for p in self.mine)
                                        if r != me else 0 for r in range(self.world)],
                             self.matrices[0].dtype)
        # (2) the owner's updates, each matrix whole: its rows in rank order
        offsets, updates = dict.fromkeys(others, 0), {}
        for p in self.mine:
            rows = []
            for r in range(self.world):
                if r == me:
                    rows.append(p.grad.to_local())
                else:
                    rows.append(came[r][offsets[r]:offsets[r] + self.rows_of(p, r)]
                                .view(-1, p.shape[1]))
                    offsets[r] += self.rows_of(p, r)
            updates[p] = self.update(p, torch.cat(rows))
        # (3) each update's rows back to the rank that holds them, in bf16 as computed
        splits = {p: u.split(row_counts(p.shape[0], self.world)) for p, u in updates.items()}
        back = self.exchange([[splits[p][r] for p in self.mine] if r != me else []
                              for r in range(self.world)],
                             [sum(self.rows_of(p, me) for p in self.matrices if self.owner[p] == r)
                              if r != me else 0 for r in range(self.world)], torch.bfloat16)
        # (4) on every rank, its own rows: decoupled weight decay, then the update
        offsets = dict.fromkeys(others, 0)
        for p in self.matrices:
            owner = self.owner[p]
            if owner == me:
                mine = splits[p][me]
            else:
                mine = back[owner][offsets[owner]:offsets[owner] + self.rows_of(p, me)]
                offsets[owner] += self.rows_of(p, me)
            local = p.to_local()
            local.mul_(1 - self.lr * MUON["weight_decay"])
            local.add_(mine.view_as(local), alpha=-muon_lr(self.lr, p.shape))
        self.adamw.step()


# Copied from 03_fsdp/optimized_fsdp.py: same_weights_on_every_rank
def same_weights_on_every_rank(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every rank of the mesh starts from the mesh's first rank's parameters and buffers, as DDP
    does: fully_shard keeps each rank's slice of that rank's own copy, so ranks seeded apart
    would train a patchwork of initializations. Dim by dim: after dim 0 each rank holds its
    dim-0 group's first rank's tensors, after the last every rank holds the mesh's first's."""
    tensors = [*model.parameters(), *model.buffers()]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        for t in tensors:
            dist.broadcast(t.detach(), dist.get_global_rank(group, 0), group=group)


# Copied from 04_zero/baseline_muon.py: timed
def timed(step, device: torch.device, seconds: list[float]) -> None:
    """Run `step()` and append its seconds, the device synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds.append(time.perf_counter() - start)

# Copied from 04_zero/baseline_muon.py: optimizer_ms
def optimizer_ms(seconds: list[float], args) -> float | None:
    """The timed steps' median optimizer time in ms (`timed`'s seconds); none for a dry run,
    whose fake tensors take no real time."""
    if common.dry_run():
        return None
    return round(common.summarize_times(common.of_timed_steps(seconds, args))[0], 3)



# Copied from 04_zero/baseline_muon.py: newton_schulz_flops
def newton_schulz_flops(shape: torch.Size | tuple[int, int], steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a matrix of `shape`, on its shorter
    side m (n the longer): A = XX^T (2m^2 n), B = bA + cA^2 (2m^3), X <- aX + BX (2m^2 n)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


# Copied from 04_zero/baseline_muon.py: planned_matrix_shapes
def planned_matrix_shapes(plan: "PlanInput") -> list[tuple[int, int]]:
    """The planner's decoder's hidden matrices: a layer's q and o (h x h), k and v (the KV width
    x h) and as many MLP matrices (ffn x h) as its blocks' parameters hold (a GPT's 2, a
    Llama's 3). A GPT's fused qkv counts as three: Newton-Schulz costs it 14h^3 FLOPs a step
    where the three cost 18h^3, within what the planner prices."""
    h, kv = plan.hidden, plan.kv_width or plan.hidden
    attention = [(h, h), (kv, h), (kv, h), (h, h)]
    mlp = round((plan.blocks / plan.layers - 2 * h * h - 2 * kv * h) / (plan.ffn * h))
    return (attention + [(plan.ffn, h)] * mlp) * plan.layers


# Copied from 04_zero/optimized_zero3.py: zero3_bytes
def zero3_bytes(params: float, blocks: list[float], root: float, world: int, weight: float,
                grad: float, optim: float, gather: float, buffer_bytes: float = 0.0,
                reduce: float | None = None) -> dict[str, float]:
    """ZeRO-3's bytes a rank, from value counts: weights, gradients and the optimizer's state
    1/N each (`weight`, `grad`, `optim` bytes a value). Sent a step: each block's values
    (`blocks`) all-gathered twice, `gather` bytes a value (the compute dtype), the `root`'s once
    (kept gathered from forward to backward), every value reduce-scattered once, `reduce` bytes
    (default `grad`), (N-1)/N of each, and the buffers' broadcast. Held in full at once
    (`gathered`, beyond the shards): at most the root and two neighbouring blocks. The planner's
    figures are FSDP full's (03_fsdp/optimized_fsdp.py's fsdp_bytes), yet the two stay apart:
    each counts its own implementation's padding, here the flat buckets' (under N values a
    bucket)."""
    share = (world - 1) / world
    kept = {"params": weight * params / world, "grads": grad * params / world,
            "optim": optim * params / world}
    two_blocks = max((a + b for a, b in zip(blocks, blocks[1:], strict=False)), default=sum(blocks))
    reduce = grad if reduce is None else reduce
    sent = share * ((2 * gather + reduce) * sum(blocks) + (gather + reduce) * root + buffer_bytes)
    return {**kept, "state": sum(kept.values()), "sent": sent,
            "gathered": gather * (root + two_blocks)}


def theory(model: nn.Module, blocks: list[nn.Module], opt: ShardedMuon, gather: int) -> dict:
    """In MB: FSDP2's shards of the weights and gradients (a rank's rows of each, as chunked),
    Adam's moments of the rest's shards and Muon's momentum of the owned matrices, whole (this
    rank's, and the busiest rank's state as the record's); sent by this rank, FSDP2's
    all-gathers in `gather` bytes a value (the blocks twice, the root once: it stays gathered)
    and reduce-scatter of the rows padded to a multiple of N, and Muon's two all-to-alls. The
    Newton-Schulz GFLOP of the busiest owner and of all."""
    b, n, me, mb = next(model.parameters()).element_size(), opt.world, opt.rank, 2**20
    params = list(model.parameters())

    def rows(p: nn.Parameter, r: int) -> int:  # rank r's values of p
        return row_counts(p.shape[0], n)[r] * p.shape[1:].numel()

    def padded(p: nn.Parameter) -> int:  # FSDP2 moves each tensor's rows padded to N's multiple
        return -(-p.shape[0] // n) * n * p.shape[1:].numel()

    local = [sum(rows(p, r) for p in params) for r in range(n)]
    optim = [b * (2 * sum(rows(p, r) for p in params if all(p is not q for q in opt.matrices))
                  + sum(p.numel() for p in opt.matrices if opt.owner[p] == r))
             for r in range(n)]
    block_values = sum(padded(p) for block in blocks for p in block.parameters())
    total = sum(padded(p) for p in params)
    share = (n - 1) / n
    fsdp = share * gather * (2 * block_values + (total - block_values)) + share * b * total
    to_owners = b * sum(opt.rows_of(p, me) for p in opt.matrices if opt.owner[p] != me)
    back = 2 * sum(p.numel() - opt.rows_of(p, me) for p in opt.mine)  # bf16 updates
    ns = [sum(newton_schulz_flops(p.shape, MUON["ns_steps"]) for p in opt.matrices
              if opt.owner[p] == r) for r in range(n)]
    return {"params_mb": b * local[me] / mb, "grads_mb": b * local[me] / mb,
            "optim_mb": optim[me] / mb,
            "state_mb": max(2 * b * local[r] + optim[r] for r in range(n)) / mb,
            "comm_mb": (fsdp + to_owners + back) / mb,
            "fsdp_comm_mb": fsdp / mb, "muon_comm_mb": (to_owners + back) / mb,
            "allgather_comm_mb_avoided": share * b * sum(p.numel() for p in opt.matrices) / mb,
            "ns_gflop_rank": max(ns) / 1e9, "ns_gflop_all": sum(ns) / 1e9,
            "ns_gflop_by_rank": [round(f / 1e9, 3) for f in ns]}


def planned_fsdp_muon(plan: "PlanInput") -> dict[str, float] | None:
    """The planner's FSDP + Muon row: ZeRO-3's (FSDP full's) shards, Muon's state for the owned
    matrices and AdamW's for the rest's shards (1/N of each), FSDP's bytes, and Muon's two
    all-to-alls: (N-1)/N of a GPU's 1/N of the matrices' rows out in the gradients' dtype, as
    many back in bf16; 1/N of the Newton-Schulz FLOPs a GPU."""
    if plan.experts:
        return None
    w, g, o = plan.state_bytes
    shapes = planned_matrix_shapes(plan)
    matrices = sum(m * n for m, n in shapes)
    optim = (o / 2 * matrices + o * (plan.params - matrices)) / plan.params  # a value's, on average
    predicted = zero3_bytes(plan.params, [plan.blocks / plan.layers] * plan.layers,
                            plan.embedding + plan.head, plan.gpus, w, g, optim,
                            plan.compute_bytes, reduce=4)
    to_owners_and_back = (plan.gpus - 1) / plan.gpus ** 2 * matrices * (4 + 2)
    return {"state": predicted["state"], "sent": predicted["sent"] + to_owners_and_back,
            "gathered": predicted["gathered"],
            "optimizer_flops": sum(newton_schulz_flops(s, MUON["ns_steps"])
                                   for s in shapes) / plan.gpus}


def main():
    parser = common.parser(__doc__, skips=SKIPS)
    parser.set_defaults(steps=10)  # the optimizer is most of a step: fewer steps fit make zero
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    blocks = common.transformer_blocks(model)
    mesh = DeviceMesh.from_group(dist.group.WORLD, topo.device.type)
    same_weights_on_every_rank(model, mesh)
    # under bf16 autocast (GPU) gathered in bf16 and reduced in fp32, as 03_fsdp's FSDP
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.dtype == "bf16" else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    try:
        opt = ShardedMuon(model, blocks, lr=args.lr)
    except ValueError as bad:  # a world its matrices cannot fill: the launch's
        raise common.SetupError(str(bad)) from bad
    optimizer_seconds = []

    def train_step(inputs, targets):
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        timed(opt.step, topo.device, optimizer_seconds)
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt.adamw))
    common.record(args, topo, stats, baseline="baseline_muon", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP, comm_mb=stats.comm_mb,
                  theory=theory(model, blocks, opt, 2 if args.dtype == "bf16" else 4),
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  optimizer_ms=optimizer_ms(optimizer_seconds, args),
                  **common.state_split_mb(model, opt))


# The planner's rows (report/planner.py reads this; the script never does), with --muon only.
PLANNED = [{"strategy": "FSDP + Muon", "place": 52, "figures": planned_fsdp_muon, "muon": True}]


if __name__ == "__main__":
    common.run_main(main)
