"""ZeRO-1 by hand: each rank keeps AdamW's state for 1/N of the parameters and updates only those.

What it does: `ZeRO1(model, blocks, lr=...)` is an AdamW with the optimizer's contract
(`zero_grad()`, backward once or several times, `step()`). It moves the parameters into one flat
buffer in their own dtype, cut into buckets (one per block, last block first, then one for the
rest: the order in which backward makes their gradients ready), each padded to a multiple of
the group's size N; rank r owns the r-th 1/N of every bucket. Gradients accumulate into a
second flat buffer laid out the same way. `step()` reduce-scatters each bucket's gradient (every
rank receives the sum over ranks of the slice it owns; common.reduce_scatter: on gloo an
all_to_all and a local sum), runs AdamW on the owned slices only (no fp32 master copy: the
moments are in the parameters' dtype, as in the baseline) and all-gathers them back into every
rank's parameters, overlapped with the next forward. Every collective runs on `group`; the
weights and buffers start as the group's first rank's, and buffers (BatchNorm's) are broadcast
before each forward, as DDP does. --clip-grad-norm clips by the global norm: the all-reduced
sum of each rank's squares over the values it owns, padding left out, so each counts once.
Why it helps: Adam's moments are 8 of the 16 bytes per fp32 parameter a replicated trainer
holds; sharding them saves 8(N-1)/N bytes per parameter on each rank for no extra
communication, since a reduce-scatter plus an all-gather move what one all-reduce moves.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero1.py --size small [--model llama]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, tokens/s close to it; optim_mb falls by N, params and grads do not.
Theory:     per rank bP + bP + 2bP/N bytes (params, grads, optimizer), P = parameter count,
            b = bytes per value of their dtype (4 in fp32), plus each bucket's padding (under N
            values); sent per step (N-1)/N x bP reduce-scattered plus the same all-gathered:
            2(N-1)/N x bP, as DDP's all-reduce (plus the buffers' broadcast, if any).
"""

import argparse
import sys
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

# Exact in fp32: the same sums, in another order at most. Under bf16 autocast (GPU) such
# last-bit differences grow through the low-precision steps, as for FSDP in 03_fsdp.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


def units_in_gradient_order(model: nn.Module, blocks: list[nn.Module]
                            ) -> list[list[nn.Parameter]]:
    """The parameters grouped by block, in the order backward completes their gradients: the
    last block first, then the root unit, every parameter of the model in no block (embeddings,
    final norm, head: a tied embedding's gradient is only complete when backward reaches the
    input). Each parameter once, by identity."""
    units, seen = [], set()
    for block in reversed(blocks):
        unit = list(block.parameters())
        if seen & set(unit):
            raise ValueError(f"a parameter of {type(block).__name__} is in another block too: "
                             "pass blocks that share no weights")
        seen.update(unit)
        units.append(unit)
    return units + [[p for p in model.parameters() if p not in seen]]


@dataclass
class Bucket:
    """Parameters laid out one after another at [offset, offset + numel) of the model's flat
    layout; numel is padded to a multiple of the world size so every rank owns an equal slice."""
    params: list[nn.Parameter]
    offset: int
    numel: int

    def whole(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.numel]

    def owned(self, flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s slice of this bucket in a flat buffer of the whole model."""
        start = self.offset + rank * self.numel // world
        return flat[start:start + self.numel // world]


def partition(units: list[list[nn.Parameter]], world: int) -> list[Bucket]:
    """One bucket per unit, back to back: rank r owns the r-th 1/N of every bucket."""
    buckets, offset = [], 0
    for params in units:
        numel = -(-sum(p.numel() for p in params) // world) * world  # rounded up to N
        buckets.append(Bucket(params, offset, numel))
        offset += numel
    return buckets


def flat_dtype(buckets: list[Bucket]) -> torch.dtype:
    """The one dtype of the parameters, which the flat buffers keep (a bf16 model stays bf16)."""
    dtypes = {p.dtype for bucket in buckets for p in bucket.params}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of several dtypes ({sorted(map(str, dtypes))}): cast the "
                         "model to one dtype before sharding it")
    return dtypes.pop()


def flatten(buckets: list[Bucket]) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the parameters into one flat buffer and their gradients into another, in the
    parameters' dtype and device: each `p` and `p.grad` becomes a view, so backward accumulates
    straight into the flat gradients and an update of a flat slice updates the parameters."""
    total = buckets[-1].offset + buckets[-1].numel
    device = buckets[0].params[0].device
    flat_params = torch.zeros(total, dtype=flat_dtype(buckets), device=device)
    flat_grads = torch.zeros_like(flat_params)
    for bucket in buckets:
        offset = bucket.offset
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat_params[view].copy_(p.detach().flatten())
            p.data = flat_params[view].view_as(p)
            p.grad = flat_grads[view].view_as(p)
            offset += p.numel()
    return flat_params, flat_grads


def first_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's first member: the source of every broadcast."""
    return dist.get_global_rank(group or dist.group.WORLD, 0)


def broadcast_buffers(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank's buffers (BatchNorm's running statistics) set to the group's first rank's,
    one broadcast per dtype, as DDP does before each forward (broadcast_buffers=True)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.detach().flatten() for b in buffers])
        dist.broadcast(flat, first_rank(group), group=group)
        for b, value in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
            b.detach().copy_(value.view_as(b))


