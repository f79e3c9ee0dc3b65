"""ZeRO-3 by hand: ZeRO-2, and each rank keeps only its 1/N of the parameters too.

What it does: the buckets and ownership of optimized_zero1.py (one bucket per transformer block,
one for the embeddings and final norm). At rest a rank holds only its 1/N slices of the
parameters, gradients and AdamW state; a bucket's full parameters are views into a buffer whose
storage exists only while it is needed. Hooks all-gather a block's parameters just before its
forward and free them right after, gather them again just before its backward (each gather
starting the next block's), and, as in ZeRO-2, reduce-scatter its gradients as soon as backward
has produced them, freeing the parameters then. The embeddings and final norm, used at both
ends of the step, stay gathered from forward's start to backward's end, as FSDP2's root does.
AdamW updates the owned slices in place: nothing to all-gather after the step.
--clip-grad-norm as in ZeRO-1: from the owned values, each counted once.
Why it helps: memory per rank falls to 16 bytes per parameter / N, plus about two blocks and
the embeddings in full, so a model N times larger than one rank's memory trains; the price, one
more all-gather of the parameters a step (1.5x ZeRO-2's traffic), prefetching hides where it can.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero3.py --size small [--summary]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, the lowest peak of the three; optimized_zero_pytorch.py --stage 3
            runs FSDP2's fully_shard on the same blocks beside it.
Theory:     per rank 4P/N + 4P/N + 8P/N = 16P/N bytes (params, grads, optimizer), P = parameter
            count, plus padding and the blocks gathered at a time; sent per step (N-1)/N x 4
            bytes x (3 x the blocks' parameters + 2 x the embeddings' and final norm's): two
            all-gathers and a reduce-scatter, against ZeRO-2's 2(N-1)/N x 4P.
"""

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Exact in fp32: the same sums, in another order at most. Under bf16 autocast (GPU) such
# last-bit differences grow through the low-precision steps, as for FSDP in 03_fsdp.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}


# Copied from 04_zero/optimized_zero1.py: units_in_gradient_order
def units_in_gradient_order(model: common.GPT) -> list[list[nn.Parameter]]:
    """The parameters grouped by block, in the order backward completes their gradients: the
    last block first, the embeddings and final norm last (the tied embedding's gradient is only
    complete when backward reaches the input)."""
    blocks = [list(block.parameters()) for block in reversed(model.blocks)]
    in_blocks = {p for unit in blocks for p in unit}
    return blocks + [[p for p in model.parameters() if p not in in_blocks]]


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


