"""Distributed Muon by hand: each rank orthogonalizes the whole matrices it owns, once, for all.

What it does: `DistributedMuon(model, blocks, lr=...)` is baseline_muon.py's optimizer (PyTorch's
Muon on the hidden matrices, AdamW on the rest) as ZeRO-1, as Moonlight's and DeepSpeed's
distributed Muon: each matrix has one owner, dealt out by Newton-Schulz FLOPs (the largest to
the least loaded rank), and the rest is cut into ZeRO-1's N even slices. The weights move into
one flat buffer of two regions, backward's gradients into a second laid out alike: the
matrices, rank r's back to back in the r-th of N equal slices (the largest owner's size); then
the rest. `step()` reduce-scatters each region: each rank receives the averaged gradient of
exactly the matrices it owns, whole, and of its slice of the rest. It runs torch.optim.Muon and
AdamW on those alone (their state exists for them alone) and all-gathers each region back into
every rank's weights. An all-gather of the new weights, not a broadcast per owner: the slices
are equal, so one collective moves each value once, (N-1)/N of the buffer a rank, as a ring.
Why it helps: the baseline's ranks all run Newton-Schulz on every matrix; here each runs about
1/N of the FLOPs, and Muon's and Adam's state fall by N, for the bytes of DDP's all-reduce (a
reduce-scatter plus an all-gather) and the slices' padding. The update is torch's own on the
same averaged gradient, so the losses are the baseline's to float rounding.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero1_muon.py --size small [--model llama]
Look for:   `make zero report`: speedup over baseline_muon; optimizer_ms against the baseline's
            (optimizer_parts_ms: the collectives and the update apart); theory.ns_gflop_rank
            (the busiest owner's) against theory.ns_gflop_all; equal losses.
Theory:     Newton-Schulz k(4m^2 n + 2m^3) FLOPs an m x n matrix (m <= n), the busiest rank its
            owned matrices'. Per rank b x F for weights and gradients (F: the flat buffer, P and
            its padding) + b a value of its matrices + 2b x its slice of the rest; sent a step
            2(N-1)/N x b x F (reduce-scatters and all-gathers), b = bytes a value.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

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
# Exact in fp32: the same update on the same gradient, averaged in another order at most.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


# Copied from 04_zero/baseline_muon.py: hidden_matrices
def hidden_matrices(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Parameter]:
    """Muon's parameters: every 2-D weight of the repeated blocks (attention's and the MLP's
    projections), in the model's order. The embeddings and the head are 2-D too but take AdamW:
    a row of an embedding is looked up, not multiplied, and the head's output is the loss's."""
    in_blocks = {p for block in blocks for p in block.parameters()}
    return [p for p in model.parameters() if p in in_blocks and p.ndim == 2]


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


@dataclass
class Region:
    """N equal slices of `per_rank` values from `offset` of a flat buffer, rank r's the r-th."""
    offset: int
    per_rank: int
    world: int

    def whole(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.world * self.per_rank]

    def owned(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        start = self.offset + rank * self.per_rank
        return flat[start:start + self.per_rank]


def flatten_by_owner(owned: list[list[nn.Parameter]], rest: list[nn.Parameter]
                     ) -> tuple[torch.Tensor, torch.Tensor, Region, Region]:
    """Move every parameter into one flat buffer of two regions, and its gradient into a second
    laid out alike (each `p` and `p.grad` becomes a view): the matrices, rank r's back to back
    in the r-th of N slices as large as the largest owner's values; then the rest back to back,
    padded to N's multiple, rank r owning the r-th 1/N (ZeRO-1's slices: an embedding is too
    large to give one rank whole). Returns both buffers and the two regions."""
    world = len(owned)
    matrices = Region(0, max(sum(p.numel() for p in params) for params in owned), world)
    others = Region(world * matrices.per_rank, -(-sum(p.numel() for p in rest) // world), world)
    first = owned[0][0]
    flat_params = torch.zeros(others.offset + world * others.per_rank, dtype=first.dtype,
                              device=first.device)
    flat_grads = torch.zeros_like(flat_params)
    starts = [(matrices.offset + rank * matrices.per_rank, params)
              for rank, params in enumerate(owned)] + [(others.offset, rest)]
    for offset, params in starts:
        for p in params:
            view = slice(offset, offset + p.numel())
            flat_params[view].copy_(p.detach().flatten())
            p.data = flat_params[view].view_as(p)
            p.grad = flat_grads[view].view_as(p)
            offset += p.numel()
    return flat_params, flat_grads, matrices, others


class DistributedMuon:
    """baseline_muon's optimizer (torch.optim.Muon on `matrices`, default the blocks' 2-D
    weights, AdamW on every other parameter of `model`), each matrix's update computed by one
    owner and AdamW's as ZeRO-1's: `zero_grad()`, one or more `loss.backward()`, `step()`.
    Every collective runs on `group` (default: the world), and every rank starts from the
    group's first rank's weights. The gradients live in a flat buffer: `zero_grad()` zeroes it
    in place, and a gradient that backward made anew (after `model.zero_grad()`) is moved back
    into it."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None,
                 matrices: list[nn.Parameter] | None = None):
        matrices = hidden_matrices(model, blocks) if matrices is None else matrices
        names = {p: name for name, p in model.named_parameters()}
        for p in matrices:
            if p.ndim != 2:
                raise ValueError(f"{names.get(p, 'a parameter')} has shape {tuple(p.shape)}: "
                                 "Muon orthogonalizes matrices; give it only 2-D weights")
        self.group, self.rank = group, dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.owned = deal_out(matrices, self.world)
        rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
        self.flat_params, self.flat_grads, self.matrix_region, self.rest_region = \
            flatten_by_owner(self.owned, rest)
        self.grad_views = {p: p.grad for p in model.parameters()}
        dist.broadcast(self.flat_params, dist.get_global_rank(group or dist.group.WORLD, 0),
                       group=group)  # start alike, as DDP
        self.muon = torch.optim.Muon(self.owned[self.rank], lr=lr, **MUON)
        rest_shard = nn.Parameter(self.rest_region.owned(self.flat_params, self.rank))
        rest_shard.grad = self.rest_region.owned(self.flat_grads, self.rank)
        self.adamw = torch.optim.AdamW([rest_shard], lr=lr, weight_decay=MUON["weight_decay"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        for p in self.grad_views:
            p.register_post_accumulate_grad_hook(self.keep_grad_in_flat_buffer)

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def keep_grad_in_flat_buffer(self, p: nn.Parameter) -> None:
        view = self.grad_views[p]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat_grads.zero_()

    def step(self) -> None:
        self.reduce_scatter_gradients()
        self.update_owned()
        self.all_gather_weights()

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """Each rank's slices: the mean over ranks of the gradients of the matrices it owns,
        whole, and of its 1/N of the rest."""
        for region in (self.matrix_region, self.rest_region):
            mine = region.owned(self.flat_grads, self.rank)
            common.reduce_scatter(mine, region.whole(self.flat_grads), self.group)
            mine.div_(self.world)

    @torch.no_grad()
    def update_owned(self) -> None:
        self.muon.step()  # Newton-Schulz on the matrices this rank owns, and no others
        self.adamw.step()

    @torch.no_grad()
    def all_gather_weights(self) -> None:
        for region in (self.matrix_region, self.rest_region):
            common.all_gather_single(region.whole(self.flat_params),
                                     region.owned(self.flat_params, self.rank), group=self.group)


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


def theory(opt: DistributedMuon) -> dict:
    """In MB: the flat weights and gradients (both regions, on every rank); Muon's momentum for
    the matrices a rank owns and Adam's two moments for its 1/N of the rest (this rank's in
    optim_mb, each rank's in optim_mb_by_rank, the busiest's in state_mb, as the record's);
    sent, each region's reduce-scatter and all-gather. The Newton-Schulz GFLOP the busiest
    owner runs, beside every matrix's (what each baseline rank runs)."""
    b, mb, n = opt.flat_params.element_size(), 2**20, opt.world
    flat = b * opt.flat_params.numel()
    optim = [b * (sum(p.numel() for p in params) + 2 * opt.rest_region.per_rank)
             for params in opt.owned]
    ns = [sum(newton_schulz_flops(p.shape, MUON["ns_steps"]) for p in params)
          for params in opt.owned]
    values = sum(p.numel() for p in opt.grad_views)
    return {"params_mb": flat / mb, "grads_mb": flat / mb, "optim_mb": optim[opt.rank] / mb,
            "optim_mb_by_rank": [round(o / mb, 3) for o in optim],
            "state_mb": (2 * flat + max(optim)) / mb, "comm_mb": 2 * (n - 1) / n * flat / mb,
            "padding_mb": (flat - b * values) / mb,
            "ns_gflop_rank": max(ns) / 1e9, "ns_gflop_all": sum(ns) / 1e9,
            "ns_gflop_by_rank": [round(f / 1e9, 3) for f in ns]}


def planned_zero1_muon(plan: "PlanInput") -> dict[str, float] | None:
    """The planner's ZeRO-1 + Muon row: weights and gradients whole, Muon's and AdamW's state
    1/N, the gradients reduce-scattered and the weights all-gathered (the slices' padding left
    out), and 1/N of the Newton-Schulz FLOPs a GPU."""
    if plan.experts:
        return None
    w, g, o = plan.state_bytes
    shapes = planned_matrix_shapes(plan)
    matrices = sum(m * n for m, n in shapes)
    optim = o / 2 * matrices + o * (plan.params - matrices)
    return {"state": (w + g) * plan.params + optim / plan.gpus,
            "sent": (plan.gpus - 1) / plan.gpus * (g + w) * plan.params,
            "cast": plan.cast(plan.params), "fp32_residual": True,
            "optimizer_flops": sum(newton_schulz_flops(s, MUON["ns_steps"])
                                   for s in shapes) / plan.gpus}


def main():
    parser = common.parser(__doc__, skips=SKIPS)
    parser.set_defaults(steps=10)  # the optimizer is most of a step: fewer steps fit make zero
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    try:
        opt = DistributedMuon(model, common.transformer_blocks(model), lr=args.lr)
    except ValueError as bad:  # a world its matrices cannot fill: the launch's
        raise common.SetupError(str(bad)) from bad
    parts = {"reduce_scatter": [], "update": [], "all_gather": []}  # opt.step()'s, timed apart

    def train_step(inputs, targets):
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        timed(opt.reduce_scatter_gradients, topo.device, parts["reduce_scatter"])
        timed(opt.update_owned, topo.device, parts["update"])
        timed(opt.all_gather_weights, topo.device, parts["all_gather"])
        return loss

    stats = common.timed_steps(train_step, batches, args, topo,
                               memory_of=(model, opt.muon, opt.adamw))
    common.record(args, topo, stats, baseline="baseline_muon", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, theory=theory(opt),
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  optimizer_ms=optimizer_ms([sum(t) for t in zip(*parts.values(), strict=True)],
                                            args),
                  optimizer_parts_ms={part: optimizer_ms(t, args) for part, t in parts.items()},
                  **common.state_split_mb(model, opt))


# The planner's rows (report/planner.py reads this; the script never does), with --muon only.
PLANNED = [{"strategy": "ZeRO-1 + Muon", "place": 22, "figures": planned_zero1_muon,
            "muon": True}]


if __name__ == "__main__":
    common.run_main(main)
