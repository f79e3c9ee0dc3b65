"""Data-parallel training with the gradients in one flat buffer, all-reduced through the process
group, and AdamW replicated on every rank: the baseline for symmetric-memory training.

What it does: every parameter's `.grad` is a view into one flat buffer, so backward writes the
gradients straight into it; after backward one `dist.all_reduce` sums the buffer over the ranks
and it is divided by N; then every rank runs the same AdamW step on all the parameters and
keeps all of its state (16 bytes a parameter in fp32: weights, gradients, two moments).
Why it is the baseline: it is DDP at its simplest and best for a small model: one collective a
step, no copies (as `gradient_as_bucket_view` does), and AdamW's fused implementation, the one
the symmetric-memory script runs (torch's default on CPU is a loop over the tensors), so the
comparison is the transport and the sharding alone. What it spends is the process group's
all-reduce, through gloo's sockets even between processes on one host, and the N-fold
replicated optimizer step and state that optimized_symmem_training.py shares out.
Run:        torchrun --nproc_per_node=2 06_symmem/baseline_symmem_training.py --size small
Look for:   `make symmem report`: step time, state MB and its `memory.optim` part (8 bytes a
            parameter), beside the symmetric-memory run.
Theory:     comm: a ring all-reduce of the buffer, 2(N-1)/N x BP bytes sent by each rank (and a
            broadcast of the buffers, as DDP's); optimizer state 2BP bytes on every rank;
            P = parameter count, B = bytes a parameter (4: fp32).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


def flat_gradients(model: torch.nn.Module) -> torch.Tensor:
    """One zeroed buffer for all the gradients, in the parameters' dtype, each parameter's
    `.grad` a view into it."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def keep_buffers_in_step(model: torch.nn.Module, group: dist.ProcessGroup | None = None):
    """As DDP does: every rank takes the group's first rank's buffers (BatchNorm's running
    statistics) now and before each forward, one broadcast per dtype. Returns the forward hook's
    handle, or None for a model without buffers (the decoders: nothing to send)."""
    buffers = list(model.buffers())
    if not buffers:
        return None
    src = dist.get_global_rank(group or dist.group.WORLD, 0)

    def broadcast(*_):
        for dtype in dict.fromkeys(b.dtype for b in buffers):
            same = [b for b in buffers if b.dtype == dtype]
            flat = torch.cat([b.flatten() for b in same])
            dist.broadcast(flat, src=src, group=group)
            torch._foreach_copy_(same, [piece.view_as(b) for piece, b in zip(
                flat.split([b.numel() for b in same]), same, strict=True)])

    broadcast()
    return model.register_forward_pre_hook(broadcast)


# Copied from 01_ddp/baseline_ddp.py: ddp_bytes
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
    grads = flat_gradients(model)
    keep_buffers_in_step(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)

    def train_step(inputs, targets):
        grads.zero_()  # backward accumulates into the views
        loss = model(inputs, targets)
        loss.backward()
        dist.all_reduce(grads)
        grads.div_(topo.world_size)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    n, value_bytes = topo.world_size, grads.element_size()  # AdamW keeps two values a weight
    predicted = ddp_bytes(grads.numel(), n, value_bytes, value_bytes, 2 * value_bytes)
    buffer_bytes = sum(b.nbytes for b in model.buffers())  # broadcast before each forward
    common.record(args, topo, stats, baseline=None, model=model, optimizer=opt,
                  comm_mb=stats.comm_mb,
                  optim_mb=round(common.state_split_mb(model, opt)["optim_mb"], 2),
                  theory={"comm_mb": predicted["sent"] / 2**20
                          + (n - 1) / n * buffer_bytes / 2**20,
                          "optim_mb": predicted["optim"] / 2**20})


if __name__ == "__main__":
    common.run_main(main)
