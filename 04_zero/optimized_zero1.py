"""ZeRO-1 by hand: each rank keeps AdamW's state for 1/N of the parameters and updates only those.

What it does: the parameters are moved into one flat buffer, cut into buckets (one per
transformer block, then one for the embeddings and final norm: the order in which backward
makes their gradients ready). Each bucket is padded to a multiple of the world size N, and rank
r owns the r-th 1/N of every bucket. Gradients accumulate into a second flat buffer laid out
the same way. After backward, each bucket's gradient is reduce-scattered: every rank receives
the sum over ranks of exactly the slice it owns (common.reduce_scatter: on gloo, whose own
reduce-scatter all-reduces the whole input, an all_to_all and a local sum). AdamW then
updates the owned slices only, so its two moments exist for 1/N of the model, and the updated
slices are all-gathered back into every rank's flat parameters. --clip-grad-norm clips by
the global norm: the all-reduced sum of each rank's squares over the values it owns, padding
left out, so each value counts once.
Why it helps: Adam's moments are 8 of the 16 bytes per parameter a replicated fp32 trainer
holds; sharding them saves 8(N-1)/N bytes per parameter on each rank for no extra
communication, since a reduce-scatter plus an all-gather move what one all-reduce moves.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero1.py --size small [--summary]
Look for:   `make zero report`: state MB = theory.state_mb, losses equal to baseline_zero's to
            float rounding, tokens/s close to it; optim_mb falls by N, params and grads do not.
            optimized_zero_pytorch.py runs PyTorch's ZeroRedundancyOptimizer beside it.
Theory:     per rank 4P + 4P + 8P/N bytes (params, grads, optimizer), P = parameter count,
            plus each bucket's padding (under N values); sent per step (N-1)/N x 4P
            reduce-scattered plus the same all-gathered: 2(N-1)/N x 4P, as DDP's all-reduce.
"""

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


def flatten(buckets: list[Bucket], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the parameters into one flat buffer and their gradients into another: each `p` and
    `p.grad` becomes a view, so backward accumulates straight into the flat gradients and an
    update of a flat slice is an update of the parameters."""
    total = buckets[-1].offset + buckets[-1].numel
    flat_params = torch.zeros(total, device=device)
    flat_grads = torch.zeros(total, device=device)
    for bucket in buckets:
        offset = bucket.offset
        for p in bucket.params:
            view = slice(offset, offset + p.numel())
            flat_params[view].copy_(p.detach().flatten())
            p.data = flat_params[view].view_as(p)
            p.grad = flat_grads[view].view_as(p)
            offset += p.numel()
    return flat_params, flat_grads


def owned_shards(buckets: list[Bucket], flat_params: torch.Tensor, flat_grads: torch.Tensor,
                 topo: common.Topology) -> list[nn.Parameter]:
    """The slices this rank owns, one per bucket, as the parameters AdamW updates: views, so an
    update lands in the flat parameters, and AdamW's moments exist for 1/N of the model. Their
    gradients: the same slices of the flat gradients, where the reduce-scatter leaves them."""
    shards = []
    for bucket in buckets:
        shard = nn.Parameter(bucket.owned(flat_params, topo.rank, topo.world_size))
        shard.grad = bucket.owned(flat_grads, topo.rank, topo.world_size)
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


def reduce_scatter_grads(buckets: list[Bucket], flat_grads: torch.Tensor,
                         topo: common.Topology) -> None:
    """Sum each bucket's gradient over ranks into the slice this rank owns, in place (the output
    is the input's own slice, which NCCL and gloo both allow; the rest is stale after), then
    average that slice: 1/N of the work of dividing the whole gradient first, as DDP does."""
    owned = [b.owned(flat_grads, topo.rank, topo.world_size) for b in buckets]
    works = [common.reduce_scatter(mine, b.whole(flat_grads), async_op=True)
             for mine, b in zip(owned, buckets, strict=True)]
    for work, mine in zip(works, owned, strict=True):
        work.wait()
        mine.div_(topo.world_size)


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
    flat_params, flat_grads = flatten(buckets, topo.device)
    shards = owned_shards(buckets, flat_params, flat_grads, topo)
    opt = torch.optim.AdamW(shards, lr=args.lr)
    gatherer = ParamGatherer(model, buckets, flat_params, topo)

    def train_step(inputs, targets):
        flat_grads.zero_()
        loss = model(inputs, targets)
        loss.backward()
        reduce_scatter_grads(buckets, flat_grads, topo)
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
    theory = {"params_mb": mb, "grads_mb": mb, "optim_mb": 2 * mb / n,
              "state_mb": 2 * mb + 2 * mb / n, "comm_mb": 2 * (n - 1) / n * sent_mb,
              "padding_mb_max": 4 * (n - 1) * len(buckets) / 2**20}
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, theory=theory, stage=1,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  **measured)
    if args.summary:
        common.print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                             theory=theory)


if __name__ == "__main__":
    common.run_main(main)
