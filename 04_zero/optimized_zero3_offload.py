"""ZeRO-3 with its optimizer offloaded, by hand: AdamW's state and step in host memory.

What it does: optimized_zero3.py's sharding, its units copied below this script's own, with the
state split by where it lives. On the device: this rank's 1/N of the parameters in the compute
dtype (bf16 on GPUs), which the all-gathers read, and the gradient shards between backward and
the step (OffloadGradReducer: ZeRO-3's, the gradient kept apart from the host's masters). In
host memory: the fp32 master 1/N of the parameters and AdamW's two moments, 12 bytes a
parameter / N. `step()` copies each gradient shard to the host, and a host thread steps bucket
by bucket, in the order the next forward needs them (the root, then block 0, 1, ...), each
bucket's new values copied back to its compute shard: the next forward waits for a bucket's
update only when it reaches that bucket, so the host's AdamW of the later blocks runs under the
device's forward of the earlier ones. On a CPU-only host the "device" is host memory too: the
run proves the data path and the losses (ZeRO-3's), not the memory moved (`offloaded_to`).
Why it helps: a GPU holds 2 bytes a parameter / N (bf16) where ZeRO-3 holds 16 / N: ZeRO-Offload
trained 13B parameters on one 32 GB V100 this way. The cost: 4 + 4 bytes a parameter / N over
the host link each step (gradients down, parameters up) and a step at the host's speed.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero3_offload.py --size small
Look for:   `make zero report`: losses equal to optimized_zero3's, device_state_mb and
            host_state_mb beside their theory; on a GPU the peak device memory and step time
            against optimized_zero3 and FSDP2's CPUOffloadPolicy (optimized_zero_pytorch
            --stage 3 --cpu-offload).
Theory:     per rank, on the device c x P/N (c: the compute dtype's bytes), in host memory
            12 x P/N (fp32 master and two moments; the gradient, 4 x P/N, only during the step);
            the host link, 4 x P/N down and c x P/N up a step; sent over the network as ZeRO-3.
"""

import concurrent.futures
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

# Against ZeRO-3 (optimized_zero3.py), exact in fp32: the same values, gathered, reduced and
# stepped by the same AdamW, only where it runs differs. Under bf16 autocast, as ZeRO-3's.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


