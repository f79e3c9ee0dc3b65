"""Data parallelism by hand: broadcast the weights once, all-reduce every gradient after backward.

What it does: every rank holds a full copy of the model and trains on its own slice of the
global batch. Rank 0's initial weights are broadcast so all copies start equal; after the
backward pass each gradient tensor is summed across ranks with its own all-reduce and divided by
the world size, so every rank applies the same averaged gradient and the copies stay equal.
Why it is the baseline: it is what a competent engineer writes first, and it is correct. Its
cost is structural: one collective per parameter tensor (each paying the collective's latency),
and all communication waits until the whole backward pass has finished, so none of it overlaps
with compute.
Run:        torchrun --nproc_per_node=2 01_ddp/baseline_ddp.py --size small
Look for:   the comm MB/step and the collectives per step in the summary and `make report`;
            optimized_ddp.py sends the same bytes in a few buckets, overlapped with backward.
Theory:     a ring all-reduce makes each rank send 2(N-1)/N x the gradient bytes, here
            2(N-1)/N x 4 bytes x params per step, in one collective per parameter tensor.
"""

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank of `group` (None: the world) start from the group's first rank's weights
    and buffers (a tied weight is sent once)."""
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.detach(), src=first, group=group)


def allreduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None
                        ) -> tuple[int, int]:
    """Average each gradient across the ranks of `group` (None: the world), one blocking
    all-reduce per tensor.

    Returns (bytes all-reduced, number of collectives) so the record counts what was sent.
    """
    nbytes = calls = 0
    world_size = dist.get_world_size(group)
    for p in model.parameters():  # parameters() visits the tied embedding/head weight once
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, group=group)  # SUM: gloo has no AVG, so divide afterwards
        p.grad.div_(world_size)
        nbytes += p.grad.numel() * p.grad.element_size()
        calls += 1
    return nbytes, calls


def ddp_bytes(params: float, world: int, weight: float, grad: float, optim: float
              ) -> dict[str, float]:
    """DDP's bytes a rank: every weight, gradient and optimizer value kept (`weight`, `grad`,
    `optim` bytes each; fp32 AdamW: 4, 4, 8); sent a step, the gradients ring-all-reduced."""
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params}
    return {**kept, "state": sum(kept.values()),
            "sent": common.ring_allreduce_mb(grad * params, world) * 2**20}


def main():
    args = common.parser(__doc__).parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    broadcast_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sent = {}

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        sent["bytes"], sent["calls"] = allreduce_gradients(model)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    params = sum(p.numel() for p in model.parameters())
    value_bytes = next(model.parameters()).element_size()  # AdamW keeps two values a weight
    predicted = ddp_bytes(params, topo.world_size, value_bytes, value_bytes, 2 * value_bytes)
    common.record(args, topo, stats, baseline=None, model=model, optimizer=opt,
                  comm_mb=common.ring_allreduce_mb(sent["bytes"], topo.world_size),
                  collectives_per_step=sent["calls"],
                  theory={"comm_mb": predicted["sent"] / 2**20,
                          "collectives": len(list(model.parameters()))})


if __name__ == "__main__":
    common.run_main(main)
