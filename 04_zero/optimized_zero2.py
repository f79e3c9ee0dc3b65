"""ZeRO-2 by hand: ZeRO-1, and each rank keeps the gradient of its 1/N only.

What it does: `ZeRO2(model, blocks, lr=...)`, an AdamW with the optimizer's contract, lays out
the flat parameters, buckets and ownership as optimized_zero1.py does (rank r owns the r-th 1/N
of every bucket, buckets in the order backward completes their gradients, in the parameters'
dtype). The gradients change: a hook on each parameter copies its gradient into its bucket's
buffer as soon as backward has produced it; when a bucket's last gradient is in, the bucket is
reduce-scattered at once, while backward computes the buckets before it, and only this rank's
summed slice is kept (added to what earlier backward passes left there: gradient
accumulation). The bucket's buffer and the parameters' .grad are dropped by the end of
backward. `step()` runs AdamW on the owned slices, which are all-gathered into every rank's
parameters, as in ZeRO-1. --clip-grad-norm clips as ZeRO-1 does: from the owned values.
Why it helps: after ZeRO-1 the full gradient (4 bytes per fp32 parameter) is the largest thing
a rank holds besides the weights; now a rank holds a full gradient only for the buckets being
filled or reduced, and 1/N of it at rest, for the same communication as ZeRO-1 and DDP.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero2.py --size small [--model llama]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, tokens/s close to it; grads_mb falls by N too, and the peak's
            `grads` share (memory.grads in the record) is far below a full gradient.
Theory:     per rank bP + bP/N + 2bP/N bytes (params, grads, optimizer), P = parameter count,
            b = bytes per value (4 in fp32), plus padding and the buckets in flight during
            backward; sent per step (N-1)/N x bP reduce-scattered per backward plus the same
            all-gathered: 2(N-1)/N x bP (plus the buffers' broadcast, if any).
"""

import argparse
import functools
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


# Copied from 04_zero/optimized_zero1.py: units_in_gradient_order
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


# Copied from 04_zero/optimized_zero1.py: Bucket
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


# Copied from 04_zero/optimized_zero1.py: partition
def partition(units: list[list[nn.Parameter]], world: int) -> list[Bucket]:
    """One bucket per unit, back to back: rank r owns the r-th 1/N of every bucket."""
    buckets, offset = [], 0
    for params in units:
        numel = -(-sum(p.numel() for p in params) // world) * world  # rounded up to N
        buckets.append(Bucket(params, offset, numel))
        offset += numel
    return buckets


# Copied from 04_zero/optimized_zero1.py: flat_dtype
def flat_dtype(buckets: list[Bucket]) -> torch.dtype:
    """The one dtype of the parameters, which the flat buffers keep (a bf16 model stays bf16)."""
    dtypes = {p.dtype for bucket in buckets for p in bucket.params}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of several dtypes ({sorted(map(str, dtypes))}): cast the "
                         "model to one dtype before sharding it")
    return dtypes.pop()


# Copied from 04_zero/optimized_zero1.py: flatten, changed: no flat gradients
def flatten(buckets: list[Bucket]) -> torch.Tensor:
    """Move the parameters into one flat buffer, in their dtype and device: each `p` becomes a
    view, so an update of a flat slice is an update of the parameters."""
    total = buckets[-1].offset + buckets[-1].numel
    device = buckets[0].params[0].device
    flat_params = torch.zeros(total, dtype=flat_dtype(buckets), device=device)
    for bucket in buckets:
        offset = bucket.offset
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat_params[view].copy_(p.detach().flatten())
            p.data = flat_params[view].view_as(p)
            offset += p.numel()
    return flat_params


# Copied from 04_zero/optimized_zero1.py: first_rank
def first_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's first member: the source of every broadcast."""
    return dist.get_global_rank(group or dist.group.WORLD, 0)


# Copied from 04_zero/optimized_zero1.py: broadcast_buffers
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


def owned_shards(buckets: list[Bucket], flat_params: torch.Tensor, rank: int, world: int
                 ) -> list[nn.Parameter]:
    """The slices rank `rank` owns, one per bucket, as the parameters AdamW updates: views, so
    an update lands in the flat parameters, and AdamW's moments exist for 1/N of the model.
    Their gradients come from GradReducer."""
    return [nn.Parameter(b.owned(flat_params, rank, world)) for b in buckets]


