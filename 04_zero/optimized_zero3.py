"""ZeRO-3 by hand: ZeRO-2, and each rank keeps only its 1/N of the parameters too.

What it does: `ZeRO3(model, blocks, lr=...)`, an AdamW with the optimizer's contract, takes the
buckets and ownership of optimized_zero1.py (one bucket per block, one for the root unit: every
other parameter). At rest a rank holds only its 1/N slices of the parameters, gradients and
AdamW state, in the parameters' dtype; a bucket's full parameters are views into a buffer whose
storage exists only while it is needed. Hooks all-gather a block's parameters just before its
forward and free them right after, gather them again just before its backward (each gather
starting the next block's), and, as in ZeRO-2, reduce-scatter its gradients as soon as backward
has produced them (accumulating over backward passes until the step), freeing the parameters
then. The root unit (embeddings, final norm, head), used at both ends of the step, stays
gathered from forward's start to backward's end, as FSDP2's root does. `step()` updates the
owned slices in place and frees any bucket still gathered (the root after an evaluation
between backward and step), so the next forward gathers the new values. Under bf16 autocast
(--dtype bf16) the gathers deliver bf16 weights, as FSDP2's param_dtype, which autocast uses as
they are: it saves no bf16 copy of its own that freeing a bucket would not free. The fp32 shards
stay the master; gradients are reduced in fp32. --clip-grad-norm as in ZeRO-1.
Why it helps: memory per rank falls to 16 bytes per fp32 parameter / N, plus about two blocks
and the root in full, so a model N times larger than one rank's memory trains; the price, one
more all-gather of the parameters a step (1.5x ZeRO-2's traffic), prefetching hides where it can.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero3.py --size small [--model llama]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, the lowest peak of the three; optimized_zero_pytorch.py --stage 3
            runs FSDP2's fully_shard on the same blocks beside it.
Theory:     per rank bP/N + bP/N + 2bP/N = 4bP/N bytes (params, grads, optimizer), b = bytes
            per value (4 in fp32), plus padding and at most the root and two blocks gathered
            (`gathered_mb`, c bytes a value: 2 under bf16, else b); sent per step (N-1)/N x
            (c x (2 x the blocks' parameters + the root's) + b x P): two all-gathers and a
            reduce-scatter, against ZeRO-2's 2(N-1)/N x bP (plus the buffers' broadcast).
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


# Copied from 04_zero/optimized_zero1.py: Bucket, changed: shard() in place of whole(), owned()
@dataclass
class Bucket:
    """Parameters laid out one after another at [offset, offset + numel) of the model's flat
    layout; numel is padded to a multiple of the world size so every rank owns an equal slice."""
    params: list[nn.Parameter]
    offset: int
    numel: int

    def shard(self, flat_shards: torch.Tensor, world: int) -> torch.Tensor:
        """This bucket's slice of a buffer that holds only the owned slices (1/N of the model)."""
        return flat_shards[self.offset // world:(self.offset + self.numel) // world]


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


def shard_params(buckets: list[Bucket], group: dist.ProcessGroup | None,
                 param_dtype: torch.dtype | None = None, in_host_memory: bool = False
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Keep this rank's slice of every bucket in one buffer of 1/N of the model, in the
    parameters' dtype, the values the group's first rank holds (ranks start alike, as in DDP);
    each parameter becomes a view into its bucket's unsharded buffer, in `param_dtype` (default:
    the parameters' own), whose storage is freed until gathered. Made with `p.data = ...`, the
    views keep their own autograd version counters, so refilling the storage does not trip the
    check on the weights autograd saved for backward (a plain slice shares the buffer's counter;
    FSDP2 refills under torch.autograd._unsafe_preserve_version_counter instead).
    `in_host_memory` keeps the slices there (optimized_zero3_offload.py's masters), pinned on
    CUDA so that copies to and from the device run beside compute."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dtype, device = flat_dtype(buckets), buckets[0].params[0].device
    size = sum(b.numel for b in buckets) // n
    param_shards = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda") \
        if in_host_memory else torch.zeros(size, dtype=dtype, device=device)
    unsharded = []
    for bucket in buckets:
        flat = torch.zeros(bucket.numel, dtype=dtype, device=device)
        full = torch.empty(bucket.numel, dtype=param_dtype or dtype, device=device)
        offset = 0
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat[view].copy_(p.detach().flatten())
            p.data = full[view].view_as(p)
            offset += p.numel()
        dist.broadcast(flat, first_rank(group), group=group)
        k = bucket.numel // n
        bucket.shard(param_shards, n).copy_(flat[rank * k:(rank + 1) * k])
        full.untyped_storage().resize_(0)
        unsharded.append(full)
    return param_shards, unsharded


def owned_shards(buckets: list[Bucket], param_shards: torch.Tensor, world: int
                 ) -> list[nn.Parameter]:
    """The slices this rank owns, one per bucket, as the parameters AdamW updates: views, so an
    update lands in the parameter shards, and AdamW's moments exist for 1/N of the model. Their
    gradients come from GradReducer."""
    return [nn.Parameter(b.shard(param_shards, world)) for b in buckets]


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


class ParamGatherer:
    """Hooks that hold a bucket's parameters in full only around its compute. Before a block's
    forward: gather it (if its prefetch has not) and start the next block's all-gather; after:
    free it, and hook its output's gradient, which arrives just before backward enters the
    block, to gather it again and start the previous block's. The root unit is gathered
    before the model's forward and freed by GradReducer after its backward. A bucket already
    gathered is not gathered again: `free_all` before the shards change."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], shards: list[nn.Parameter],
                 unsharded: list[torch.Tensor], group: dist.ProcessGroup | None):
        self.shards, self.unsharded, self.group = shards, unsharded, group
        self.pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather in flight
        root, last = len(shards) - 1, len(blocks) - 1
        model.register_forward_pre_hook(lambda *_: self.gather(root, prefetch=last))
        for j, block in enumerate(blocks):
            i = last - j  # block j's bucket; block j + 1's is i - 1
            block.register_forward_pre_hook(
                lambda *_, i=i, j=j: self.gather(i, prefetch=i - 1 if j < last else None))
            block.register_forward_hook(
                lambda _, __, out, i=i, j=j: self.after_forward(i, j > 0, out))

    def start_gather(self, i: int) -> None:
        buffer = self.unsharded[i]
        if i in self.pending or buffer.untyped_storage().nbytes():
            return
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        # each rank's slice cast to the compute dtype before it is sent (a 1/N copy): the
        # gather moves and holds bf16 where the shards are fp32
        self.pending[i] = common.all_gather_single(
            buffer, self.shards[i].detach().to(buffer.dtype), group=self.group, async_op=True)

    def gather(self, i: int, prefetch: int | None = None) -> None:
        """Bucket i's parameters in full when this returns; the next one's on their way."""
        self.start_gather(i)
        if prefetch is not None:
            self.start_gather(prefetch)
        if i in self.pending:
            self.pending.pop(i).wait()

    def after_forward(self, i: int, has_previous: bool, out) -> None:
        self.free(i)
        # The gradient of a block's output arrives just before backward enters the block (a
        # block that returns a tuple, as HuggingFace's do, has its hidden states first).
        out = out if torch.is_tensor(out) else out[0]
        if out.requires_grad:
            out.register_hook(lambda _: self.gather(i, prefetch=i + 1 if has_previous else None))

    def free(self, i: int) -> None:
        self.unsharded[i].untyped_storage().resize_(0)

    def free_all(self) -> None:
        """Every bucket back to its shards: those a forward without backward left gathered (an
        evaluation keeps the root) would otherwise serve the next forward their old values."""
        for work in self.pending.values():  # reading the shards: done before they change
            work.wait()
        self.pending.clear()
        for i in range(len(self.unsharded)):
            self.free(i)


# Copied from 04_zero/optimized_zero2.py: GradReducer, changed: reduce dtype, params freed
class GradReducer:
    """Backward hooks that keep only this rank's slice of the gradient. As soon as backward has
    produced a parameter's gradient it is copied into its bucket's buffer, in the shards' dtype
    (fp32 under a bf16 gather: FSDP2's reduce_dtype), and the parameter's .grad becomes a view
    there, or None where the dtypes differ (the tensor autograd made is freed). When a bucket's
    last gradient is in, the bucket is reduce-scattered at once, while backward goes on with the
    buckets before it, into the gradient of this rank's shard, or, if an earlier backward since
    zero_grad left one there, into a fresh slice added to it on arrival (accumulation). Once
    done, the bucket, the full gradient of its parameters, is dropped; by the end of each
    backward all are. Summed over ranks; `average` then divides the shards' by N at the step:
    1/N of the work of dividing the whole gradient first. Backward is then done with the
    bucket's parameters, so they are freed as soon as its reduce-scatter starts. `reduced(i)`
    is where the summed slice lives: the shard's .grad (the offload's subclass keeps it apart)."""

    def __init__(self, buckets: list[Bucket], shards: list[nn.Parameter],
                 group: dist.ProcessGroup | None, gatherer: ParamGatherer):
        self.buckets, self.shards, self.group = buckets, shards, group
        self.gatherer = gatherer
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
            self.buffers[i] = torch.empty(bucket.numel, dtype=self.shards[i].dtype,
                                          device=p.device)
            self.buffers[i][sum(q.numel() for q in bucket.params):].zero_()  # the padding
            self.copied[i] = 0
        grad = self.buffers[i][offset:offset + p.numel()].view_as(p)
        grad.copy_(p.grad)
        p.grad = grad if grad.dtype == p.dtype else None
        self.copied[i] += 1
        if self.copied[i] == len(bucket.params):
            summed = self.buffers[i].new_empty(self.shards[i].shape)  # on the gradient's device
            accumulated = self.reduced(i) is not None
            if not accumulated:
                self.keep_reduced(i, summed)
            work = common.reduce_scatter(summed, self.buffers[i], self.group, async_op=True)
            self.in_flight.append((work, i, summed if accumulated else None))
            self.gatherer.free(i)

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
                self.reduced(i).add_(addend)
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
        for i in range(len(self.shards)):
            if self.reduced(i) is None:
                raise RuntimeError(f"bucket {i} got no gradient since zero_grad(): call "
                                   "backward before step, with every parameter taking part")
            self.reduced(i).div_(dist.get_world_size(self.group))

    def reduced(self, i: int) -> torch.Tensor | None:
        """Bucket i's slice of the gradient, summed since zero_grad() (None before its first
        reduce-scatter): its shard's .grad, which AdamW reads."""
        return self.shards[i].grad

    def keep_reduced(self, i: int, grad: torch.Tensor) -> None:
        self.shards[i].grad = grad


class ZeRO3(torch.optim.AdamW):
    """AdamW over the slices this rank owns, with the optimizer's contract: `zero_grad()`, one
    or more `loss.backward()` (each reduce-scatters its gradients; the owned slices accumulate),
    `step()`. `blocks`: the model's repeated modules in forward order (e.g.
    common.transformer_blocks(model)); every other parameter forms the root unit. Every
    collective runs on `group` (default: the world). The shards, their gradients and AdamW's
    state keep the parameters' dtype (a bf16 model stays bf16). `param_dtype` (FSDP2's
    MixedPrecisionPolicy.param_dtype; default: the parameters' own) is the dtype the all-gather
    delivers the parameters in, and forward and backward compute with: under bf16 autocast pass
    torch.bfloat16, so that autocast finds the weights in its dtype and saves no copy of its own
    for backward (a copy that freeing the bucket would not free); the fp32 shards stay the
    master, and the gradients are reduce-scattered in fp32 (FSDP2's reduce_dtype).

    The model's .grad are None between backward passes (the gradient lives in the shards'),
    so `model.zero_grad()` changes nothing: call this object's `zero_grad()` (a backward after
    `step()` without it raises, where it would add to the last step's gradient). Outside
    forward and backward the model's parameters have no storage: this rank's values are the
    shards (`self.shards`, one slice per bucket of `self.buckets`)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None, max_grad_norm: float | None = None,
                 param_dtype: torch.dtype | None = None, **adamw):
        self.group, self.max_grad_norm = group, max_grad_norm
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.buckets = partition(units_in_gradient_order(model, blocks), world)
        self.param_shards, self.unsharded = shard_params(self.buckets, group, param_dtype)
        if list(model.buffers()):
            broadcast_buffers(model, group)
            model.register_forward_pre_hook(lambda *_: broadcast_buffers(model, group))
        self.shards = owned_shards(self.buckets, self.param_shards, world)
        super().__init__(self.shards, lr=lr, **adamw)
        self.gatherer = ParamGatherer(model, blocks, self.shards, self.unsharded, group)
        self.reducer = GradReducer(self.buckets, self.shards, group, self.gatherer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.reducer.needs_zero_grad = False

    @torch.no_grad()
    def step(self) -> None:
        self.gatherer.free_all()
        self.reducer.average()
        if self.max_grad_norm:
            clip_grad_norm_(owned_grads(self.buckets, self.shards, self.rank),
                            self.max_grad_norm, self.group)
        super().step()
        self.reducer.needs_zero_grad = True


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


def planned_zero3(plan: "PlanInput") -> dict[str, float]:
    """The planner's ZeRO-3 row: the blocks of equal size, the root the tables and an untied
    head; gradients reduced in fp32, as GradReducer does under any compute dtype."""
    w, g, o = plan.state_bytes
    predicted = zero3_bytes(plan.params, [plan.blocks / plan.layers] * plan.layers,
                            plan.embedding + plan.head, plan.gpus, w, g, o, plan.compute_bytes,
                            reduce=4)
    return {key: predicted[key] for key in ("state", "sent", "gathered")}


def theory(buckets: list[Bucket], n: int, value_bytes: int, gather_bytes: int,
           buffers_mb: float) -> dict:
    """Per rank, zero3_bytes from the buckets: the state from the parameter count (the
    buckets' padding, under N values a bucket, is `padding_mb_max`), the bytes sent and held
    gathered from the buckets' values, all padding included."""
    params = sum(p.numel() for b in buckets for p in b.params)
    *blocks, root = (b.numel for b in buckets)
    predicted = zero3_bytes(params, blocks, root, n, value_bytes, value_bytes, 2 * value_bytes,
                            gather_bytes, buffers_mb * 2**20)
    return {"params_mb": predicted["params"] / 2**20, "grads_mb": predicted["grads"] / 2**20,
            "optim_mb": predicted["optim"] / 2**20, "state_mb": predicted["state"] / 2**20,
            "comm_mb": predicted["sent"] / 2**20, "gathered_mb": predicted["gathered"] / 2**20,
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
    param_dtype = torch.bfloat16 if args.dtype == "bf16" else None  # what autocast computes in
    buffers_mb = sum(b.numel() * b.element_size() for b in model.buffers()) / 2**20
    value_bytes = next(model.parameters()).element_size()  # before ZeRO3 gathers in param_dtype
    opt = ZeRO3(model, common.transformer_blocks(model), lr=args.lr,
                max_grad_norm=args.clip_grad_norm, param_dtype=param_dtype)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    predicted = theory(opt.buckets, topo.world_size, value_bytes,
                       opt.unsharded[0].element_size(), buffers_mb)
    measured = common.state_split_mb(model, opt)
    # On CPU the peak's split by kind: the parameters held in full there, beyond the shards
    gathered = {"gathered_mb": round(stats.memory["params"] - measured["params_mb"], 3)} \
        if stats.memory and "params" in stats.memory else {}
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP,
                  comm_mb=stats.comm_mb, theory=predicted, stage=3,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured, **gathered)
    if args.summary:
        print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                      theory=predicted)


# The planner's rows (report/planner.py reads this; the script never does).
PLANNED = [{"strategy": "ZeRO-3", "place": 40, "figures": planned_zero3}]


if __name__ == "__main__":
    common.run_main(main)
