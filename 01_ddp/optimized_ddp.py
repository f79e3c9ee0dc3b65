"""DDP, tuned: bucketed gradient all-reduce overlapped with backward, and no-sync accumulation.

What it does: DistributedDataParallel hooks every parameter's gradient. Gradients are packed
into buckets in reverse order of use; as soon as a bucket is full its all-reduce starts
asynchronously while backward keeps computing the earlier layers' gradients.
`gradient_as_bucket_view` makes each .grad a view into its bucket, so there is no copy into
and out of the communication buffer (and one gradient-sized buffer less in memory);
`static_graph` declares that every step uses the same parameters in the same order, which
DDP needs for activation checkpointing and lets it drop its per-step unused-parameter search
(off with --accum: see wrap_ddp).
With `--accum k` the per-rank batch is split into k micro-batches; the first k-1 run under
`no_sync()`, which only accumulates local gradients, and the last one all-reduces the sum
once. Dividing each micro-batch loss by k makes the sum the full-batch gradient (to rounding).
Why it helps: a few large collectives instead of one per tensor (the fixed latency is paid
once per bucket, not 76 times for `small`), and on GPUs the communication hides behind the
rest of backward. Accumulation fits a large batch in k smaller activation footprints and
still sends one all-reduce per optimizer step.
Run:        torchrun --nproc_per_node=2 01_ddp/optimized_ddp.py --size small [--accum 2]
Look for:   `make ddp report`: speedup over baseline_ddp at identical losses (max Δloss at
            float rounding: the same sums, grouped differently), the same comm MB/step in a
            handful of collectives.
Theory:     the same 2(N-1)/N x 4 bytes x params per optimizer step as the baseline, in
            about ceil(bytes / bucket) collectives (DDP never splits a tensor across buckets);
            with --accum k, k times fewer bytes than all-reducing every micro-batch.
"""

import math
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# The same sums grouped differently (buckets, micro-batches): fp32 rounding. Under bf16
# autocast a last-bit difference in a weight can flip an activation's bf16 rounding, so the
# losses may drift by bf16's resolution instead.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}


def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float, accum: int,
             group: dist.ProcessGroup | None = None) -> DDP:
    """The technique in one call: bucketed, overlapped, no gradient copy into the buckets; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               # static_graph with no_sync() crashes in the reducer and, patched past that, stops
               # all-reducing after the first step (pytorch/pytorch#143580, fix pending in
               # #187732): keep it for the plain step only.
               static_graph=accum == 1)


def accumulate_and_reduce(model: DDP, inputs, targets, accum: int) -> torch.Tensor:
    """Forward/backward over `accum` micro-batches; only the last one all-reduces."""
    total = 0.0
    micro_batches = list(zip(inputs.chunk(accum), targets.chunk(accum), strict=True))
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():
            loss = model(x, y) / accum
            loss.backward()
        total = total + loss.detach()
    return total


# Copied from 01_ddp/baseline_ddp.py: ddp_bytes
def ddp_bytes(params: float, world: int, weight: float, grad: float, optim: float
              ) -> dict[str, float]:
    """DDP's bytes a rank: every weight, gradient and optimizer value kept (`weight`, `grad`,
    `optim` bytes each; fp32 AdamW: 4, 4, 8); sent a step, the gradients ring-all-reduced."""
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params}
    return {**kept, "state": sum(kept.values()),
            "sent": common.ring_allreduce_mb(grad * params, world) * 2**20}


def planned_ddp(plan: "PlanInput") -> dict[str, float]:
    """The planner's DDP row, the simplest: the whole model and its state on every GPU, and
    under bf16 autocast its bf16 copy."""
    return {**ddp_bytes(plan.params, plan.gpus, *plan.state_bytes),
            "cast": plan.cast(plan.params), "fp32_residual": True}


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.add_argument("--accum", type=common.int_at_least(1), default=1,
                        help="micro-batches per optimizer step")
    args = parser.parse_args()
    if args.batch_size % args.accum:
        parser.error(f"--batch-size {args.batch_size} does not split into --accum {args.accum} "
                     f"micro-batches: use an --accum that divides the batch size")
    if args.model == "resnet" and args.batch_size // args.accum < 2:
        parser.error(f"--accum {args.accum} leaves micro-batches of one image, which BatchNorm "
                     f"cannot normalise: use a smaller --accum")
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, args.bucket_mb, args.accum)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = accumulate_and_reduce(model, inputs, targets, args.accum)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    buckets = common.ddp_bucket_bytes(model)
    value_bytes = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    grad_bytes = value_bytes * params
    theory = {"comm_mb": ddp_bytes(params, topo.world_size, value_bytes, value_bytes,
                                   2 * value_bytes)["sent"] / 2**20,
              "collectives": math.ceil(grad_bytes / (args.bucket_mb * 2**20))}
    if args.accum > 1:
        theory["comm_mb_without_no_sync"] = args.accum * theory["comm_mb"]
    common.record(args, topo, stats, baseline="baseline_ddp", model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=common.ring_allreduce_mb(sum(buckets), topo.world_size),
                  collectives_per_step=len(buckets), accum=args.accum,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  theory=theory)


# The planner's rows (report/planner.py reads this; the script never does): DDP first, the
# simplest, to which the planner's ties go.
PLANNED = [{"strategy": "DDP", "place": 10, "figures": planned_ddp}]


if __name__ == "__main__":
    common.run_main(main)
