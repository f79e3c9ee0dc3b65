"""Symmetric-memory training: gradients reduced through memory every rank maps, each rank's AdamW
on its 1/N only, and the updated parameters read by every rank with plain loads.

What it does (SymmetricMemoryAdamW: `zero_grad()`, backward, `step()` on a model and a
group), on CPU: one /dev/shm segment per group, mapped by its ranks as in
optimized_symmem_allreduce.py (flags, one gradient slot per rank, the parameters once). Every
rank's model views the segment's parameters, its `.grad`s view its own slot, so backward writes
there. Once all ranks are `ready`, rank r sums its 1/N of every slot into its own slot and
averages it (a reduce-scatter with no library call and no copy in); its AdamW steps its 1/N of
the parameters in place, where every rank reads them; all wait for `stepped` before the next
forward. Two waits on flags a step: no broadcast, no all-gather, no all-reduce. One node and
x86-64 only (else `skipped`). On CUDA (SymmetricBuffers) each GPU keeps its own parameters and
gradients in `symm_mem` buffers that every peer maps: the same step, device-side barriers for
the flags, and each peer's updated 1/N copied out of its buffer.
`--replicated-optimizer` changes the transport alone: every rank keeps its own parameters and
steps all of them, as the baseline; the gradients are all-reduced in the slots in two shots.
Why it helps: the baseline pays gloo's all-reduce (sockets, even on one host) and N copies of
the same AdamW step (both scripts run it fused); here the gradients move at memory speed and
each rank steps 1/N of the model. On CPU the host holds the parameters once, not N times.
Run:        torchrun --nproc_per_node=2 06_symmem/optimized_symmem_training.py --size small
Look for:   `make symmem report`: speedup over baseline_symmem_training of the transport alone
            (--replicated-optimizer) and with the sharding (default), also at --batch-size 1
            --seq-len 32; losses equal to float rounding; `optim_mb` halved at 2 ranks.
Theory:     optimizer state 2BP/N bytes a rank (2BP replicated), P = parameter count, B = bytes
            a parameter (4: fp32, 2: bf16). comm MB/step is what a rank reads out of its peers'
            buffers: (N-1)/N x BP of gradients, and as much again of reduced gradients
            (replicated) or of parameters (CUDA).
"""

import functools
import mmap
import os
import platform
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

LINE = 8  # int64s per flag: one 64-byte cache line each
# Per step, against the baseline: the same mean gradient, summed in another order (rank by rank
# here, the process group's ring there), so fp32 rounding. Under bf16 autocast (CUDA) such
# last-bit differences flip activations' bf16 rounding and the losses drift by bf16's
# resolution, as for the other exact techniques in bf16.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# No planner row: one host's shared memory, where the planner plans GPUs and links between them.
PLANNED = []


