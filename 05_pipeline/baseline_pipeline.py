"""Naive model parallelism: the layers cut across ranks, the whole batch through them at once.

What it does: the GPT's layers are cut into p stages of about equal cost, one per rank. The
whole batch goes forward from rank 0 to rank p-1 and then backward from rank p-1 to rank 0: a
rank receives its input, runs its layers and sends the output on (blocking send/recv). The tied
embedding/head weight lives on the first and last ranks; its two gradients are summed between
them each step (as Megatron-LM does), so it trains the unsplit model, exactly.
Why it is the baseline: it is what splitting a model too large for one device gives first, and
at any moment all ranks but one wait: each is idle (p-1)/p of the step. The pipelines
(optimized_pipeline_gpipe.py first) cut the batch into micro-batches to fill that time.
Run:        torchrun --nproc_per_node=2 05_pipeline/baseline_pipeline.py --size small
Look for:   `bubble` near (p-1)/p, and one step's timeline: one rank busy at a time.
Theory:     bubble (p-1)/p: the ranks' forwards and backwards run one after another, so the step
            is their sum, whatever each costs. Activations: the whole batch's, on every rank.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


def forward_backward(layers: nn.ModuleList, tokens: torch.Tensor, targets: torch.Tensor,
                     topo: common.Topology, shape: tuple[int, ...],
                     autocast_dtype: torch.dtype | None
                     ) -> tuple[torch.Tensor, tuple[float, list[tuple]]]:
    """The whole batch through this rank's stage, forward and then backward, each waiting for
    its input from the neighbouring rank. Returns the loss (on the last rank, else 0) and the
    step on this rank's clock: its start, and the forward and the backward, each timed from its
    input's arrival to its end."""
    rank, last = topo.rank, topo.world_size - 1

    def now() -> float:
        if topo.device.type == "cuda":
            torch.cuda.current_stream(topo.device).synchronize()
        return time.perf_counter()

    step_start = now()

    x = tokens
    if rank > 0:
        x = torch.empty(shape, device=topo.device)
        dist.recv(x, rank - 1)
        x.requires_grad_()
    start = now()
    with torch.autocast(topo.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = x
        for layer in layers:
            out = layer(out, targets) if isinstance(layer, common.LossHead) else layer(out)
    timeline = [("F", 0, rank, start, now())]
    grad = None
    if rank < last:
        dist.send(out.detach(), rank + 1)
        grad = torch.empty(shape, device=topo.device)
        dist.recv(grad, rank + 1)
    start = now()
    out.backward(grad)
    timeline.append(("B", 0, rank, start, now()))
    if rank > 0:
        dist.send(x.grad, rank - 1)
    return (out.detach() if rank == last else torch.zeros((), device=topo.device)), \
        (step_start, timeline)


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: comm_theory_mb
def comm_theory_mb(shape: tuple[int, ...], m: int, tied: int) -> float:
    """What rank 0 sends a step: each micro-batch's activations to rank 1, and its share of the
    tied weight's gradient all-reduce with the last rank (a group of two: the tensor once).
    4 bytes a value: the residual stream between blocks stays fp32, under autocast too."""
    return (m * 4 * shape[0] * shape[1] * shape[2] + 4 * tied) / 2**20


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="the pipelines' m: sets the default batch only (4 sequences per "
                             "micro-batch, as theirs), which this baseline runs in one piece")
    parser.set_defaults(batch_size=0)
    parser.set_defaults(steps=8, warmup=3)  # as the pipelines'
    args = parser.parse_args()
    args.batch_size = args.batch_size or 4 * args.microbatches
    if args.model != "gpt":
        parser.error("05_pipeline cuts the GPT's layers into stages: use --model gpt")
    world = common.launch_world_size()
    common.skip_unless_pipelined(world, world, args.size)
    topo = common.setup(args)
    p = topo.world_size
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    params, params_tied = sum(q.numel() for q in model.parameters()), model.tok_emb.weight.numel()
    mine = nn.ModuleList(model.pipeline_stages(p)[topo.rank])
    shape = (args.batch_size, args.seq_len, model.tok_emb.embedding_dim)
    autocast_dtype = model.autocast_dtype
    del model  # the other ranks' layers are freed: a rank holds its stage only
    tied = dist.new_group([0, p - 1])
    tied_weight = mine[0].tok_emb.weight if topo.rank == 0 else \
        mine[-1].head.weight if topo.rank == p - 1 else None
    opt = torch.optim.AdamW(mine.parameters(), lr=args.lr)
    timelines = []

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss, timeline = forward_backward(mine, tokens, targets, topo, shape, autocast_dtype)
        timelines.append(timeline)
        if tied_weight is not None:
            dist.all_reduce(tied_weight.grad, group=tied)  # embedding's + head's gradient
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(mine, opt),
                               loss_rank=p - 1, dp_world=1)
    steps, measured, _, _ = common.gather_timelines(timelines[args.warmup:], 1, args, topo)
    common.record(args, topo, stats, baseline=None, model=mine, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=params, schedule="naive",
                  microbatches=1, stages=p, timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4),
                  theory={"bubble": round((p - 1) / p, 4),
                          "comm_mb": comm_theory_mb(shape, 1, params_tied)})


if __name__ == "__main__":
    common.run_main(main)