def shard_params(buckets: list[Bucket], topo: common.Topology
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Keep this rank's slice of every bucket in one buffer of 1/N of the model; each parameter
    becomes a view into its bucket's unsharded buffer, whose storage is freed until gathered.
    Made with `p.data = ...`, the views keep their own autograd version counters, so refilling
    the storage does not trip the check on the weights autograd saved for backward (a plain
    slice shares the buffer's counter; FSDP2 refills under
    torch.autograd._unsafe_preserve_version_counter instead)."""
    n = topo.world_size
    param_shards = torch.zeros(sum(b.numel for b in buckets) // n, device=topo.device)
    unsharded = []
    for bucket in buckets:
        flat = torch.zeros(bucket.numel, device=topo.device)
        offset = 0
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat[view].copy_(p.detach().flatten())
            p.data = flat[view].view_as(p)
            offset += p.numel()
        k = bucket.numel // n
        bucket.shard(param_shards, n).copy_(flat[topo.rank * k:(topo.rank + 1) * k])
        flat.untyped_storage().resize_(0)
        unsharded.append(flat)
    return param_shards, unsharded


def owned_shards(buckets: list[Bucket], param_shards: torch.Tensor,
                 topo: common.Topology) -> list[nn.Parameter]:
    """The slices this rank owns, one per bucket, as the parameters AdamW updates: views, so an
    update lands in the parameter shards, and AdamW's moments exist for 1/N of the model. Their
    gradients come from GradReducer."""
    return [nn.Parameter(b.shard(param_shards, topo.world_size)) for b in buckets]


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
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's `grads` together: the global 2-norm is
    the square root of the ranks' sums of squares (one fp32 all-reduce), which counts each value
    of the gradient exactly once when each rank passes only the values it owns; every rank then
    scales its values by min(1, max_norm / (norm + 1e-6)), torch's formula. Returns the norm."""
    squares = torch.stack([g.float().square().sum() for g in grads]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm


class ParamGatherer:
    """Hooks that hold a bucket's parameters in full only around its compute. Before a block's
    forward: gather it (if its prefetch has not) and start the next block's all-gather; after:
    free it, and hook its output's gradient, which arrives just before backward enters the
    block, to gather it again and start the previous block's. The embeddings and final norm are
    gathered before the model's forward and freed by GradReducer after their backward."""

    def __init__(self, model: common.GPT, shards: list[nn.Parameter],
                 unsharded: list[torch.Tensor]):
        self.shards, self.unsharded = shards, unsharded
        self.pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather in flight
        root, last = len(shards) - 1, len(model.blocks) - 1
        model.register_forward_pre_hook(lambda *_: self.gather(root, prefetch=last))
        for j, block in enumerate(model.blocks):
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
        self.pending[i] = common.all_gather_single(buffer, self.shards[i].detach(), async_op=True)

    def gather(self, i: int, prefetch: int | None = None) -> None:
        """Bucket i's parameters in full when this returns; the next one's on their way."""
        self.start_gather(i)
        if prefetch is not None:
            self.start_gather(prefetch)
        if i in self.pending:
            self.pending.pop(i).wait()

    def after_forward(self, i: int, has_previous: bool, out: torch.Tensor) -> None:
        self.free(i)
        # The gradient of a block's output arrives just before backward enters the block.
        out.register_hook(lambda _: self.gather(i, prefetch=i + 1 if has_previous else None))

    def free(self, i: int) -> None:
        self.unsharded[i].untyped_storage().resize_(0)


class GradReducer:
    """Backward hooks that keep only this rank's slice of the gradient. As soon as backward has
    produced a parameter's gradient it is copied into its bucket's buffer, and the parameter's
    .grad becomes a view there (the tensor autograd made is freed). When a bucket's last
    gradient is in, the bucket is reduce-scattered at once, while backward goes on with the
    buckets before it, into the gradient of this rank's shard; once that is done the bucket, the
    full gradient of its parameters, is dropped. Summed over ranks, then averaged on the shard:
    1/N of the work of dividing the whole gradient first. Backward is then done with the
    bucket's parameters, so they are freed as soon as its reduce-scatter starts."""

    def __init__(self, buckets: list[Bucket], shards: list[nn.Parameter], topo: common.Topology,
                 gatherer: ParamGatherer):
        self.buckets, self.shards, self.topo = buckets, shards, topo
        self.gatherer = gatherer
        self.buffers: dict[int, torch.Tensor] = {}  # bucket index -> its full gradient
        self.copied: dict[int, int] = {}  # bucket index -> gradients copied into it so far
        self.in_flight: list[tuple[dist.Work, int]] = []  # reduce-scatters and their buckets
        for i, bucket in enumerate(buckets):
            offset = 0
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(functools.partial(self.add_grad, i, offset))
                offset += p.numel()

    def add_grad(self, i: int, offset: int, p: nn.Parameter) -> None:
        self.drop_reduced()
        bucket = self.buckets[i]
        if i not in self.buffers:
            self.buffers[i] = torch.empty(bucket.numel, device=p.device)
            self.buffers[i][sum(q.numel() for q in bucket.params):].zero_()  # the padding
            self.copied[i] = 0
        grad = self.buffers[i][offset:offset + p.numel()].view_as(p)
        grad.copy_(p.grad)
        p.grad = grad
        self.copied[i] += 1
        if self.copied[i] == len(bucket.params):
            shard = self.shards[i]
            shard.grad = torch.empty_like(shard)
            work = common.reduce_scatter(shard.grad, self.buffers[i], async_op=True)
            self.in_flight.append((work, i))
            self.gatherer.free(i)

    def drop_reduced(self, wait: bool = False) -> None:
        """Drop the buckets whose reduce-scatter is done; with `wait`, all of them."""
        pending = []
        for work, i in self.in_flight:
            if wait:
                work.wait()
            elif not work.is_completed():
                pending.append((work, i))
                continue
            del self.buffers[i], self.copied[i]
            for p in self.buckets[i].params:
                p.grad = None
        self.in_flight = pending

    def wait(self) -> None:
        """After backward: every bucket reduced and dropped, every shard's gradient averaged."""
        self.drop_reduced(wait=True)
        for i, shard in enumerate(self.shards):
            if shard.grad is None:
                raise RuntimeError(f"bucket {i} got no gradient: these hooks need every "
                                   "parameter to take part in every step")
            shard.grad.div_(self.topo.world_size)


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step (default: no clipping)")
    parser.add_summary_flag()
    args = parser.parse_args()
    if args.model != "gpt":
        parser.error("04_zero buckets the GPT's blocks: use --model gpt")
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    n = topo.world_size
    buckets = partition(units_in_gradient_order(model), n)
    param_shards, unsharded = shard_params(buckets, topo)
    shards = owned_shards(buckets, param_shards, topo)
    gatherer = ParamGatherer(model, shards, unsharded)
    reducer = GradReducer(buckets, shards, topo, gatherer)
    opt = torch.optim.AdamW(shards, lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        reducer.wait()
        if args.clip_grad_norm:
            clip_grad_norm_(owned_grads(buckets, shards, topo.rank), args.clip_grad_norm)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    # State from the model's shape, not from the buckets: they add padding, under N values a
    # bucket (`padding_mb_max`). Every value of every bucket is sent, padding included.
    param_count = common.gpt_param_count(common.SIZES[args.size], args.seq_len)
    mb = 4 * param_count / 2**20
    gathers = [2] * len(model.blocks) + [1]  # per bucket and step; the root's stay gathered
    theory = {"params_mb": mb / n, "grads_mb": mb / n, "optim_mb": 2 * mb / n,
              "state_mb": 4 * mb / n,
              "comm_mb": sum((g + 1) * (n - 1) / n * 4 * b.numel / 2**20
                             for g, b in zip(gathers, buckets, strict=True)),
              "padding_mb_max": 4 * (n - 1) * len(buckets) / 2**20}
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, theory=theory, stage=3,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured)
    if args.summary:
        common.print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                             theory=theory)


if __name__ == "__main__":
    common.run_main(main)
