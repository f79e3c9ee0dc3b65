"""ZeRO-2 by hand: ZeRO-1, and each rank keeps the gradient of its 1/N only.

What it does: the same flat parameters, buckets and ownership as optimized_zero1.py (rank r owns
the r-th 1/N of every bucket, buckets in the order backward completes their gradients). The
gradients change: a hook on each parameter copies its gradient into its bucket's buffer as soon
as backward has produced it, and frees it; when a bucket's last gradient is in, the bucket is
reduce-scattered at once, while backward computes the buckets before it, and only this rank's
summed slice is kept. The bucket's buffer is dropped when its reduce-scatter is done. AdamW
updates the owned slices, and they are all-gathered into every rank's parameters, as in ZeRO-1.
--clip-grad-norm clips by the global norm as ZeRO-1 does: from the owned values, once each.
Why it helps: after ZeRO-1 the full gradient (4 bytes per parameter) is the largest thing a
rank holds besides the weights; now a rank holds a full gradient only for the buckets being
filled or reduced, and 1/N of it at rest, for the same communication as ZeRO-1 and DDP.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero2.py --size small [--summary]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, tokens/s close to it; grads_mb falls by N too, and the peak's
            `grads` share (memory.grads in the record) is far below a full gradient.
Theory:     per rank 4P + 4P/N + 8P/N bytes (params, grads, optimizer), P = parameter count,
            plus padding and the buckets in flight during backward; sent per step
            (N-1)/N x 4P reduce-scattered plus the same all-gathered: 2(N-1)/N x 4P.
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


def flatten(buckets: list[Bucket], device: torch.device) -> torch.Tensor:
    """Move the parameters into one flat buffer: each `p` becomes a view, so an update of a flat
    slice is an update of the parameters."""
    total = buckets[-1].offset + buckets[-1].numel
    flat_params = torch.zeros(total, device=device)
    for bucket in buckets:
        offset = bucket.offset
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat_params[view].copy_(p.detach().flatten())
            p.data = flat_params[view].view_as(p)
            offset += p.numel()
    return flat_params


def owned_shards(buckets: list[Bucket], flat_params: torch.Tensor,
                 topo: common.Topology) -> list[nn.Parameter]:
    """The slices this rank owns, one per bucket, as the parameters AdamW updates: views, so an
    update lands in the flat parameters, and AdamW's moments exist for 1/N of the model. Their
    gradients come from GradReducer."""
    return [nn.Parameter(b.owned(flat_params, topo.rank, topo.world_size)) for b in buckets]


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


# Copied from 04_zero/optimized_zero1.py: ParamGatherer
class ParamGatherer:
    """All-gathers every rank's updated slices into every rank's parameters, overlapped with the
    next forward (Megatron-LM's distributed optimizer does the same: --overlap-param-gather).
    `start`, after the step, launches every bucket's all-gather in the order forward uses them;
    a hook before each block (before the model, for the embeddings) waits for that block's
    bucket only. In place: each rank's input is its own slice of the output. (On GPU, timed
    with the device synchronised after each step, the all-gathers finish inside the step.)"""

    def __init__(self, model: common.GPT, buckets: list[Bucket], flat_params: torch.Tensor,
                 topo: common.Topology):
        self.buckets, self.flat_params, self.topo = buckets, flat_params, topo
        self.pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather in flight
        root, last = len(buckets) - 1, len(model.blocks) - 1
        model.register_forward_pre_hook(lambda *_: self.wait(root))
        for j, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda *_, i=last - j: self.wait(i))

    def start(self) -> None:
        rank, world = self.topo.rank, self.topo.world_size
        for i in reversed(range(len(self.buckets))):  # the embeddings' first: forward's order
            bucket = self.buckets[i]
            self.pending[i] = common.all_gather_single(
                bucket.whole(self.flat_params), bucket.owned(self.flat_params, rank, world),
                async_op=True)

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
    buckets before it, into the gradient of this rank's shard; once that is done the bucket, the
    full gradient of its parameters, is dropped. Summed over ranks, then averaged on the shard:
    1/N of the work of dividing the whole gradient first."""

    def __init__(self, buckets: list[Bucket], shards: list[nn.Parameter], topo: common.Topology):
        self.buckets, self.shards, self.topo = buckets, shards, topo
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
    flat_params = flatten(buckets, topo.device)
    shards = owned_shards(buckets, flat_params, topo)
    gatherer = ParamGatherer(model, buckets, flat_params, topo)
    reducer = GradReducer(buckets, shards, topo)
    opt = torch.optim.AdamW(shards, lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        reducer.wait()
        if args.clip_grad_norm:
            clip_grad_norm_(owned_grads(buckets, shards, topo.rank), args.clip_grad_norm)
        opt.step()
        gatherer.start()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    gatherer.wait_all()  # the last step's parameters, before anything reads them
    # State from the model's shape, not from the buckets: they add padding, under N values a
    # bucket (`padding_mb_max`). Every value of every bucket is sent, padding included.
    param_count = common.gpt_param_count(common.SIZES[args.size], args.seq_len)
    mb, sent_mb = 4 * param_count / 2**20, 4 * sum(b.numel for b in buckets) / 2**20
    theory = {"params_mb": mb, "grads_mb": mb / n, "optim_mb": 2 * mb / n,
              "state_mb": mb + 3 * mb / n, "comm_mb": 2 * (n - 1) / n * sent_mb,
              "padding_mb_max": 4 * (n - 1) * len(buckets) / 2**20}
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, theory=theory, stage=2,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured)
    if args.summary:
        common.print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                             theory=theory)


if __name__ == "__main__":
    common.run_main(main)
