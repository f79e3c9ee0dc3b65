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
            params on every rank) against the 3-D run's 16 x params / (pp x dp x tp). Where the
            world holds no default 3-D mesh (1-2 GPUs), it skips with the 3-D run's reason.
Theory:     state 16 x params bytes per rank; each rank sends 2(N-1)/N x 4 x params bytes a
            step (ring all-reduce).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


# Copied from 03_fsdp/optimized_fsdp_tp.py: tp_problem
def tp_problem(args: argparse.Namespace, tp: int, world: int) -> str | None:
    """Why a (world / tp) x tp mesh cannot train --size's decoder: a TP rank needs whole heads
    (the Llama: whole KV heads) and an even share of the MLP, the vocabulary and the sequence.
    No padding: a checkpoint's shapes must not depend on --tp."""
    if world % tp:
        return f"--tp {tp} does not divide the {world} processes: use a divisor of {world}"
    size = common.SIZES[args.size]
    widths = {"heads": size.n_heads, "MLP units": 4 * size.d_model,
              "vocabulary": size.vocab_size, "sequence positions": args.seq_len}
    if args.model == "llama":
        widths.update({"KV heads": size.n_kv_heads,
                       "MLP units": size.llama_ffn})
    for what, width in widths.items():
        if width % tp:
            return (f"--tp {tp} does not divide the {width} {what} of --size {args.size}: use "
                    f"a --tp that divides {width}")
    return None


# Copied from 03_fsdp/optimized_fsdp_tp.py: default_tp
def default_tp(args: argparse.Namespace, world: int, node: int, stages: int = 1) -> int | None:
    """--tp's default: the largest tp >= 2 that divides a node's `node` processes (a TP group
    stays on one node's links) and that --size's model splits on a stage's `world / stages`
    ranks (tp_problem: heads, KV heads, ...), leaving dp >= 2 where the world has room for it,
    dp 1 where not; None where no tp >= 2 fits."""
    fits = [t for t in range(node, 1, -1) if node % t == 0 and world % (stages * t) == 0
            and tp_problem(args, t, world // stages) is None]
    return max(fits, key=lambda t: (world // (stages * t) >= 2, t), default=None)


# Copied from 03_fsdp/optimized_fsdp_tp.py: node_size
def node_size(world: int) -> int:
    """The processes a TP group may span: a node's GPUs on CUDA; on CPU 2, where more would
    only share the same cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torch.cuda.is_available() else 2


def default_3d_tp(args: argparse.Namespace, world: int, pp: int = 2) -> int:
    """The tp of the 3-D run's default mesh, pp x dp x tp with tp >= 2 (default_tp's), or Skip
    where `world` processes hold none: the 3-D run skips then, and its baseline with it, for the
    same reason (a DDP row with no 3-D row beside it compares nothing)."""
    node = node_size(world)
    if tp := default_tp(args, world, node, stages=pp):
        return tp
    raise common.Skip(f"a 3-D mesh of pp {pp} x dp x tp >= 2 (tp dividing a node's {node} "
                      f"processes and the heads) does not fit {world} processes: launch a "
                      f"multiple of {2 * pp} (or give optimized_pipeline_3d.py --tp 1)")


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
    parser = common.parser(__doc__, skips={
        "resnet": "the 3-D run it is the baseline of cuts a decoder into stages: --model gpt or "
                  "llama",
        "moe": "the 3-D run it is the baseline of splits a stage's MLP as one SwiGLU by TP, and "
               "a MoE's is a router and experts: --model gpt or llama"})
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, with torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    parser.set_defaults(steps=6, warmup=3)  # optimized_pipeline_3d.py's
    args = parser.parse_args()
    default_3d_tp(args, common.launch_world_size())  # skips where the 3-D run skips
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
    predicted = ddp_bytes(params, topo.world_size, 4, 4, 8)  # fp32 weights, AdamW's 2 moments
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=stats.comm_mb, strategy="ddp", clip_grad_norm=args.clip_grad_norm,
                  theory={"state_mb": predicted["state"] / 2**20,
                          "comm_mb": predicted["sent"] / 2**20})


if __name__ == "__main__":
    common.run_main(main)
