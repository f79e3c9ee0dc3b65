"""Gradient communication uncompressed: DDP's fp32 bucketed all-reduce, tuned as in 01_ddp.

What it does: DistributedDataParallel packs the gradients into ~25 MB buckets and all-reduces
each in fp32 (4 bytes a value) as soon as it is complete, with `gradient_as_bucket_view` and
`static_graph` as in 01_ddp/optimized_ddp.py. Compression is judged against this, a good DDP,
never against a per-tensor strawman: the optimized scripts keep the same DDP wrapper and swap
only the communication hook, the function that turns a bucket of local gradients into the
averaged one.
Why it is the baseline: it sends every bit. On one node the all-reduce costs little (NVLink,
or loopback here); across nodes on Ethernet the gradient bytes dominate the step, and that
is what INT8 (4x fewer bytes) and PowerSGD (4.7x fewer at `small` at its default) buy back.
Run:        torchrun --nproc_per_node=2 02_compression/baseline_compression.py --size small
            make compression LINK=1gbit     (the same launch over a rate-limited loopback)
Look for:   comm MB/step, the figure the compressed scripts divide; with LINK=1gbit the step
            time grows by about the bytes over the link rate, which compression wins back.
Theory:     a ring all-reduce makes each rank send 2(N-1)/N x 4 bytes x params per step; the
            communication share of a step grows as tokens per rank per step shrink (compute
            is ~6 x params x tokens FLOPs, the bytes do not depend on tokens), and as the link
            slows.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


# Copied from 01_ddp/optimized_ddp.py: wrap_ddp, changed: no --accum, so the static graph always
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               static_graph=True)


def add_long_run_flag(parser: argparse.ArgumentParser) -> None:
    """`--long-run`: 110 steps instead of the folder's 25 (10 untimed, 100 timed), long enough
    for training to settle, where PowerSGD is meant to run; a --warmup or --steps given still
    wins. Added after the script's other flags (it reads the command line to set defaults)."""
    parser.add_argument("--long-run", action="store_true",
                        help="110 steps (10 untimed, 100 timed) instead of 25: the long pair of "
                             "`make compression`, the baseline beside PowerSGD once training "
                             "has settled")
    if parser.parse_known_args()[0].long_run:
        parser.set_defaults(warmup=10, steps=100)


def main():
    parser = common.parser(__doc__)
    parser.set_defaults(warmup=6, steps=19)  # the folder's 25 steps, as PowerSGD's warm-up needs
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    add_long_run_flag(parser)
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    buckets = common.ddp_bucket_bytes(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=common.ring_allreduce_mb(sum(buckets), topo.world_size),
                  collectives_per_step=len(buckets),
                  theory={"comm_mb": common.ring_allreduce_mb(grad_bytes, topo.world_size)})


if __name__ == "__main__":
    common.run_main(main)
