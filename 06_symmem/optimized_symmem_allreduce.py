"""Collectives through symmetric memory: every rank's buffer mapped into its peers' address
space, so a collective is plain loads and stores and a few flags, with no library round trip.

What it does: the same sweep as baseline_symmem_allreduce.py (sizes, checks, timing), each
operation done through memory every rank of the host can read and write.
- CPU: one /dev/shm file every local rank maps (SharedSegment): three flags per rank, then one
  slot per rank. An all-reduce, one-shot (up to 256 KB): each rank copies its tensor into its
  slot, raises `ready`, and once all are ready sums all slots into its tensor. Two-shot
  (larger): rank r copies into its slot only the pieces its peers sum, sums piece r of its
  tensor and of every peer's slot into its own slot, raises `reduced`, then copies each piece
  from the rank that summed it. Last it raises `done`, which the next call waits for before it
  overwrites a slot. All-gather, reduce-scatter and send/recv: write your slot, flag, read the
  slots you need, flag. One node and x86-64 only (else the run records `skipped`).
- CUDA: `torch.distributed._symmetric_memory`: a buffer per size (`symm_mem.empty`,
  `rendezvous` once), then PyTorch's `one_shot_all_reduce` (small) and `two_shot_all_reduce_`
  (large) kernels, which read peers' buffers over NVLink. Only all-reduce is swept on CUDA.
Why it helps: gloo's fixed cost per call (the process group, a TCP round trip) is gone, and it
is most of the time of a small message; large messages move through memory at memory
bandwidth instead of through the loopback's sockets.
Run:        torchrun --nproc_per_node=2 06_symmem/optimized_symmem_allreduce.py
Look for:   `make symmem report`: the speedup column: many-fold at 64 KB and less, and a busbw
            above gloo's at 16 MB and more.
Theory:     busbw as the baseline's; one-shot moves N x bytes through each rank's memory reads,
            two-shot about 2 x bytes.
"""

import argparse
import functools
import mmap
import os
import platform
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
ONE_SHOT_MAX = 256 * 1024  # bytes: above, two-shot reads less than one-shot's N slots
LINE = 8  # int64s per flag: one 64-byte cache line each
SPIN_POLLS = 300  # flag reads (tens of microseconds) before a waiting rank yields its core
# A sweep of collectives: no training, so no losses to hold to the baseline's.
LOSS_TOLERANCE = None
# No planner row: a collectives benchmark places no model's state.
PLANNED = []