def owned_shards(buckets: list[Bucket], flat_params: torch.Tensor, flat_grads: torch.Tensor,
                 rank: int, world: int) -> list[nn.Parameter]:
    """The slices rank `rank` owns, one per bucket, as the parameters AdamW updates: views, so
    an update lands in the flat parameters, and AdamW's moments exist for 1/N of the model.
    Their gradients: the same slices of the flat gradients, where the reduce-scatter leaves
    them."""
    shards = []
    for bucket in buckets:
        shard = nn.Parameter(bucket.owned(flat_params, rank, world))
        shard.grad = bucket.owned(flat_grads, rank, world)
        shards.append(shard)
    return shards


def owned_grads(buckets: list[Bucket], shards: list[nn.Parameter], rank: int
                ) -> list[torch.Tensor]:
    """The gradient values this rank owns, without the padding: one slice per bucket, cut where
    the bucket's parameters end (its padding lies at its end, in the last ranks' slices)."""
    grads = []
    for bucket, shard in zip(buckets, shards, strict=True):
        values = sum(p.numel() for p in bucket.params) - rank * shard.numel()  # from the slice on
        grads.append(shard.grad[:max(0, values)])
    return grads


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's `grads` together: the global 2-norm is
    the square root of the ranks' sums of squares (one fp32 all-reduce), which counts each value
    of the gradient exactly once when each rank passes only the values it owns; every rank then
    scales its values by min(1, max_norm / (norm + 1e-6)), torch's formula. Returns the norm."""
    squares = torch.stack([g.float().square().sum() for g in grads]).sum()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm


class ParamGatherer:
    """All-gathers every rank's updated slices into every rank's parameters, overlapped with the
    next forward (Megatron-LM's distributed optimizer does the same: --overlap-param-gather).
    `start`, after the step, launches every bucket's all-gather in the order forward uses them;
    a hook before each block (before the model, for the root unit) waits for that block's
    bucket only. In place: each rank's input is its own slice of the output. (On GPU, timed
    with the device synchronised after each step, the all-gathers finish inside the step.)"""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], buckets: list[Bucket],
                 flat_params: torch.Tensor, group: dist.ProcessGroup | None):
        self.buckets, self.flat_params, self.group = buckets, flat_params, group
        self.pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather in flight
        root, last = len(buckets) - 1, len(blocks) - 1
        model.register_forward_pre_hook(lambda *_: self.wait(root))
        for j, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, i=last - j: self.wait(i))

    def start(self) -> None:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        for i in reversed(range(len(self.buckets))):  # the root's first: forward's order
            bucket = self.buckets[i]
            self.pending[i] = common.all_gather_single(
                bucket.whole(self.flat_params), bucket.owned(self.flat_params, rank, world),
                group=self.group, async_op=True)

    def wait(self, i: int) -> None:
        """Bucket i's parameters are up to date when this returns."""
        if i in self.pending:
            self.pending.pop(i).wait()

    def wait_all(self) -> None:
        for i in list(self.pending):
            self.wait(i)


