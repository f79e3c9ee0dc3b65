"""PyTorch's own pipeline schedules on the same model, cut and batches: the side-by-side check.

What it does: the same stages as the hand-written scripts (the GPT's layers cut into p
contiguous stages, the tied embedding/head weight's gradients summed between the first and last
rank), run by torch.distributed.pipelining: a `PipelineStage` per rank and `ScheduleGPipe`
(`--schedule gpipe`, the default) or `Schedule1F1B` (`--schedule 1f1b`). The last stage hands
its logits to the schedule's loss function, which averages the micro-batches' gradients.
Why it is here: a schedule written by hand is checked against the library's. The losses must
match the hand-written one's to float rounding (the launch tests check it), and
`make pipeline report` puts the step times side by side.
Run:        torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_pytorch.py --size small
            torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_pytorch.py --schedule 1f1b
Look for:   the rows `optimized_pipeline_pytorch` (beside optimized_pipeline_gpipe) and
            `optimized_pipeline_pytorch --schedule 1f1b` (beside optimized_pipeline_1f1b).
Theory:     the same bubble as the hand-written schedule; torch records no timeline here.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def cut(n_layers: int, p: int) -> list[range]:
    """p contiguous stages whose sizes differ by at most one layer (as the hand-written ones)."""
    bounds = [round(r * n_layers / p) for r in range(p + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(p)]


def stage_module(layers: list[nn.Module]) -> nn.Sequential:
    """The layers as one module; the loss head becomes norm + head: torch computes the loss."""
    if isinstance(layers[-1], common.LossHead):
        layers = [*layers[:-1], layers[-1].ln_f, layers[-1].head]
    return nn.Sequential(*layers)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe",
                        help="torch.distributed.pipelining's schedule (default: gpipe)")
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="micro-batches m the batch is split into (default: 8)")
    parser.set_defaults(batch_size=0)  # 0: two sequences per micro-batch, as the others
    args = parser.parse_args()
    args.batch_size = args.batch_size or 2 * args.microbatches
    if args.model != "gpt":
        parser.error("05_pipeline cuts the GPT's layers into stages: use --model gpt")
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size {args.batch_size} does not split into --microbatches "
                     f"{args.microbatches}: use a multiple of it")
    layers = common.SIZES[args.size].n_layers + 2
    if int(os.environ.get("WORLD_SIZE", "1")) > layers:
        parser.error(f"--size {args.size} has {layers} layers, fewer than the "
                     f"{os.environ['WORLD_SIZE']} stages (processes): use fewer processes")
    topo = common.setup(args)
    p, m = topo.world_size, args.microbatches
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)
    layers = model.pipeline_layers()
    params = sum(q.numel() for q in model.parameters())
    mine = [layers[i] for i in cut(len(layers), p)[topo.rank]]
    module = stage_module(mine)
    autocast_dtype = model.autocast_dtype
    del model, layers
    stage = PipelineStage(module, topo.rank, p, topo.device)
    pipe = SCHEDULES[args.schedule](stage, m, loss_fn=loss_fn)
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    tied_weight = mine[0].tok_emb.weight if topo.rank == 0 else \
        mine[-1].head.weight if topo.rank == p - 1 else None
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)  # first, so the gradients still exist when state is counted
        losses = []
        with torch.autocast(topo.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            pipe.step(*([tokens] if topo.rank == 0 else []),
                      **({"target": targets, "losses": losses} if topo.rank == p - 1 else {}))
        if tied_weight is not None and tied is not None:
            dist.all_reduce(tied_weight.grad, group=tied)
        opt.step()
        return torch.stack(losses).mean() if losses else torch.zeros((), device=topo.device)

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(module, opt),
                               loss_rank=p - 1, dp_world=1)
    common.record(args, topo, stats, baseline="baseline_pipeline", model=module, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=1e-5 if args.dtype == "fp32" else 5e-2,
                  schedule=f"torch {args.schedule}", microbatches=m, stages=p,
                  theory={"bubble_uniform": round((p - 1) / (m + p - 1), 4)})


if __name__ == "__main__":
    common.run_main(main)