class SizeViews:
    """The slot views an all-reduce of `numel` values uses, made once per message size: a slice
    costs microseconds of Python and torch dispatch, a good share of a small message's call.
    Two-shot: rank k sums values bounds[k]:bounds[k + 1] (its piece) into its own slot."""

    def __init__(self, slots: torch.Tensor, rank: int, numel: int):
        n = len(slots)
        self.bounds = b = [numel * k // n for k in range(n + 1)]
        self.rows = list(slots[:, :numel])  # each rank's slot
        self.pieces = [slots[k, b[k]:b[k + 1]] for k in range(n)]  # each piece, where it is summed
        self.parts = [slots[k, b[rank]:b[rank + 1]] for k in range(n) if k != rank]  # of my piece
        self.to_peers = [(lo, hi, self.rows[rank][lo:hi])  # what peers read from my slot
                         for lo, hi in ((0, b[rank]), (b[rank + 1], numel)) if hi > lo]


class SharedSegment:
    """Flags and one slot per rank of `group` (default: the world; ranks and collectives are the
    group's) in a /dev/shm file its ranks, all on this host, map. The flags are read and written
    as Python ints through a memoryview (a poll costs well under a microsecond); the slots are a
    tensor over the same mapping. Each flag has a cache line of its own. The group's first rank
    creates the file and unlinks it once every rank has mapped it, so the memory lives exactly
    as long as the mappings: nothing is left in /dev/shm when the run ends, or when a rank is
    killed.
    Ordering: a rank writes its data, then its flag; a peer reads the flag, then the data.
    x86-64 makes stores visible in program order and does not reorder loads with older loads
    (total store order), and torch's copy, add and sum kernels store normally, so a peer that sees
    the flag sees the data. ARM (e.g. GB200's Grace CPUs) promises no such order and Python has
    no fence to call, hence the check below."""

    def __init__(self, topo: common.Topology, slot_bytes: int, timeout: float,
                 group: dist.ProcessGroup | None = None):
        group = group or dist.group.WORLD
        if common.dry_run():  # its fake peers never write: it would wait for them
            raise common.Skip("a /dev/shm segment waits for its peers' writes, which a dry "
                              "run's fake peers never make")
        members = dist.get_process_group_ranks(group)  # global ranks, in the group's order
        if len({g // topo.local_world_size for g in members}) > 1:  # launchers number by node
            raise common.Skip("a /dev/shm segment is one host's: run on one node (NNODES=1)")
        if platform.machine() not in ("x86_64", "AMD64"):
            raise common.Skip(f"the flags rely on x86-64's store order, not {platform.machine()}'s")
        n, self.rank, self.timeout = len(members), dist.get_rank(group), timeout
        # the group's name keeps two groups' segments apart; its first rank's pid and clock, runs
        path = [f"/dev/shm/playbook-symmem-{group.group_name}-{os.getpid()}-{time.time_ns()}"]
        dist.broadcast_object_list(path, src=members[0], group=group)  # the group's first rank's
        flag_bytes = 3 * n * LINE * 8
        if self.rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(flag_bytes + n * slot_bytes)  # zeros: every flag starts at call 0
            # torchrun ends the other ranks with SIGTERM when one dies: exit through the
            # `finally` below, which unlinks the file, not around it
            sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            dist.barrier(group=group)
            with open(path[0], "r+b") as f:
                self.mapping = mmap.mmap(f.fileno(), flag_bytes + n * slot_bytes)
            dist.barrier(group=group)  # every rank has mapped it: the name is no longer needed
        finally:  # unlinked then, or at once if a peer never mapped it
            if self.rank == 0:
                os.unlink(path[0])
                signal.signal(signal.SIGTERM, sigterm)
        self.flags = memoryview(self.mapping)[:flag_bytes].cast("q")
        self.ready, self.reduced, self.done = (range(k * n * LINE, (k + 1) * n * LINE, LINE)
                                               for k in range(3))
        self.slots = torch.frombuffer(self.mapping, dtype=torch.float32, offset=flag_bytes,
                                      count=n * slot_bytes // 4).view(n, slot_bytes // 4)
        self.call = 0

    def begin(self) -> None:
        """A new call: wait until every peer is done reading the slots of the last one."""
        self.call += 1
        self.wait(self.done, self.call - 1)

    def signal(self, flags: range) -> None:
        self.flags[flags[self.rank]] = self.call

    def wait(self, flags: range, value: int | None = None) -> None:
        """Until every rank's flag reaches `value` (default: this call): a tight poll first (a
        peer a few microseconds behind costs no system call), then yielding the core between
        polls: ranks may outnumber cores, and a spin would starve the rank it waits for."""
        value, polls, deadline = self.call if value is None else value, 0, None
        for i in flags:
            while self.flags[i] < value:
                polls += 1
                if polls < SPIN_POLLS:
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"a peer did not reach call {value} within {self.timeout} s")
                os.sched_yield()


@functools.cache
def size_views(seg: SharedSegment, numel: int) -> SizeViews:
    return SizeViews(seg.slots, seg.rank, numel)


def all_reduce(seg: SharedSegment, x: torch.Tensor) -> None:
    if len(seg.slots) == 1:
        return  # a world of one: x is the sum
    r, views = seg.rank, size_views(seg, x.numel())
    seg.begin()
    if x.numel() * 4 <= ONE_SHOT_MAX:
        views.rows[r].copy_(x)
        seg.signal(seg.ready)
        seg.wait(seg.ready)
        torch.add(views.rows[0], views.rows[1], out=x)
        for row in views.rows[2:]:  # in rank order on every rank: the same sum, bit for bit
            x.add_(row)
    else:
        for lo, hi, slot in views.to_peers:  # not my own piece: nobody reads it from my slot
            slot.copy_(x[lo:hi])
        seg.signal(seg.ready)
        seg.wait(seg.ready)
        b = views.bounds
        mine, x_mine = views.pieces[r], x[b[r]:b[r + 1]]
        torch.add(x_mine, views.parts[0], out=mine)  # the part of my slot no peer reads yet
        for part in views.parts[1:]:
            mine.add_(part)
        seg.signal(seg.reduced)
        x_mine.copy_(mine)  # while the peers finish their pieces
        seg.wait(seg.reduced)
        for k, piece in enumerate(views.pieces):
            if k != r:
                x[b[k]:b[k + 1]].copy_(piece)
    seg.signal(seg.done)


def all_gather(seg: SharedSegment, out: torch.Tensor, x: torch.Tensor) -> None:
    seg.begin()
    seg.slots[seg.rank, :x.numel()].copy_(x)
    seg.signal(seg.ready)
    seg.wait(seg.ready)
    out.view(len(seg.slots), -1).copy_(seg.slots[:, :x.numel()])
    seg.signal(seg.done)


def reduce_scatter(seg: SharedSegment, out: torch.Tensor, x: torch.Tensor) -> None:
    seg.begin()
    seg.slots[seg.rank, :x.numel()].copy_(x)
    seg.signal(seg.ready)
    seg.wait(seg.ready)
    piece = out.numel()
    torch.sum(seg.slots[:, seg.rank * piece:(seg.rank + 1) * piece], dim=0, out=out)
    seg.signal(seg.done)


def sendrecv(seg: SharedSegment, out: torch.Tensor, x: torch.Tensor) -> None:
    """Every rank sends x to the next and receives the previous one's into out."""
    seg.begin()
    seg.slots[seg.rank, :x.numel()].copy_(x)
    seg.signal(seg.ready)
    seg.wait(seg.ready)
    out.copy_(seg.slots[(seg.rank - 1) % len(seg.slots), :out.numel()])
    seg.signal(seg.done)


def cuda_all_reduce(topo: common.Topology, numel: int, group: dist.ProcessGroup | None = None):
    """PyTorch's symmetric-memory all-reduce over `group` (default: the world): a buffer
    allocated and rendezvoused once."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(numel, device=topo.device)
    group = (group or dist.group.WORLD).group_name
    symm_mem.rendezvous(buffer, group)

    def run(x: torch.Tensor) -> None:
        buffer.copy_(x)
        if numel * 4 <= ONE_SHOT_MAX:
            x.copy_(torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group)
            x.copy_(buffer)
    return run


# Copied from 06_symmem/baseline_symmem_allreduce.py: collective, changed: via shared memory
def collective(op: str, numel: int, topo: common.Topology, seg: SharedSegment | None):
    """The call to time on fp32 messages of `numel` values, the input refill before it, and the
    check of its result: every rank's input is (rank + 1) x (0, 1, ..., 6, 0, 1, ...)."""
    n, r, device = topo.world_size, topo.rank, topo.device
    pattern = (torch.arange(numel, device=device) % 7).float()
    piece = numel // n  # all-gather's input and reduce-scatter's output (numel divides by n)
    x = torch.empty(piece if op == "all_gather" else numel, device=device)
    out = torch.empty(numel if op == "all_gather" else piece if op == "reduce_scatter" else
                      numel, device=device)
    mine = pattern[r * piece:(r + 1) * piece] if op == "all_gather" else pattern

    def prepare():
        x.copy_(mine).mul_(r + 1)

    if op == "all_reduce":
        run = cuda_all_reduce(topo, numel) if seg is None else lambda x: all_reduce(seg, x)

        def call():
            run(x)
        result, expected = x, pattern * (n * (n + 1) / 2)
    elif op == "all_gather":
        def call():
            all_gather(seg, out, x)
        result = out
        expected = torch.cat([pattern[k * piece:(k + 1) * piece] * (k + 1) for k in range(n)])
    elif op == "reduce_scatter":
        def call():
            reduce_scatter(seg, out, x)
        result, expected = out, pattern[r * piece:(r + 1) * piece] * (n * (n + 1) / 2)
    else:
        def call():
            sendrecv(seg, out, x)
        result, expected = out, pattern * ((r - 1) % n + 1)
    return call, prepare, lambda: torch.equal(result, expected)


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


# Copied from 06_symmem/baseline_symmem_allreduce.py: message_sizes
def message_sizes(text: str) -> list[int]:
    """argparse type for a sweep's message sizes: comma-separated bytes with an optional K, M or G
    (powers of 1024), e.g. `4K,64K,16M`; each a positive whole number of fp32 values."""
    unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in text.split(","):
        found = re.fullmatch(r"\s*(\d+\.?\d*)([KMG]?)\s*", item.upper())
        value = int(float(found[1]) * unit[found[2]]) if found else 0
        if value <= 0 or value % 4:
            raise argparse.ArgumentTypeError(f"expected sizes like 4K,64K,16M, each a multiple "
                                             f"of 4 bytes (fp32 values) and > 0, got {item!r}")
        sizes.append(value)
    return sizes


# Copied from 06_symmem/baseline_symmem_allreduce.py: time_calls
def time_calls(call: Callable[[], object], prepare: Callable[[], object],
               check: Callable[[], bool], what: str, iters: int, warmup: int,
               device: torch.device) -> float:
    """Median ms of `call` over `iters` runs after `warmup`, each after `prepare` and a barrier
    and followed by `check` (untimed, every run: a stale read fails). A run's time is the least
    any rank measured: the last to leave the barrier waits for nobody, so its time is the call's
    and not the barrier's skew, which would swamp a small message."""
    times = []
    for i in range(warmup + iters):
        prepare()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if not check():
            raise RuntimeError(f"{what} returned a wrong result (call {i + 1})")
    shortest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
    return 1e3 * statistics.median(shortest.tolist())


# busbw = algbw x this: the share of the message each rank's link carries (nccl-tests'
# convention, their doc/PERFORMANCE.md, AlltoAll included: a rank keeps 1/N of its bytes and
# sends the other (N-1)/N)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0,
              "all_to_all": lambda n: (n - 1) / n}


# Copied from 06_symmem/baseline_symmem_allreduce.py: sweep_entry
def sweep_entry(op: str, nbytes: int, ms: float, world: int) -> dict:
    """One row of a collectives sweep: algbw = bytes / time, busbw = algbw x BUS_FACTOR."""
    algbw = nbytes / (ms / 1e3) / 1e9
    def digits(x: float) -> float:
        return float(f"{x:.4g}")
    return {"op": op, "bytes": nbytes, "ms": digits(ms), "algbw_gbps": digits(algbw),
            "busbw_gbps": digits(algbw * BUS_FACTOR[op](world))}


# Copied from 06_symmem/baseline_symmem_allreduce.py: record_sweep
def record_sweep(args: argparse.Namespace, topo: common.Topology, *, baseline: str | None,
                 sweep: list[dict], **extra) -> dict:
    """Append a collectives benchmark's result (rank 0): the sweep, no training fields."""
    rec = common.base_record(args, topo, baseline, "ok", None)
    rec.update(sweep=sweep, iters=args.iters, **extra)
    if topo.is_main:
        common.append_record(args.results, rec)
        for row in sweep:
            print(f"{rec['script']}: {row['op']:>14} {row['bytes']:>11,} B {row['ms']:9.3f} ms "
                  f"busbw {row['busbw_gbps']:7.2f} GB/s", flush=True)
        if args.trace:  # make all TRACE=1 passes it to every script
            print(f"{rec['script']}: no trace written: a sweep has no training step to break "
                  "down", flush=True)
    return rec


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--sizes", type=message_sizes, default="4K,64K,1M,16M",
                        help="message sizes in bytes, K/M/G allowed (default: 4K,64K,1M,16M)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated, of {', '.join(OPS)} (default: all)")
    parser.add_argument("--iters", type=common.int_at_least(1), default=20,
                        help="timed calls per size (default: 20; a quarter above 8 MB)")
    args = parser.parse_args()
    ops = args.ops.split(",")
    if unknown := [op for op in ops if op not in OPS]:
        parser.error(f"--ops {','.join(unknown)} unknown: choose from {','.join(OPS)}")
    topo = common.setup(args)
    if topo.device.type == "cuda":
        if why := peer_access_problem(topo):
            raise common.Skip(why)
        seg, ops = None, [op for op in ops if op == "all_reduce"]
    else:
        seg = SharedSegment(topo, max(args.sizes), args.timeout)
    if topo.world_size == 1:
        ops = [op for op in ops if op != "sendrecv"]  # a send needs a peer
    sweep = []
    for op in ops:
        for nbytes in args.sizes:
            numel = nbytes // 4
            if op in ("all_gather", "reduce_scatter"):
                numel -= numel % topo.world_size  # whole pieces, one per rank
            if numel == 0:
                continue  # smaller than one value (per rank)
            call, prepare, correct = collective(op, numel, topo, seg)
            iters = args.iters if nbytes <= 8 * 2**20 else max(3, args.iters // 4)
            ms = time_calls(call, prepare, correct, f"{op} of {nbytes} bytes", iters,
                            warmup=2, device=topo.device)
            sweep.append(sweep_entry(op, numel * 4, ms, topo.world_size))
    record_sweep(args, topo, baseline="baseline_symmem_allreduce", sweep=sweep,
                 transport="cuda symmetric memory" if seg is None else "/dev/shm segment")


if __name__ == "__main__":
    common.run_main(main)