def reduce_scatter_grads(buckets: list[Bucket], flat_grads: torch.Tensor,
                         group: dist.ProcessGroup | None) -> None:
    """Sum each bucket's gradient over ranks into the slice this rank owns, in place (the output
    is the input's own slice, which NCCL and gloo both allow; the rest is stale after), then
    average that slice: 1/N of the work of dividing the whole gradient first, as DDP does."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    owned = [b.owned(flat_grads, rank, world) for b in buckets]
    works = [common.reduce_scatter(mine, b.whole(flat_grads), group, async_op=True)
             for mine, b in zip(owned, buckets, strict=True)]
    for work, mine in zip(works, owned, strict=True):
        work.wait()
        mine.div_(world)


class ZeRO1(torch.optim.AdamW):
    """AdamW over the slices this rank owns, with the optimizer's contract: `zero_grad()`, one
    or more `loss.backward()` (the gradients accumulate), `step()`. `blocks`: the model's
    repeated modules in forward order (e.g. common.transformer_blocks(model)); every other
    parameter forms the root unit. Every collective runs on `group` (default: the world). The
    parameters keep their dtype; no fp32 master copy is kept.

    The model's gradients are views into one flat buffer: `zero_grad()` zeroes it in place (so
    `set_to_none` is ignored), and a gradient the user dropped or replaced (`model.zero_grad()`
    sets them to None) is moved back into the buffer after backward, so it still counts. A
    backward after `step()` without this object's `zero_grad()` raises: step() leaves the flat
    gradients reduce-scattered, not fit to add to. After the last `step()`, call
    `wait_for_params()` before reading the weights outside forward."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None, max_grad_norm: float | None = None,
                 **adamw):
        self.group, self.max_grad_norm = group, max_grad_norm
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.needs_zero_grad = False  # step() ran since zero_grad()
        self.buckets = partition(units_in_gradient_order(model, blocks), world)
        self.flat_params, self.flat_grads = flatten(self.buckets)
        self.grad_views = {p: p.grad for bucket in self.buckets for p in bucket.params}
        dist.broadcast(self.flat_params, first_rank(group), group=group)  # start alike, as DDP
        if list(model.buffers()):
            broadcast_buffers(model, group)
            model.register_forward_pre_hook(lambda *_: broadcast_buffers(model, group))
        self.shards = owned_shards(self.buckets, self.flat_params, self.flat_grads, self.rank,
                                   world)
        super().__init__(self.shards, lr=lr, **adamw)
        self.gatherer = ParamGatherer(model, blocks, self.buckets, self.flat_params, group)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self.keep_grad_in_flat_buffer)

    def keep_grad_in_flat_buffer(self, p: nn.Parameter) -> None:
        """Backward made a new .grad (the old one was set to None or replaced): copy it into its
        place in the flat gradients, which step() reduces, and point .grad there again."""
        if self.needs_zero_grad:
            raise RuntimeError(f"backward after {type(self).__name__}.step() without its "
                               "zero_grad(): call it before each step's first backward")
        view = self.grad_views[p]
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat_grads.zero_()
        self.needs_zero_grad = False

    @torch.no_grad()
    def step(self) -> None:
        reduce_scatter_grads(self.buckets, self.flat_grads, self.group)
        if self.max_grad_norm:
            clip_grad_norm_(owned_grads(self.buckets, self.shards, self.rank),
                            self.max_grad_norm, self.group)
        super().step()
        self.gatherer.start()
        self.needs_zero_grad = True

    def wait_for_params(self) -> None:
        """Every parameter up to date (the last step's all-gathers done)."""
        self.gatherer.wait_all()


# Copied from 04_zero/baseline_zero.py: add_summary_flag
def add_summary_flag(parser: common.RecipeParser) -> None:
    """`--summary` (see `print_summary`); it prints more, so the run is no variant."""
    parser.add_argument("--summary", action="store_true",
                        help="print each rank's parameter, gradient and optimizer MB beside "
                             "the formula, its peak memory and the MB it sent per step")
    parser.output_only.add("summary")