# Copied from 04_zero/optimized_zero1.py: owned_grads
def owned_grads(buckets: list[Bucket], shards: list[nn.Parameter], rank: int
                ) -> list[torch.Tensor]:
    """The gradient values this rank owns, without the padding: one slice per bucket, cut where
    the bucket's parameters end (its padding lies at its end, in the last ranks' slices)."""
    grads = []
    for bucket, shard in zip(buckets, shards, strict=True):
        values = sum(p.numel() for p in bucket.params) - rank * shard.numel()  # from the slice on
        grads.append(shard.grad[:max(0, values)])
    return grads


# Copied from 04_zero/optimized_zero1.py: clip_grad_norm_
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


# Copied from 04_zero/optimized_zero1.py: ParamGatherer
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


class GradReducer:
    """Backward hooks that keep only this rank's slice of the gradient. As soon as backward has
    produced a parameter's gradient it is copied into its bucket's buffer, and the parameter's
    .grad becomes a view there (the tensor autograd made is freed). When a bucket's last
    gradient is in, the bucket is reduce-scattered at once, while backward goes on with the
    buckets before it, into the gradient of this rank's shard, or, if an earlier backward since
    zero_grad left one there, into a fresh slice added to it on arrival (accumulation). Once
    done, the bucket, the full gradient of its parameters, is dropped; by the end of each
    backward all are. Summed over ranks; `average` then divides the shards' by N at the step:
    1/N of the work of dividing the whole gradient first."""

    def __init__(self, buckets: list[Bucket], shards: list[nn.Parameter],
                 group: dist.ProcessGroup | None):
        self.buckets, self.shards, self.group = buckets, shards, group
        self.buffers: dict[int, torch.Tensor] = {}  # bucket index -> its full gradient
        self.copied: dict[int, int] = {}  # bucket index -> gradients copied into it so far
        # reduce-scatters in flight: the work, its bucket, the slice to add to the shard's grad
        self.in_flight: list[tuple[dist.Work, int, torch.Tensor | None]] = []
        self.end_queued = False  # end_of_backward is queued for the backward under way
        self.needs_zero_grad = False  # the optimizer stepped since its zero_grad()
        for i, bucket in enumerate(buckets):
            offset = 0
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(functools.partial(self.add_grad, i, offset))
                offset += p.numel()

    def add_grad(self, i: int, offset: int, p: nn.Parameter) -> None:
        if not self.end_queued:
            if self.needs_zero_grad:  # else this backward would add to the last step's gradient
                raise RuntimeError("backward after the ZeRO optimizer's step() without its "
                                   "zero_grad(): call it before each step's first backward")
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self.end_queued = True
        self.drop_reduced()
        bucket = self.buckets[i]
        if i not in self.buffers:
            self.buffers[i] = torch.empty(bucket.numel, dtype=p.dtype, device=p.device)
            self.buffers[i][sum(q.numel() for q in bucket.params):].zero_()  # the padding
            self.copied[i] = 0
        grad = self.buffers[i][offset:offset + p.numel()].view_as(p)
        grad.copy_(p.grad)
        p.grad = grad
        self.copied[i] += 1
        if self.copied[i] == len(bucket.params):
            shard = self.shards[i]
            summed = torch.empty_like(shard)
            accumulated = shard.grad is not None
            if not accumulated:
                shard.grad = summed
            work = common.reduce_scatter(summed, self.buffers[i], self.group, async_op=True)
            self.in_flight.append((work, i, summed if accumulated else None))

    def drop_reduced(self, wait: bool = False) -> None:
        """Drop the buckets whose reduce-scatter is done; with `wait`, all of them."""
        pending = []
        for work, i, addend in self.in_flight:
            if wait:
                work.wait()
            elif not work.is_completed():
                pending.append((work, i, addend))
                continue
            if addend is not None:
                self.shards[i].grad += addend
            del self.buffers[i], self.copied[i]
            for p in self.buckets[i].params:
                p.grad = None
        self.in_flight = pending

    def end_of_backward(self) -> None:
        """Queued by the first hook of each backward, run when it ends: every bucket reduced."""
        self.end_queued = False
        self.drop_reduced(wait=True)
        if self.buffers:
            raise RuntimeError(f"bucket {min(self.buffers)} got only some of its gradients: "
                               "these hooks need every parameter to take part in every backward")

    def average(self) -> None:
        """Before the step: every shard's gradient, summed over ranks, divided by N."""
        for i, shard in enumerate(self.shards):
            if shard.grad is None:
                raise RuntimeError(f"bucket {i} got no gradient since zero_grad(): call "
                                   "backward before step, with every parameter taking part")
            shard.grad.div_(dist.get_world_size(self.group))


