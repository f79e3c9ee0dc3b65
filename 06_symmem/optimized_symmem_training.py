"""Symmetric-memory training: gradients reduced through memory every rank maps, each rank's AdamW
on its 1/N only, and the updated parameters read by every rank with plain loads.

What it does: one /dev/shm segment per host, mapped by every local rank (as in
optimized_symmem_allreduce.py): flags, one gradient slot per rank, and the parameters, once.
- Every rank's model views the same parameters in the segment (`p.data` is a view into it), and
  its `.grad`s are views into its own slot, so backward writes the gradients there directly.
- After backward a rank raises `ready`; once all are ready, rank r sums its 1/N of every slot
  into its own slot and divides by N: its share of the mean gradient (a reduce-scatter with
  no library call and no copy in).
- Rank r's AdamW holds its 1/N of the parameters (a view into the segment) and their two
  moments, and steps them in place: the updated weights are where every rank reads them. It
  raises `stepped`; a rank starts the next forward once all have, so it never reads a
  half-updated model, and never writes a gradient slot a peer is still summing.
No broadcast, no all-gather, no all-reduce: two waits on flags a step. Holding the parameters
once per host instead of once per rank saves (N-1) x 4P bytes there, and no rank ever copies
them; the optimizer state is 8P/N a rank instead of 8P. Flags, ordering (x86-64 total store
order), yielding waits and the unlink-at-once lifetime are optimized_symmem_allreduce.py's;
with more than one node, or off x86-64, the run records `skipped`.
Why it helps: the baseline pays gloo's all-reduce of every gradient (sockets, even on one
host) and N copies of the same optimizer step; here the gradients move at memory speed and
each rank steps 1/N of the model.
Run:        torchrun --nproc_per_node=2 06_symmem/optimized_symmem_training.py --size small
Look for:   `make symmem report`: speedup over baseline_symmem_training, losses equal to it to
            float rounding, `optim_mb` halved at 2 ranks (state MB 4P + 4P + 8P/N).
Theory:     optimizer state 8P/N bytes a rank; nothing sent through the process group.
"""

import mmap
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

LINE = 8  # int64s per flag: one 64-byte cache line each


class SharedSegment:
    """Flags, one gradient slot per rank, and the parameters once, in a /dev/shm file every rank
    of this host maps (unlinked as soon as all have: nothing outlives the run)."""

    def __init__(self, topo: common.Topology, numel: int, timeout: float):
        if topo.nnodes > 1:
            raise common.Skip("a /dev/shm segment is one host's: run on one node (NNODES=1)")
        if platform.machine() not in ("x86_64", "AMD64"):
            raise common.Skip(f"the flags rely on x86-64's store order, not {platform.machine()}'s")
        n, self.rank, self.timeout = topo.world_size, topo.rank, timeout
        path = [f"/dev/shm/playbook-symmem-{os.getpid()}-{time.time_ns()}"]
        dist.broadcast_object_list(path)  # rank 0's name
        flag_bytes, size = 2 * n * LINE * 8, 2 * n * LINE * 8 + (n + 1) * numel * 4
        if topo.rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(size)  # zeros: every flag starts at step 0
        dist.barrier()
        with open(path[0], "r+b") as f:
            self.mapping = mmap.mmap(f.fileno(), size)
        dist.barrier()  # every rank has mapped it: the name is no longer needed
        if topo.rank == 0:
            os.unlink(path[0])
        self.flags = memoryview(self.mapping)[:flag_bytes].cast("q")
        self.ready, self.stepped = (range(k * n * LINE, (k + 1) * n * LINE, LINE) for k in range(2))
        # A tensor of its own for the parameters and for each slot (not views of one): memory
        # is counted by storage, and a rank's gradients are its slot, not all N.
        self.params, *self.slots = (
            torch.frombuffer(self.mapping, dtype=torch.float32, count=numel,
                             offset=flag_bytes + k * numel * 4) for k in range(n + 1))
        self.step = 0

    def signal(self, flags: range) -> None:
        self.flags[flags[self.rank]] = self.step

    def wait(self, flags: range, value: int) -> None:
        """Until every rank's flag reaches `value`, yielding the core between polls."""
        deadline = time.monotonic() + self.timeout
        while any(self.flags[i] < value for i in flags):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a peer did not reach step {value} within {self.timeout} s")
            os.sched_yield()


def place_in_segment(model: torch.nn.Module, seg: SharedSegment, topo: common.Topology) -> None:
    """Every parameter a view into the shared parameters (rank 0's values: all start equal),
    every `.grad` a view into this rank's slot."""
    offset = 0
    for p in model.parameters():
        n = p.numel()
        if topo.rank == 0:
            seg.params[offset:offset + n].copy_(p.detach().flatten())
        p.data = seg.params[offset:offset + n].view_as(p)
        p.grad = seg.slots[topo.rank][offset:offset + n].view_as(p)
        offset += n
    dist.barrier()  # rank 0 has written them


def reduce_my_share(seg: SharedSegment, mine: slice, world: int) -> None:
    """My 1/N of every rank's gradients, summed into my slot and averaged: once all are ready."""
    seg.signal(seg.ready)
    seg.wait(seg.ready, seg.step)
    for k in range(world):
        if k != seg.rank:
            seg.slots[seg.rank][mine].add_(seg.slots[k][mine])
    seg.slots[seg.rank][mine].div_(world)


def main():
    args = common.parser(__doc__).parse_args()
    topo = common.setup(args)
    if topo.device.type == "cuda":
        raise common.Skip("this training recipe shares a /dev/shm segment between CPU ranks; "
                          "a CUDA symmetric-memory version is not written yet")
    model, batches = common.workload(args, topo)
    numel = sum(p.numel() for p in model.parameters())
    seg = SharedSegment(topo, numel, args.timeout)
    place_in_segment(model, seg, topo)
    bounds = [numel * k // topo.world_size for k in range(topo.world_size + 1)]
    mine = slice(bounds[topo.rank], bounds[topo.rank + 1])
    share = torch.nn.Parameter(seg.params[mine])  # my 1/N of the model, in the segment
    share.grad = seg.slots[topo.rank][mine]
    opt = torch.optim.AdamW([share], lr=args.lr)

    def train_step(inputs, targets):
        seg.step += 1
        seg.wait(seg.stepped, seg.step - 1)  # all updated: the model is whole, the slots free
        seg.slots[topo.rank].zero_()  # backward accumulates into the views
        loss = model(inputs, targets)
        loss.backward()
        reduce_my_share(seg, mine, topo.world_size)
        opt.step()
        seg.signal(seg.stepped)
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    split = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline="baseline_symmem_training", model=model,
                  optimizer=opt, comm_mb=stats.comm_mb, loss_tolerance=1e-5,
                  optim_mb=round(split["optim_mb"], 2),
                  theory={"comm_mb": 0.0, "optim_mb": 8 * (mine.stop - mine.start) / 2**20})


if __name__ == "__main__":
    common.run_main(main)
