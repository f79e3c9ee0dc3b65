"""Collectives benchmark through the process group: all-reduce, all-gather, reduce-scatter,
send/recv and all-to-all over a sweep of message sizes.

What it does: the bandwidth test of nccl-tests and ml-engineering's all_reduce_bench: for each
operation and message size, a few untimed calls, then timed ones, each after a barrier so every
rank starts together, the device synchronised before the clock is read; a call's time is the
shortest any rank measured (the last rank out of the barrier waits for nobody), the median
kept, and every result checked. All-reduce sums `bytes` over the ranks in place; all-gather
assembles `bytes` from N pieces; reduce-scatter sums `bytes` and leaves each rank its 1/N;
send/recv sends `bytes` from every rank to the next (a ring, both at once); all-to-all sends
`bytes`/N to every rank, keeping its own 1/N (expert parallelism's token exchange, 08_moe).
Why it is the baseline: it is what a training loop calls, `dist.all_reduce` and friends over
gloo on CPU (NCCL on GPUs): each call goes through the process group, and over gloo through a
TCP connection per pair even between processes on one host. That fixed cost per call is what
small messages pay; symmetric memory (optimized_symmem_allreduce.py, no all-to-all) skips it.
Run:        torchrun --nproc_per_node=2 06_symmem/baseline_symmem_allreduce.py
            ... --sizes 4K,64K,1M,16M,256M --ops all_reduce,all_to_all
Look for:   `make symmem report`: the bandwidth table, this script's time and busbw beside the
            symmetric-memory one's at each size.
Theory:     busbw = algbw x 2(N-1)/N for all-reduce, (N-1)/N for all-gather, reduce-scatter and
            all-to-all, 1 for send/recv (the share of the message each rank's link must carry,
            so busbw compares with a link's bandwidth whatever N); algbw = bytes / time.
"""

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv", "all_to_all")


def collective(op: str, numel: int, topo: common.Topology):
    """The call to time on fp32 messages of `numel` values, the input refill before it, and the
    check of its result: every rank's input is (rank + 1) x (0, 1, ..., 6, 0, 1, ...), with 7k
    added to all-to-all's chunk k."""
    n, r, device = topo.world_size, topo.rank, topo.device
    pattern = (torch.arange(numel, device=device) % 7).float()
    piece = numel // n  # all-gather's input, reduce-scatter's output, all-to-all's chunk
    x = torch.empty(piece if op == "all_gather" else numel, device=device)
    out = torch.empty(numel if op == "all_gather" else piece if op == "reduce_scatter" else
                      numel, device=device)
    mine = pattern[r * piece:(r + 1) * piece] if op == "all_gather" else pattern
    if op == "all_to_all":  # each chunk its own values: one delivered to the wrong rank fails
        mine = pattern + 7 * torch.arange(n, device=device).repeat_interleave(piece)

    def prepare():
        x.copy_(mine).mul_(r + 1)

    if op == "all_reduce":
        def call():
            dist.all_reduce(x)
        result, expected = x, pattern * (n * (n + 1) / 2)
    elif op == "all_gather":
        def call():
            common.all_gather_single(out, x)
        result = out
        expected = torch.cat([pattern[k * piece:(k + 1) * piece] * (k + 1) for k in range(n)])
    elif op == "reduce_scatter":
        def call():
            common.reduce_scatter_single(out, x)
        result, expected = out, pattern[r * piece:(r + 1) * piece] * (n * (n + 1) / 2)
    elif op == "all_to_all":
        def call():  # even splits: chunk k of x goes to rank k, chunk k of out comes from it
            dist.all_to_all_single(out, x)
        # from rank k, its chunk r: the (k + 1) says who sent it, the 7r which chunk it was
        result = out
        expected = torch.cat([mine[r * piece:(r + 1) * piece] * (k + 1) for k in range(n)])
    else:
        def call():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % n),
                                                dist.P2POp(dist.irecv, out, (r - 1) % n)]):
                work.wait()
        result, expected = out, pattern * ((r - 1) % n + 1)
    return call, prepare, lambda: torch.equal(result, expected)


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


def sweep_entry(op: str, nbytes: int, ms: float, world: int) -> dict:
    """One row of a collectives sweep: algbw = bytes / time, busbw = algbw x BUS_FACTOR."""
    algbw = nbytes / (ms / 1e3) / 1e9
    def digits(x: float) -> float:
        return float(f"{x:.4g}")
    return {"op": op, "bytes": nbytes, "ms": digits(ms), "algbw_gbps": digits(algbw),
            "busbw_gbps": digits(algbw * BUS_FACTOR[op](world))}


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
    if args.dry_run:
        raise common.Skip("a sweep of collective times and their results: a dry run has neither")
    topo = common.setup(args)
    if topo.world_size == 1:
        ops = [op for op in ops if op != "sendrecv"]  # a send needs a peer
    sweep = []
    for op in ops:
        for nbytes in args.sizes:
            numel = nbytes // 4
            if op in ("all_gather", "reduce_scatter", "all_to_all"):
                numel -= numel % topo.world_size  # whole pieces, one per rank
            if numel == 0:
                continue  # smaller than one value (per rank)
            call, prepare, correct = collective(op, numel, topo)
            iters = args.iters if nbytes <= 8 * 2**20 else max(3, args.iters // 4)
            ms = time_calls(call, prepare, correct, f"{op} of {nbytes} bytes", iters,
                            warmup=2, device=topo.device)
            sweep.append(sweep_entry(op, numel * 4, ms, topo.world_size))
    record_sweep(args, topo, baseline=None, sweep=sweep)


if __name__ == "__main__":
    common.run_main(main)