class GradientSegment:
    """CPU: flags, one gradient slot per rank of `group` and, sharded, the parameters once, in a
    /dev/shm file its ranks, all on this host, map (unlinked as soon as all have: nothing
    outlives the run), in the parameters' dtype. Replicated, each rank keeps its own parameters
    and the segment carries the gradients. Made as optimized_symmem_allreduce.py's
    SharedSegment is, but laid out for a training step, not for messages: its flags count
    steps, and its waits, one or two a step, yield the core from the first poll."""

    def __init__(self, numel: int, dtype: torch.dtype, timeout: float, replicated: bool,
                 group: dist.ProcessGroup | None = None):
        group = group or dist.group.WORLD
        if common.dry_run():  # its fake peers never write: it would wait for them
            raise common.Skip("a /dev/shm segment waits for its peers' writes, which a dry "
                              "run's fake peers never make")
        members = dist.get_process_group_ranks(group)  # global ranks, in the group's order
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        if len({g // per_node for g in members}) > 1:  # launchers number ranks node by node
            raise common.Skip("a /dev/shm segment is one host's: run on one node (NNODES=1)")
        if platform.machine() not in ("x86_64", "AMD64"):
            raise common.Skip(f"the flags rely on x86-64's store order, not {platform.machine()}'s")
        n, self.rank, self.timeout, self.world = (len(members), dist.get_rank(group), timeout,
                                                  len(members))
        self.bounds = [numel * k // n for k in range(n + 1)]  # rank k's share: k-th to k+1-th
        self.mine = slice(self.bounds[self.rank], self.bounds[self.rank + 1])
        # the group's name keeps two groups' segments apart; its first rank's pid and clock, runs
        path = [f"/dev/shm/playbook-symmem-{group.group_name}-{os.getpid()}-{time.time_ns()}"]
        dist.broadcast_object_list(path, src=members[0], group=group)  # the group's first rank's
        phases = 3 if replicated else 2  # replicated also waits for every share to be reduced
        regions = n if replicated else n + 1
        flag_bytes, itemsize = phases * n * LINE * 8, dtype.itemsize
        size = flag_bytes + regions * numel * itemsize
        if self.rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(size)  # zeros: every flag starts at step 0
            # torchrun ends the other ranks with SIGTERM when one dies: exit through the
            # `finally` below, which unlinks the file, not around it
            sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            dist.barrier(group=group)
            with open(path[0], "r+b") as f:
                self.mapping = mmap.mmap(f.fileno(), size)
            dist.barrier(group=group)  # every rank has mapped it: the name is no longer needed
        finally:  # unlinked then, or at once if a peer never mapped it
            if self.rank == 0:
                os.unlink(path[0])
                signal.signal(signal.SIGTERM, sigterm)
        self.group = group
        self.flags = memoryview(self.mapping)[:flag_bytes].cast("q")
        flags = [range(k * n * LINE, (k + 1) * n * LINE, LINE) for k in range(phases)]
        self.ready, self.stepped = flags[:2]
        self.reduced = flags[2] if replicated else None  # every rank's share is reduced
        # A tensor of its own for the parameters and for each slot (not views of one): memory
        # is counted by storage, and a rank's gradients are its slot, not all N.
        tensors = [torch.frombuffer(self.mapping, dtype=dtype, count=numel,
                                    offset=flag_bytes + k * numel * itemsize)
                   for k in range(regions)]
        self.params, self.slots = (None, tensors) if replicated else (tensors[0], tensors[1:])
        self.grads = self.slots[self.rank]
        self.step, self.loaded_bytes = 0, 0  # bytes read out of peers' slots this step

    def signal(self, flags: range) -> None:
        self.flags[flags[self.rank]] = self.step

    def wait(self, flags: range) -> None:
        """Until every rank's flag reaches this step, yielding the core between polls."""
        deadline = time.monotonic() + self.timeout
        while any(self.flags[i] < self.step for i in flags):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a peer did not reach step {self.step} within {self.timeout} s")
            os.sched_yield()

    def load_params(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameters this rank's model views: the segment's, written once for the host by
        the group's first rank, or, replicated, `flat`, its own copy (equal on every rank)."""
        if self.params is None:
            return flat
        if self.rank == 0:
            self.params.copy_(flat)
        dist.barrier(group=self.group)  # written before anyone reads them
        return self.params

    def reduce_my_share(self) -> None:
        """My 1/N of every rank's gradients, summed into my slot and averaged, once all are
        ready."""
        self.step += 1
        self.signal(self.ready)
        self.wait(self.ready)
        for k in range(self.world):
            if k != self.rank:
                self.grads[self.mine].add_(self.slots[k][self.mine])
        self.grads[self.mine].div_(self.world)
        self.loaded_bytes = (self.world - 1) * self.grads[self.mine].nbytes

    def all_reduce_grads(self) -> None:
        """Replicated: the whole mean gradient in my slot, in two shots. I reduce my 1/N; once
        every share is reduced, no peer reads the rest of my slot any more, and I copy each
        peer's reduced share out of its slot into mine."""
        self.reduce_my_share()
        self.signal(self.reduced)
        self.wait(self.reduced)
        for k in range(self.world):
            if k != self.rank:
                theirs = slice(self.bounds[k], self.bounds[k + 1])
                self.grads[theirs].copy_(self.slots[k][theirs])
                self.loaded_bytes += self.grads[theirs].nbytes

    def finish_step(self) -> None:
        """Every rank has stepped: the model they all view is whole again (sharded), and no peer
        still reads my slot, so the next backward may overwrite it."""
        self.signal(self.stepped)
        self.wait(self.stepped)


def peer_views(handle, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank's buffer of a rendezvoused tensor, as this GPU sees it. The tensor starts
    `handle.offset` bytes into its allocation (torch's pool may place several in one), and so
    does each peer's."""
    return [handle.get_buffer(k, (numel,), dtype, storage_offset=handle.offset // dtype.itemsize)
            for k in range(handle.world_size)]


class SymmetricBuffers:
    """CUDA: this rank's gradients and, sharded, its parameters in symmetric memory, every peer's
    of `group` mapped into this GPU's address space (`symm_mem.empty`, `rendezvous` once;
    NVLink), in the parameters' dtype. Each GPU has memory of its own, so the parameters are
    held once a GPU, N times a host; each rank's AdamW state still covers 1/N of the model.
    Device-side barriers order the kernels of every rank's stream, so nobody reads a
    half-written buffer or overwrites one a peer still reads. Replicated, the parameters stay
    the model's own."""

    def __init__(self, numel: int, dtype: torch.dtype, timeout: float, replicated: bool,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        name = (group or dist.group.WORLD).group_name
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_ms = int(timeout * 1000)
        self.bounds = [numel * k // self.world for k in range(self.world + 1)]
        self.mine = slice(self.bounds[self.rank], self.bounds[self.rank + 1])
        # zeros, as the CPU slots: a first backward before any zero_grad() starts from nothing
        self.grads = symm_mem.empty(numel, dtype=dtype, device=device).zero_()
        self.grad_handle = symm_mem.rendezvous(self.grads, name)
        self.peer_grads = peer_views(self.grad_handle, numel, dtype)
        self.params = self.param_handle = None
        if not replicated:
            self.params = symm_mem.empty(numel, dtype=dtype, device=device)
            self.param_handle = symm_mem.rendezvous(self.params, name)
            self.peer_params = peer_views(self.param_handle, numel, dtype)
        self.loaded_bytes = 0  # bytes read out of peers' buffers this step

    def load_params(self, flat: torch.Tensor) -> torch.Tensor:
        if self.params is None:
            return flat
        self.params.copy_(flat)  # every GPU its own copy, equal on every rank
        return self.params

    def reduce_my_share(self) -> None:
        self.grad_handle.barrier(timeout_ms=self.timeout_ms)  # every backward has finished
        for k in range(self.world):
            if k != self.rank:
                self.grads[self.mine].add_(self.peer_grads[k][self.mine])
        self.grads[self.mine].div_(self.world)
        self.loaded_bytes = (self.world - 1) * self.grads[self.mine].nbytes

    def all_reduce_grads(self) -> None:
        """Replicated: as the CPU segment's, a device-side barrier between the two shots."""
        self.reduce_my_share()
        self.grad_handle.barrier(timeout_ms=self.timeout_ms)
        self.copy_peer_shares(self.grads, self.peer_grads)

    def copy_peer_shares(self, mine: torch.Tensor, peers: list[torch.Tensor]) -> None:
        for k in range(self.world):
            if k != self.rank:
                theirs = slice(self.bounds[k], self.bounds[k + 1])
                mine[theirs].copy_(peers[k][theirs])
                self.loaded_bytes += mine[theirs].nbytes

    def finish_step(self) -> None:
        """Every rank has stepped. Sharded: copy each peer's share out of its buffer; no barrier
        after, since a peer reads my gradients before this barrier and my share before the next
        step's, and I write either only after passing the same one. Replicated: the barrier
        alone, so no peer still reads my gradients when the next backward overwrites them."""
        if self.param_handle is None:
            self.grad_handle.barrier(timeout_ms=self.timeout_ms)
            return
        self.param_handle.barrier(timeout_ms=self.timeout_ms)
        self.copy_peer_shares(self.params, self.peer_params)


# Copied from 06_symmem/baseline_symmem_training.py: keep_buffers_in_step
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


class SymmetricMemoryAdamW:
    """Data-parallel AdamW through symmetric memory, with an optimizer's contract: `zero_grad()`,
    backward as many times as you accumulate, `step()`. It takes the model (all its parameters,
    of one dtype, which the buffers keep: a bf16 model stays bf16) and `group` (default: the
    world): the segment is the group's ranks', every collective the group's. At construction
    every rank takes the group's first rank's weights and buffers (as DDP does), and before
    each forward its buffers (BatchNorm's statistics). Every `p.data` then views the flat
    parameters (sharded: the one copy the host holds) and every `.grad` this rank's slot, so
    backward accumulates there; `step()` reduces the mean gradient and steps AdamW on this
    rank's 1/N (`replicated`: on all of it, after an all-reduce through the slots). A `.grad`
    the user's `model.zero_grad()` set to None and backward made anew is copied back into the
    slot at `step()`, so that loop trains too. After `step()` the slot holds the reduced
    gradient: a backward into it before this object's `zero_grad()` raises RuntimeError (it
    would add to it). `adamw` goes to torch.optim.AdamW."""

    def __init__(self, model: torch.nn.Module, *, group: dist.ProcessGroup | None = None,
                 replicated: bool = False, timeout: float = 300.0, **adamw):
        self.params = list(model.parameters())  # a tied weight once
        if len(dtypes := {p.dtype for p in self.params}) > 1:
            raise ValueError(f"the parameters share one flat buffer: give them one dtype, not "
                             f"{', '.join(sorted(map(str, dtypes)))}")
        dtype, device = self.params[0].dtype, self.params[0].device
        numel = sum(p.numel() for p in self.params)
        if device.type == "cuda":
            self.buffers = SymmetricBuffers(numel, dtype, timeout, replicated, group, device)
        else:
            self.buffers = GradientSegment(numel, dtype, timeout, replicated, group)
        flat = torch.cat([p.detach().flatten() for p in self.params])
        dist.broadcast(flat, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        flat = self.buffers.load_params(flat)
        self.grad_views, offset = [], 0
        for p in self.params:
            n = p.numel()
            p.data = flat[offset:offset + n].view_as(p)
            p.grad = self.buffers.grads[offset:offset + n].view_as(p)
            self.grad_views.append(p.grad)
            p.register_post_accumulate_grad_hook(
                functools.partial(self.refuse_backward_into_a_stepped_slot, view=p.grad))
            offset += n
        self.needs_zero_grad = False  # step() ran since zero_grad()
        if replicated:
            self.optimizer = torch.optim.AdamW(self.params, **adamw)
            self.reduce_grads = self.buffers.all_reduce_grads
        else:
            share = torch.nn.Parameter(flat[self.buffers.mine])  # my 1/N, where peers read it
            share.grad = self.buffers.grads[self.buffers.mine]
            self.optimizer = torch.optim.AdamW([share], **adamw)
            self.reduce_grads = self.buffers.reduce_my_share
        self.buffer_hook = keep_buffers_in_step(model, group)

    def refuse_backward_into_a_stepped_slot(self, p: torch.nn.Parameter, view: torch.Tensor
                                            ) -> None:
        """Backward accumulated into `p.grad`: if that is still its `view` of the slot and
        step() ran since zero_grad(), it added to the reduced gradient (a `.grad` set to None
        and made anew is the model.zero_grad() loop, copied in at step())."""
        if self.needs_zero_grad and p.grad is view:
            raise RuntimeError(f"backward after {type(self).__name__}.step() without its "
                               "zero_grad(): call it before each step's first backward")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the slot in place, whatever `set_to_none` says: the gradients are the slot."""
        for p, view in self.detached_gradients():
            p.grad = view
        self.buffers.grads.zero_()
        self.needs_zero_grad = False

    def detached_gradients(self):
        """(parameter, its view of the slot) where the user's `model.zero_grad()` set the
        `.grad` to None, and backward may have made a new one elsewhere."""
        return [(p, view) for p, view in zip(self.params, self.grad_views, strict=True)
                if p.grad is not view]

    def step(self) -> None:
        """Reduce the accumulated gradients, step AdamW, and wait until every rank has: the
        model is whole, and no peer reads my slot, when this returns."""
        for p, view in self.detached_gradients():  # what backward wrote since (or nothing)
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view
        self.reduce_grads()
        self.optimizer.step()
        self.buffers.finish_step()
        self.needs_zero_grad = True


# Copied from 06_symmem/optimized_symmem_allreduce.py: peer_access_problem
def peer_access_problem(topo: common.Topology) -> str | None:
    """Why this host's GPUs cannot map each other's memory (symmetric memory), or None; all ranks
    agree on it, as one that went on alone would wait forever in the rendezvous."""
    if topo.nnodes > 1:
        return "symmetric memory maps the GPUs of one host: run on one node (NNODES=1)"
    visible = torch.cuda.device_count()
    # under `srun --gpus-per-task=1` each rank sees one GPU, index 0: the rendezvous would map
    # every rank's memory onto the same device ("allocations from overlapping devices")
    hidden = visible < topo.local_world_size
    me, used = topo.device.index, min(visible, topo.local_world_size)
    lacking = [k for k in range(used) if k != me and not torch.cuda.can_device_access_peer(me, k)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (hidden, lacking))
    if any(h for h, _ in everyone):
        return (f"a rank sees {visible} GPU(s) for the host's {topo.local_world_size} ranks "
                "(srun --gpus-per-task?): symmetric memory maps the host's GPUs, so every rank "
                "must see them all: srun --gpus-per-node, or torchrun")
    if any(lacks for _, lacks in everyone):
        return ("this host's GPUs cannot access each other's memory (no NVLink, no PCIe "
                "peer-to-peer), which symmetric memory maps: nothing to measure here")
    return None


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--replicated-optimizer", action="store_true",
                        help="the transport alone: gradients all-reduced through the segment, "
                             "every rank keeps its own parameters and steps all of them, as the "
                             "baseline does")
    args = parser.parse_args()
    topo = common.setup(args)
    if topo.device.type == "cuda" and (why := peer_access_problem(topo)):
        raise common.Skip(why)
    model, batches = common.workload(args, topo)
    opt = SymmetricMemoryAdamW(model, replicated=args.replicated_optimizer,
                               timeout=args.timeout, lr=args.lr, fused=True)

    def train_step(inputs, targets):
        opt.zero_grad()  # backward accumulates into the slot
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt.optimizer))
    split = common.state_split_mb(model, opt.optimizer)
    # Read out of peers' buffers: their shares of my share's gradients, and their reduced shares
    # (replicated) or updated parameters (CUDA, sharded); CPU, sharded, reads these in place.
    cpu = isinstance(opt.buffers, GradientSegment)
    shots = 1 if cpu and not args.replicated_optimizer else 2
    grad_bytes, n = opt.buffers.grads.nbytes, topo.world_size
    owned = grad_bytes if args.replicated_optimizer else opt.buffers.grads[opt.buffers.mine].nbytes
    common.record(args, topo, stats, baseline="baseline_symmem_training", model=model,
                  optimizer=opt.optimizer, comm_mb=opt.buffers.loaded_bytes / 2**20,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], optim_mb=round(split["optim_mb"], 2),
                  transport="/dev/shm segment" if cpu else "cuda symmetric memory",
                  comm="bytes read out of peers' buffers", process_group_mb=stats.comm_mb,
                  theory={"comm_mb": shots * (n - 1) / n * grad_bytes / 2**20,
                          "optim_mb": 2 * owned / 2**20})  # AdamW's two moments

if __name__ == "__main__":
    common.run_main(main)
