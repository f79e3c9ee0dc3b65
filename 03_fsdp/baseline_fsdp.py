"""Every rank holds everything: DDP with AdamW, the replicated reference FSDP is measured against.

What it does: DistributedDataParallel as tuned in 01_ddp/optimized_ddp.py (25 MB buckets,
`gradient_as_bucket_view`, `static_graph`): each rank keeps the whole model, its whole
gradient (as views into DDP's buckets, so there is no second copy and the tensor count sees
the real gradient memory) and the whole AdamW state, and all-reduces the gradients each step.
Why it is the baseline: it is the fastest way to train a model that fits on every rank, and
its memory is what FSDP divides: in fp32 every rank holds 16 bytes per parameter (4 weight,
4 gradient, 8 for Adam's two moments), whatever the world size.
Run:        torchrun --nproc_per_node=2 03_fsdp/baseline_fsdp.py --size small
Look for:   state MB = theory.state_mb (16 x params), and the peak tensor memory and tokens/s
            that optimized_fsdp.py and optimized_fsdp_checkpoint.py are compared with in
            `make fsdp report`.
Theory:     state 16 x params bytes per rank; each rank sends 2(N-1)/N x 4 x params bytes a
            step (ring all-reduce).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


# Copied from 02_compression/baseline_compression.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               static_graph=True)


# Copied from 01_ddp/baseline_ddp.py: ddp_bytes
def ddp_bytes(params: float, world: int, weight: float, grad: float, optim: float
              ) -> dict[str, float]:
    """DDP's bytes a rank: every weight, gradient and optimizer value kept (`weight`, `grad`,
    `optim` bytes each; fp32 AdamW: 4, 4, 8); sent a step, the gradients ring-all-reduced."""
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params}
    return {**kept, "state": sum(kept.values()),
            "sent": common.ring_allreduce_mb(grad * params, world) * 2**20}


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, with torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    params = sum(p.numel() for p in model.parameters())
    predicted = ddp_bytes(params, topo.world_size, 4, 4, 8)  # fp32 weights, AdamW's 2 moments
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=stats.comm_mb, strategy="ddp", clip_grad_norm=args.clip_grad_norm,
                  theory={"state_mb": predicted["state"] / 2**20,
                          "comm_mb": predicted["sent"] / 2**20})


if __name__ == "__main__":
    common.run_main(main)
