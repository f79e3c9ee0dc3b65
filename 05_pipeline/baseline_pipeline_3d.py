"""Data parallelism alone, at the 3-D run's world: the reference optimized_pipeline_3d.py meets.

What it does: DistributedDataParallel as tuned in 01_ddp/optimized_ddp.py (25 MB buckets,
gradients as views into them, a static graph) on every rank of the world
optimized_pipeline_3d.py runs on, each rank its share of the same global batch. Every rank
holds the whole model, its gradient and AdamW's state, and all-reduces the gradients each step.
Why it is this row's baseline: the folder's baseline_pipeline.py is model parallelism alone (one
batch through p stages), which a 3-D mesh also divides by dp and tp; the fair question for a
composition is whether it trains the same model to the same losses as plain data parallelism
on the same ranks and batch, and what it costs or saves beside it.
Run:        torchrun --nproc_per_node=8 05_pipeline/baseline_pipeline_3d.py --size small
Look for:   `make pipeline report`: losses equal to optimized_pipeline_3d's; its state MB (16 x
            params on every rank) against the 3-D run's 16 x params / (pp x dp x tp).
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


def main():
    parser = common.parser(__doc__, skips={
        "resnet": "the 3-D run it is the baseline of cuts a decoder into stages: --model gpt or "
                  "llama"})
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, with torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    parser.set_defaults(steps=8, warmup=3)  # optimized_pipeline_3d.py's
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, bucket_mb=25.0)
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
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  comm_mb=stats.comm_mb, strategy="ddp", clip_grad_norm=args.clip_grad_norm,
                  theory={"state_mb": 16 * params / 2**20,
                          "comm_mb": common.ring_allreduce_mb(4 * params, topo.world_size)})


if __name__ == "__main__":
    common.run_main(main)