class ZeRO2(torch.optim.AdamW):
    """AdamW over the slices this rank owns, with the optimizer's contract: `zero_grad()`, one
    or more `loss.backward()` (each reduce-scatters its gradients; the owned slices accumulate),
    `step()`. `blocks`: the model's repeated modules in forward order (e.g.
    common.transformer_blocks(model)); every other parameter forms the root unit. Every
    collective runs on `group` (default: the world). The parameters keep their dtype; no fp32
    master copy is kept.

    The model's .grad are None between backward passes (the gradient lives in the shards'),
    so `model.zero_grad()` changes nothing: call this object's `zero_grad()` (a backward after
    `step()` without it raises, where it would add to the last step's gradient). After the
    last `step()`, call `wait_for_params()` before reading the weights outside forward."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None, max_grad_norm: float | None = None,
                 **adamw):
        self.group, self.max_grad_norm = group, max_grad_norm
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.buckets = partition(units_in_gradient_order(model, blocks), world)
        self.flat_params = flatten(self.buckets)
        dist.broadcast(self.flat_params, first_rank(group), group=group)  # start alike, as DDP
        if list(model.buffers()):
            broadcast_buffers(model, group)
            model.register_forward_pre_hook(lambda *_: broadcast_buffers(model, group))
        self.shards = owned_shards(self.buckets, self.flat_params, self.rank, world)
        super().__init__(self.shards, lr=lr, **adamw)
        self.gatherer = ParamGatherer(model, blocks, self.buckets, self.flat_params, group)
        self.reducer = GradReducer(self.buckets, self.shards, group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.reducer.needs_zero_grad = False

    @torch.no_grad()
    def step(self) -> None:
        self.reducer.average()
        if self.max_grad_norm:
            clip_grad_norm_(owned_grads(self.buckets, self.shards, self.rank),
                            self.max_grad_norm, self.group)
        super().step()
        self.gatherer.start()
        self.reducer.needs_zero_grad = True

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


def zero2_bytes(params: float, world: int, weight: float, grad: float, optim: float,
                sent_values: float | None = None, buffer_bytes: float = 0.0) -> dict[str, float]:
    """ZeRO-2's bytes a rank, from the parameter count and the bytes a value of each kind:
    every weight kept, the gradients and the optimizer's state 1/N. Sent a step, as ZeRO-1: the
    gradients reduce-scattered and the updated weights all-gathered, (N-1)/N of `sent_values`
    each (the buckets' values, their padding included; `params` if not given), and the buffers'
    broadcast."""
    share = (world - 1) / world
    kept = {"params": weight * params, "grads": grad * params / world,
            "optim": optim * params / world}
    values = params if sent_values is None else sent_values
    return {**kept, "state": sum(kept.values()),
            "sent": share * (grad + weight) * values + share * buffer_bytes}


def planned_zero2(plan: "PlanInput") -> dict[str, float]:
    """The planner's ZeRO-2 row: its state and bytes at the planner's model and cluster;
    under bf16 autocast, the model's bf16 copy."""
    predicted = zero2_bytes(plan.params, plan.gpus, *plan.state_bytes)
    return {"state": predicted["state"], "sent": predicted["sent"],
            "cast": plan.cast(plan.params), "fp32_residual": True}


# Copied from 04_zero/optimized_zero1.py: theory, changed: zero2_bytes
def theory(model: nn.Module, buckets: list[Bucket], n: int) -> dict:
    """zero2_bytes at the run's shapes, in MB: the state from the model's parameters, not from
    the buckets (they add padding, under N values a bucket: `padding_mb_max`); sent, every
    value of every bucket, padding included, and the buffers' broadcast."""
    value_bytes = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    predicted = zero2_bytes(params, n, value_bytes, value_bytes, 2 * value_bytes,
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
    opt = ZeRO2(model, common.transformer_blocks(model), lr=args.lr,
                max_grad_norm=args.clip_grad_norm)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    opt.wait_for_params()  # the last step's parameters, before anything reads them
    predicted = theory(model, opt.buckets, topo.world_size)
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  overlapped={"allgather": "step", "reduce_scatter": "backward"},
                  comm_mb=stats.comm_mb, theory=predicted, stage=2,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured)
    if args.summary:
        print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                      theory=predicted)


# The planner's rows (report/planner.py reads this; the script never does).
PLANNED = [{"strategy": "ZeRO-2", "place": 30, "figures": planned_zero2}]


if __name__ == "__main__":
    common.run_main(main)