# Copied from 04_zero/baseline_zero.py: print_summary
def print_summary(args: argparse.Namespace, topo: common.Topology, stats: common.Stats, *,
                  baseline: str | None, measured: dict[str, float], theory: dict) -> None:
    """`--summary`: per rank, the state MB counted from its tensors and the MB it sent, each
    beside its formula, and its peak beside the baseline's last recorded run like this one."""
    peak = stats.memory["total"] if stats.memory else common.peak_memory_mb(topo.device)
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, {**measured, "peak_mb": peak, "comm_mb": stats.comm_mb})
    if not topo.is_main:
        return
    from tabulate import tabulate

    here = common.base_record(args, topo, baseline, "ok", None)
    base = next((r for r in reversed(common.load_results(args.results))
                 if r.get("script") == baseline and r.get("status") == "ok"
                 and common.run_key(r) == common.run_key(here)), None)
    kinds = ["params_mb", "grads_mb", "optim_mb"]
    table = [[rank, *[f"{row[k]:,.2f} ({theory[k]:,.2f})" for k in kinds],
              f"{sum(row[k] for k in kinds):,.2f} ({theory['state_mb']:,.2f})",
              f"{row['peak_mb']:,.1f}" + (f" ({base['peak_mem_mb']:,.1f})" if base else ""),
              f"{row['comm_mb']:,.2f} ({theory['comm_mb']:,.2f})"] for rank, row in enumerate(rows)]
    print(tabulate(table, ["rank", "params MB", "grads MB", "optim MB", "state MB", "peak MB",
                           "comm MB/step"], tablefmt="github"))
    compared = "" if baseline is None else f" ({baseline}'s busiest rank)" if base else \
        f"; {baseline} has no recorded run like this one to compare with"
    print(f"measured (formula); peak = live tensor MB at the step's peak{compared}", flush=True)


def zero1_bytes(params: float, world: int, weight: float, grad: float, optim: float,
                sent_values: float | None = None, buffer_bytes: float = 0.0) -> dict[str, float]:
    """ZeRO-1's bytes a rank, from the parameter count and the bytes a value of each kind:
    every weight and gradient kept, the optimizer's state 1/N. Sent a step: the gradients
    reduce-scattered and the updated weights all-gathered, (N-1)/N of `sent_values` each (the
    buckets' values, their padding included; `params` if not given), and the buffers' broadcast."""
    share = (world - 1) / world
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params / world}
    values = params if sent_values is None else sent_values
    return {**kept, "state": sum(kept.values()),
            "sent": share * (grad + weight) * values + share * buffer_bytes}


def planned_zero1(plan: "PlanInput") -> dict[str, float]:
    """The planner's ZeRO-1 row: its state and bytes at the planner's model and cluster;
    under bf16 autocast, the model's bf16 copy."""
    predicted = zero1_bytes(plan.params, plan.gpus, *plan.state_bytes)
    return {"state": predicted["state"], "sent": predicted["sent"],
            "cast": plan.cast(plan.params), "fp32_residual": True}


def theory(model: nn.Module, buckets: list[Bucket], n: int) -> dict:
    """zero1_bytes at the run's shapes, in MB: the state from the model's parameters, not from
    the buckets (they add padding, under N values a bucket: `padding_mb_max`); sent, every
    value of every bucket, padding included, and the buffers' broadcast."""
    value_bytes = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    predicted = zero1_bytes(params, n, value_bytes, value_bytes, 2 * value_bytes,
                            sum(b.numel for b in buckets), buffer_bytes)
    return {"params_mb": predicted["params"] / 2**20, "grads_mb": predicted["grads"] / 2**20,
            "optim_mb": predicted["optim"] / 2**20, "state_mb": predicted["state"] / 2**20,
            "comm_mb": predicted["sent"] / 2**20,
            "padding_mb_max": value_bytes * (n - 1) * len(buckets) / 2**20}


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step (default: no clipping)")
    add_summary_flag(parser)
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    opt = ZeRO1(model, common.transformer_blocks(model), lr=args.lr,
                max_grad_norm=args.clip_grad_norm)

    def train_step(inputs, targets):
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    opt.wait_for_params()  # the last step's parameters, before anything reads them
    predicted = theory(model, opt.buckets, topo.world_size)
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  overlapped={"allgather": "step"},
                  comm_mb=stats.comm_mb, theory=predicted, stage=1,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured)
    if args.summary:
        print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                      theory=predicted)


# The planner's rows (report/planner.py reads this; the script never does): ZeRO-1 is the
# first sharding step after DDP.
PLANNED = [{"strategy": "ZeRO-1", "place": 20, "figures": planned_zero1}]


if __name__ == "__main__":
    common.run_main(main)
