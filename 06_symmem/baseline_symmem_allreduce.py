"""Collectives benchmark through the process group: all-reduce, all-gather, reduce-scatter and
send/recv over a sweep of message sizes.

What it does: the bandwidth test of nccl-tests and ml-engineering's all_reduce_bench: for each
operation and message size, a few untimed calls, then timed ones, each after a barrier so every
rank starts together, the device synchronised before the clock is read; a call's time is the
shortest any rank measured (the last rank out of the barrier waits for nobody), the median
kept, and every result checked. All-reduce sums `bytes` over the ranks in place; all-gather
assembles `bytes` from N pieces; reduce-scatter sums `bytes` and leaves each rank its 1/N;
send/recv sends `bytes` from every rank to the next (a ring, each rank sending and receiving
at once).
Why it is the baseline: it is what a training loop calls, `dist.all_reduce` and friends over
gloo on CPU (NCCL on GPUs): each call goes through the process group, and over gloo through a
TCP connection per pair even between processes on one host. That fixed cost per call is what
small messages pay; symmetric memory (optimized_symmem_allreduce.py) skips the library and the
sockets.
Run:        torchrun --nproc_per_node=2 06_symmem/baseline_symmem_allreduce.py
            ... --sizes 4K,64K,1M,16M,256M --ops all_reduce
Look for:   `make symmem report`: the bandwidth table, this script's time and busbw beside the
            symmetric-memory one's at each size.
Theory:     busbw = algbw x 2(N-1)/N for all-reduce, (N-1)/N for all-gather and reduce-scatter,
            1 for send/recv (the share of the message each rank's link must carry, so busbw is
            comparable with a link's bandwidth whatever N); algbw = bytes / time.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")


def collective(op: str, numel: int, topo: common.Topology):
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
    else:
        def call():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % n),
                                                dist.P2POp(dist.irecv, out, (r - 1) % n)]):
                work.wait()
        result, expected = out, pattern * ((r - 1) % n + 1)
    return call, prepare, lambda: torch.equal(result, expected)


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--sizes", type=common.message_sizes, default="4K,64K,1M,16M",
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
            call, prepare, correct = collective(op, numel, topo)
            iters = args.iters if nbytes <= 8 * 2**20 else max(3, args.iters // 4)
            ms = common.time_calls(call, prepare, correct, f"{op} of {nbytes} bytes", iters,
                                   warmup=2, device=topo.device)
            sweep.append(common.sweep_entry(op, numel * 4, ms, topo.world_size))
    common.record_sweep(args, topo, baseline=None, sweep=sweep)


if __name__ == "__main__":
    common.run_main(main)