class ZeRO3Offload(torch.optim.AdamW):
    """AdamW over this rank's fp32 master slices in host memory, with the optimizer's contract:
    `zero_grad()`, one or more `loss.backward()` (each reduce-scatters its gradients on the
    device; the slices accumulate there), `step()`. `blocks`, `group` and `param_dtype` as
    optimized_zero3.py's ZeRO3: `param_dtype` is the compute shards' dtype, the one the
    all-gathers deliver (torch.bfloat16 under bf16 autocast); the masters and the gradients
    stay in the parameters' dtype. One parameter group a bucket (`self.buckets`, their masters
    `self.masters`); `step()` queues each bucket's update on a host thread and returns: a
    forward waits for a bucket's update just before it gathers that bucket."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], lr: float = 1e-3,
                 group: dist.ProcessGroup | None = None, max_grad_norm: float | None = None,
                 param_dtype: torch.dtype | None = None, **adamw):
        self.group, self.max_grad_norm = group, max_grad_norm
        world = dist.get_world_size(group)
        device = next(model.parameters()).device
        self.buckets = partition(units_in_gradient_order(model, blocks), world)
        # ZeRO-3's shards, kept in host memory: the masters; on the device, their copy in the
        # compute dtype, which the all-gathers read
        masters, self.unsharded = shard_params(self.buckets, group, param_dtype,
                                               in_host_memory=True)
        compute = masters.to(device, param_dtype or masters.dtype, copy=True)
        if list(model.buffers()):
            broadcast_buffers(model, group)
            model.register_forward_pre_hook(lambda *_: broadcast_buffers(model, group))
        self.masters = owned_shards(self.buckets, masters, world)
        self.compute = [b.shard(compute, world) for b in self.buckets]
        super().__init__([{"params": [m]} for m in self.masters], lr=lr, **adamw)
        # each bucket's AdamW: this optimizer's own group and state, stepped alone
        self.per_bucket = []
        for group_of_bucket in self.param_groups:
            adam = torch.optim.AdamW(group_of_bucket["params"], lr=lr, **adamw)
            adam.param_groups, adam.state = [group_of_bucket], self.state
            self.per_bucket.append(adam)
        self.cuda = device.type == "cuda"
        self.copies = torch.cuda.Stream(device) if self.cuda else None  # host <-> device
        self.host = host_thread(device)
        self.updates: dict[int, concurrent.futures.Future] = {}  # bucket -> its update
        self.bytes_down = self.bytes_up = 0  # the last step's over the host link (two threads)
        self.wait_for_updates_before_gathers(model, blocks)
        self.gatherer = ParamGatherer(model, blocks, self.compute, self.unsharded, group)
        self.reducer = OffloadGradReducer(self.buckets, self.masters, group, self.gatherer)

    def wait_for_updates_before_gathers(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Forward pre-hooks, registered before ParamGatherer's (hooks run in that order): the
        model's waits for the root's update and block 0's (its prefetch), block j's for block
        j + 1's (its prefetch). Backward gathers again what forward waited for."""
        root, last = len(self.buckets) - 1, len(blocks) - 1
        model.register_forward_pre_hook(lambda *_: self.wait_for(root, last))
        for j, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, j=j: self.wait_for(last - j - 1))

    def wait_for(self, *buckets: int) -> None:
        for i in buckets:
            if i in self.updates:
                done = self.updates.pop(i).result()  # its host step, and on CUDA its copy up
                if done is not None:
                    torch.cuda.current_stream().wait_event(done)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward starts a fresh gradient (the host's are freed by each step)."""
        self.reducer.grads = [None] * len(self.buckets)
        self.reducer.needs_zero_grad = False

    @torch.no_grad()
    def step(self) -> None:
        self.wait_for(*list(self.updates))  # a second step with no forward between
        self.bytes_down = self.bytes_up = 0
        self.gatherer.free_all()
        self.reducer.average()
        if self.max_grad_norm:  # on the device, before any of it leaves: the global norm needs
            # every rank's every value (the padding's gradients are zeros: they add nothing)
            clip_grad_norm_(self.reducer.grads, self.max_grad_norm, self.group)
        if self.cuda:  # the copies wait for backward's last reduce-scatter
            self.copies.wait_stream(torch.cuda.current_stream())
        for i in reversed(range(len(self.buckets))):  # the root first: the next forward's first
            down = self.gradient_to_host(i)
            self.updates[i] = self.host.submit(self.update_bucket, i, down)
        self.reducer.grads = [None] * len(self.buckets)  # the device's copy, freed
        self.reducer.needs_zero_grad = True

    def gradient_to_host(self, i: int) -> torch.cuda.Event | None:
        """Bucket i's gradient shard copied into a fresh host tensor, the master's .grad: on CUDA
        queued on the copy stream (pinned memory, from the host allocator's cache), an event
        marking its arrival."""
        grad = self.reducer.grads[i]
        self.masters[i].grad = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.cuda)
        self.bytes_down += grad.numel() * grad.element_size()
        if not self.cuda:
            self.masters[i].grad.copy_(grad)
            return None
        with torch.cuda.stream(self.copies):
            self.masters[i].grad.copy_(grad, non_blocking=True)
            grad.record_stream(self.copies)  # freed on the compute stream, read on this one
            return self.copies.record_event()

    @torch.no_grad()  # grad mode is a thread's own: step()'s does not reach the host thread
    def update_bucket(self, i: int, down: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """On the host thread: AdamW's step on bucket i's master, its gradient then freed, the
        new values copied up to its compute shard (on CUDA, queued on the copy stream: the event
        the forward's gather waits for)."""
        if down is not None:
            down.synchronize()
        master = self.masters[i]
        self.per_bucket[i].step()
        master.grad = None
        self.bytes_up += self.compute[i].numel() * self.compute[i].element_size()
        if not self.cuda:
            self.compute[i].copy_(master)
            return None
        with torch.cuda.stream(self.copies):
            self.compute[i].copy_(master, non_blocking=True)
            return self.copies.record_event()

    def wait_for_params(self) -> None:
        """Every queued update landed: before reading the weights outside forward (saving
        them), as ZeRO1's and ZeRO2's."""
        self.wait_for(*list(self.updates))


def host_thread(device: torch.device) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that steps AdamW in host memory, bound on CUDA to `device`: the current
    GPU is a thread's own and a new thread's is GPU 0, where its first CUDA call (waiting for a
    copy's event, the optimizer's graph-capture check, leaving a stream's context) would open a
    context, a few hundred MB that `max_memory_allocated` does not count, for every rank."""
    if common.dry_run():
        return common.InlineExecutor()
    if device.type != "cuda":
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-adamw")
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-adamw",
                                                 initializer=torch.cuda.set_device,
                                                 initargs=(device,))


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


# Copied from 04_zero/optimized_zero3.py: Bucket
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


# Copied from 04_zero/optimized_zero3.py: shard_params
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


# Copied from 04_zero/optimized_zero3.py: owned_shards
def owned_shards(buckets: list[Bucket], param_shards: torch.Tensor, world: int
                 ) -> list[nn.Parameter]:
    """The slices this rank owns, one per bucket, as the parameters AdamW updates: views, so an
    update lands in the parameter shards, and AdamW's moments exist for 1/N of the model. Their
    gradients come from GradReducer."""
    return [nn.Parameter(b.shard(param_shards, world)) for b in buckets]


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


# Copied from 04_zero/optimized_zero3.py: ParamGatherer
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


# Copied from 04_zero/optimized_zero3.py: GradReducer
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


class OffloadGradReducer(GradReducer):
    """ZeRO-3's GradReducer with the masters as its shards (the gradient keeps their dtype), the
    summed slice kept on the device in `grads[i]`, not in the master's .grad, which lives in host
    memory with its master: step() moves each bucket's gradient there itself."""

    def __init__(self, buckets: list[Bucket], masters: list[nn.Parameter],
                 group: dist.ProcessGroup | None, gatherer: ParamGatherer):
        super().__init__(buckets, masters, group, gatherer)
        self.grads: list[torch.Tensor | None] = [None] * len(self.buckets)  # this rank's, summed

    def reduced(self, i: int) -> torch.Tensor | None:
        return self.grads[i]

    def keep_reduced(self, i: int, grad: torch.Tensor) -> None:
        self.grads[i] = grad


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


def offload_bytes(params: float, world: int, compute: float, master: float = 4
                  ) -> dict[str, float]:
    """Where ZeRO-3 with its optimizer offloaded keeps a rank's state, from the padded value
    count `params` (all buckets): on the device the compute shard, `compute` bytes a value / N;
    in host memory the fp32 master and AdamW's two moments, 3 x `master` bytes / N (the
    gradient, `master` bytes / N, only from the copy down to the step). The host link a step:
    the gradient down, `master` bytes / N, and the new values up, `compute` bytes / N."""
    shard = params / world
    return {"device": compute * shard, "host": 3 * master * shard,
            "host_link": (master + compute) * shard}


def planned_offload(plan: "PlanInput") -> dict[str, float]:
    """The planner's ZeRO-3 + offload row: a GPU holds the compute shard (the weights' bytes a
    value / N) and, gathered, the root and two blocks, as ZeRO-3; the master and AdamW's state
    go to the host. Sent over the network and held gathered, ZeRO-3's (zero3_bytes, blocks of
    equal size); `host_link`, what crosses PCIe; `stepped`, the parameters the host's AdamW
    steps."""
    w, g, o = plan.state_bytes
    zero3 = zero3_bytes(plan.params, [plan.blocks / plan.layers] * plan.layers,
                        plan.embedding + plan.head, plan.gpus, w, g, o, plan.compute_bytes,
                        reduce=4)
    predicted = offload_bytes(plan.params, plan.gpus, plan.compute_bytes, w)
    return {"state": predicted["device"], "host": predicted["host"],
            "host_link": predicted["host_link"], "sent": zero3["sent"],
            "gathered": zero3["gathered"], "stepped": plan.params / plan.gpus}


def theory(buckets: list[Bucket], world: int, compute_bytes: int, master_bytes: int,
           gather_bytes: int, buffers_mb: float) -> dict:
    """offload_bytes from the buckets (padding included), and what a step sends: ZeRO-3's
    (zero3_bytes, the masters' dtype reduced, `gather_bytes` gathered)."""
    padded = sum(b.numel for b in buckets)
    predicted = offload_bytes(padded, world, compute_bytes, master_bytes)
    *blocks, root = (b.numel for b in buckets)
    sent = zero3_bytes(padded, blocks, root, world, master_bytes, master_bytes,
                       2 * master_bytes, gather_bytes, buffers_mb * 2**20)["sent"]
    return {"state_mb": predicted["device"] / 2**20,
            "device_state_mb": predicted["device"] / 2**20,
            "host_state_mb": predicted["host"] / 2**20,
            "host_link_mb": predicted["host_link"] / 2**20, "comm_mb": sent / 2**20}


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, on the device before it is copied to the host (default: "
                        "no clipping)")
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    param_dtype = torch.bfloat16 if args.dtype == "bf16" else None  # what autocast computes in
    buffers_mb = sum(b.numel() * b.element_size() for b in model.buffers()) / 2**20
    master_bytes = next(model.parameters()).element_size()
    opt = ZeRO3Offload(model, common.transformer_blocks(model), lr=args.lr,
                       max_grad_norm=args.clip_grad_norm, param_dtype=param_dtype)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    opt.wait_for_params()
    compute_bytes = opt.compute[0].element_size()
    device_mb = common.tensor_mb(opt.compute)
    host_mb = common.tensor_mb([*opt.masters, *(v for s in opt.state.values()
                                                for v in s.values() if torch.is_tensor(v)
                                                and v.dim())])
    common.record(args, topo, stats, baseline="optimized_zero3", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP, comm_mb=stats.comm_mb, stage=3,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  offloaded_to="host memory" if topo.device.type == "cuda" else
                  "host memory, which on a CPU-only host is the device's too",
                  device_state_mb=round(device_mb, 3), host_state_mb=round(host_mb, 3),
                  host_link_mb=round((opt.bytes_down + opt.bytes_up) / 2**20, 3),
                  # the state a rank's device holds, what offload shrinks (common.state_mb
                  # would count the host's masters and moments, not the compute shards)
                  state_mb=round(device_mb, 2),
                  theory=theory(opt.buckets, topo.world_size, compute_bytes, master_bytes,
                                opt.unsharded[0].element_size(), buffers_mb))


# The planner's row (report/planner.py reads this; the script never does): planned where the
# GPUs alone cannot hold ZeRO-3's state
PLANNED = [{"strategy": "ZeRO-3 + offload", "place": 45, "figures": planned_offload}]


if __name__ == "__main__":
    common.run_main(main)
