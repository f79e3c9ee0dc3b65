"""PowerSGD by hand (Vogels et al. 2019): each gradient matrix sent as a rank-r product P Q^T.

What it does: the same DDP as baseline_compression.py, with a communication hook that, for
every gradient matrix M (n x m) in a bucket, all-reduces two thin factors instead of M:
    P = M Q            all-reduce P, then orthogonalize its columns
    Q = M^T P          all-reduce Q, average
    M ~ P Q^T          the rank-r projection of the averaged M onto P's columns
One step of power iteration per training step; Q is warm-started from the previous step, so
the iteration keeps converging across steps while the gradient changes slowly. 1-D tensors
(biases, norms), matrices too small to gain (r(n + m) more than half of n*m) and the ones named
by `--uncompressed` go as they are, in the same all-reduce as the P factors. The first
`--start-iter` steps are plain fp32 all-reduces, as PyTorch's powerSGD_hook advises (about the
first 10% of training; DDP also rebuilds its buckets meanwhile): here all warm-up steps but the last
two, so that the one that measures memory already holds the error-feedback residual.
Error feedback: each rank keeps M - P Q^T of its compensated gradient and adds it to the next
step's gradient before compressing, so what the approximation dropped is delayed, never lost.
The algorithm is linear in M up to each all-reduce, so only the sum of the ranks' residuals
matters: Vogels et al. keep M - P Q_local^T (before Q's all-reduce), this recipe and PyTorch
M - P Q^T (after it, one matmul less); the sums are equal.
Collective order: PyTorch's `powerSGD_hook` issues the P and Q all-reduces from future
callbacks, which run when the previous collective of that bucket completes; with several
buckets two ranks can then issue bucket 1's first all-reduce and bucket 0's second in opposite
orders, and gloo fails ("Received data size doesn't match expected size", or a hang until the
timeout). Here every collective is issued from the hook on the autograd thread, in bucket
order (DDP calls hooks in bucket order on every rank), and the completion callback only
computes: the order is the same on every rank, on gloo and on NCCL.
Run:        torchrun --nproc_per_node=2 02_compression/optimized_compression_powersgd.py
            --impl torch --uncompressed: PyTorch's powerSGD_hook, every matrix compressed
Look for:   comm MB/step against baseline_compression's (4.7x fewer at `small`), the speedup at
            LINK=1gbit, and the max loss difference inside its tolerance.
Theory:     theory.compression = (sum of n*m + uncompressed) / (sum of r(n+m) + uncompressed),
            from the parameter shapes; each rank sends 2(N-1)/N x 4 bytes x that denominator.
            Accuracy depends on how much of each gradient lies in its top r directions. This
            workload's tokens follow a random permutation of the vocabulary: the tied
            embedding/head and the MLPs learn it, and their gradients are far from low rank
            (at step 20 the top 8 directions hold a third of the embedding's energy and 60% of
            an MLP matrix's, against 94% of an attention matrix's). Rank 32 with the embedding
            sent whole is the cheapest setting that holds the tolerance here (README's sweep).
"""

import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Per step, against the baseline in the same dtype: 5% of the final loss at `small`, in fp32 and
# in bf16 (whose own drift, about 5e-2, is well inside it). The default rank holds it; rank 16
# and below do not on this workload (see "Theory" above and the README's sweep).
LOSS_TOLERANCE = {"fp32": 0.2, "bf16": 0.2}
MIN_COMPRESSION_RATE = 2  # compress n x m only if r(n+m) is under half of n*m (PyTorch's default)


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def matrix_views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """The tensors packed in a flat bucket, each viewed as a matrix."""
    parts = flat.split([math.prod(s) for s in shapes])
    return [as_matrix(part.view(s)) for part, s in zip(parts, shapes, strict=True)]


def worth_compressing(matrix: torch.Tensor, rank: int) -> bool:
    n, m = matrix.shape
    return min(n, m, rank) * (n + m) * MIN_COMPRESSION_RATE < n * m


def initial_qs(matrices: list[torch.Tensor], rank: int, seed: int) -> list[torch.Tensor]:
    """Random m x r starting factors, the same on every rank (drawn from a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(m.shape[1], min(*m.shape, rank), generator=gen).to(m.device)
            for m in matrices]


@dataclass
class PowerSGDState:
    world_size: int
    rank: int  # of the approximation
    start_iter: int
    seed: int
    uncompressed: set[int] = field(default_factory=set)  # ids of parameters sent as they are
    step: int = 0
    sent_bytes: float = 0  # to peers, this step
    collectives: int = 0  # issued this step
    residual: dict = field(default_factory=dict)  # bucket -> what the approximation dropped
    qs: dict = field(default_factory=dict)  # bucket -> this step's Q factors, the next one's start


def powersgd_allreduce(state: PowerSGDState, bucket: int, grad: torch.Tensor,
                       shapes: list[torch.Size],
                       compress: list[bool]) -> torch.futures.Future[torch.Tensor]:
    """Average a flat gradient holding tensors of `shapes`, in place, the ones `compress`
    marks as rank-r products; the future holds it."""
    N = state.world_size
    if bucket not in state.residual:
        state.residual[bucket] = torch.zeros_like(grad)
    residual = state.residual[bucket]
    if residual.shape != grad.shape:  # a rebuild must not misalign the feedback
        raise RuntimeError(f"DDP bucket {bucket} changed size after compression began: "
                           f"raise --start-iter")
    grad.add_(residual)  # error feedback; `grad` becomes the result below
    pairs = zip(matrix_views(grad, shapes), matrix_views(residual, shapes), compress,
                strict=True)
    compressed, plain = [], []
    for m, e, c in pairs:
        if c:
            compressed.append((m, e))
        else:
            plain.append(m)
    matrices = [m for m, _ in compressed]
    qs = state.qs.get(bucket) or initial_qs(matrices, state.rank, state.seed + bucket)

    ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
    first = torch.cat([t.flatten() for t in plain + ps])  # uncompressed tensors ride along
    dist.all_reduce(first)
    state.sent_bytes += 2 * (N - 1) / N * first.nbytes
    state.collectives += 1
    plain_numel = sum(t.numel() for t in plain)
    plain_sums, p_sums = first.split([plain_numel, first.numel() - plain_numel])
    for t, total in zip(plain, plain_sums.split([t.numel() for t in plain]), strict=True):
        t.copy_(total.view_as(t)).div_(N)
    if not matrices:  # nothing here worth compressing (a small model at a high rank): done
        done = torch.futures.Future()
        done.set_result(grad)
        return done
    ps = [torch.linalg.qr(total.view_as(p)).Q  # an orthonormal basis of the summed P
          for total, p in zip(p_sums.split([p.numel() for p in ps]), ps, strict=True)]

    second = torch.cat([(m.T @ p).flatten() for m, p in zip(matrices, ps, strict=True)])
    work = dist.all_reduce(second, async_op=True)
    state.sent_bytes += 2 * (N - 1) / N * second.nbytes
    state.collectives += 1

    def decompress(_):
        q_means = [q.view(q0.shape) for q, q0 in
                   zip(second.div_(N).split([q.numel() for q in qs]), qs, strict=True)]
        for (m, e), p, q in zip(compressed, ps, q_means, strict=True):
            approx = p @ q.T
            torch.sub(m, approx, out=e)  # what this rank's compensated gradient lost
            m.copy_(approx)
        state.qs[bucket] = q_means
        return grad

    return work.get_future().then(decompress)


def powersgd_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: plain fp32 all-reduce for `start_iter` steps, then PowerSGD."""
    grad = bucket.buffer()
    if bucket.index() == 0:
        state.sent_bytes = state.collectives = 0  # a new step
    if state.step < state.start_iter:
        state.sent_bytes += 2 * (state.world_size - 1) / state.world_size * grad.nbytes
        state.collectives += 1
        grad.div_(state.world_size)
        fut = dist.all_reduce(grad, async_op=True).get_future().then(lambda f: f.value()[0])
    else:
        params = bucket.parameters()
        fut = powersgd_allreduce(
            state, bucket.index(), grad, [p.shape for p in params],
            [id(p) not in state.uncompressed and worth_compressing(as_matrix(p), state.rank)
             for p in params])
    if bucket.is_last():
        state.step += 1
    return fut


def torch_powersgd_hook(seed: int):
    """PyTorch's own powerSGD_hook (`--impl torch`), started from the same Q as ours.

    Its Q buffer holds the factors grouped by matrix shape; filling it before its first
    compressed step makes it skip its own (numpy-seeded) random start."""

    def hook(state: torch_powersgd.PowerSGDState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index, rank = bucket.index(), state.matrix_approximation_rank
        if state.iter >= state.start_powerSGD_iter and index not in state.q_memory_dict:
            if dist.get_backend() == "gloo" and dist.get_world_size() > 1 and \
                    not bucket.is_last():
                raise common.Skip("PyTorch's powerSGD_hook issues collectives from future "
                                  "callbacks, which hang or abort on gloo with several "
                                  "buckets: raise --bucket-mb above the gradient MB, or use "
                                  "--impl hand")
            matrices = [m for m in map(as_matrix, bucket.gradients())
                        if worth_compressing(m, rank)]
            by_shape = defaultdict(list)
            for m, q in zip(matrices, initial_qs(matrices, rank, seed + index), strict=True):
                by_shape[m.shape].append(q)
            state.q_memory_dict[index] = torch.cat(
                [q.flatten() for group in by_shape.values() for q in group])
            state.p_memory_dict[index] = bucket.buffer().new_empty(
                sum(m.shape[0] * min(*m.shape, rank) for m in matrices))
        return torch_powersgd.powerSGD_hook(state, bucket)

    return hook


def torch_hook_sent_bytes(state, model: torch.nn.Module, world_size: int) -> float:
    """What PyTorch's hook hands to its all-reduces per step: its P and Q buffers and the
    uncompressed tensors (it keeps no count of its own)."""
    values = sum(t.numel() for t in [*state.p_memory_dict.values(),
                                     *state.q_memory_dict.values()])
    values += sum(p.numel() for p in model.parameters()
                  if not worth_compressing(as_matrix(p), state.matrix_approximation_rank))
    return 2 * (world_size - 1) / world_size * 4 * values


# Copied from 02_compression/baseline_compression.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, static_graph=True)


def compression_theory(model: torch.nn.Module, rank: int, uncompressed: list[str]) -> float:
    """Values sent uncompressed over values sent by PowerSGD, from the parameter shapes."""
    full = sent = 0
    for name, p in model.named_parameters():
        matrix = as_matrix(p)
        full += p.numel()
        sent += (min(*matrix.shape, rank) * sum(matrix.shape)
                 if name not in uncompressed and worth_compressing(matrix, rank) else p.numel())
    return full / sent


def main():
    parser = common.parser(__doc__)
    parser.set_defaults(warmup=6, steps=19)  # the folder's: 4 plain steps, 2 compressed untimed
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.add_argument("--rank", type=common.int_at_least(1), default=32,
                        help="rank r of the approximation P Q^T (default 32: the lowest of 4 to "
                             "64 that holds the loss tolerance at `small`, README)")
    parser.add_argument("--start-iter", type=common.int_at_least(2), default=None,
                        help="plain fp32 steps before compression: at least 2 (DDP rebuilds its "
                             "buckets in them) and at most --warmup - 2, so that the last warm-up "
                             "step, which measures bytes and memory, is a compressed step like "
                             "the timed ones, not the first (default: --warmup - 2, 4 of 25)")
    parser.add_argument("--uncompressed", nargs="*", metavar="NAME", default=None,
                        help="parameters sent in fp32, never compressed (default: the GPT's "
                             "tied embedding/head, tok_emb.weight; none named: every matrix "
                             "worth it is compressed)")
    parser.add_argument("--impl", choices=["hand", "torch"], default="hand",
                        help="this recipe's hook, or PyTorch's powerSGD_hook with the same "
                             "settings")
    args = parser.parse_args()
    if args.uncompressed is None:
        args.uncompressed = ["tok_emb.weight"] if args.model == "gpt" else []
    if args.impl == "torch" and args.uncompressed:
        parser.error("PyTorch's powerSGD_hook compresses every matrix worth it, with no "
                     "per-tensor choice: add --uncompressed with no names to compare")
    if args.start_iter is None:
        if args.warmup < 4:
            parser.error(f"--warmup {args.warmup} leaves no room for 2 plain steps (DDP rebuilds "
                         f"its buckets in them) and 2 compressed ones before the timed steps: use "
                         f"--warmup 4 or more")
        args.start_iter = args.warmup - 2
    if args.start_iter > args.warmup - 2:
        parser.error(f"--start-iter {args.start_iter} leaves fewer than 2 compressed warm-up "
                     f"steps before the timed ones (--warmup {args.warmup}): raise --warmup or "
                     f"lower --start-iter")
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    named = dict(model.named_parameters())
    if unknown := [name for name in args.uncompressed if name not in named]:
        raise common.SetupError(f"--uncompressed {' '.join(unknown)}: not a parameter of the "
                                f"model; name them as named_parameters() does, e.g. "
                                f"{', '.join(list(named)[::len(named) // 3])}")
    model = wrap_ddp(model, topo, args.bucket_mb)
    if args.impl == "hand":
        state = PowerSGDState(topo.world_size, args.rank, args.start_iter, args.seed,
                              {id(named[name]) for name in args.uncompressed})
        model.register_comm_hook(state, powersgd_hook)
    else:
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.start_iter, min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, torch_powersgd_hook(args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)  # first, so the gradients still exist when state is counted
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    buckets = common.ddp_bucket_bytes(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    compression = compression_theory(model.module, args.rank, args.uncompressed)
    fp32_mb = common.ring_allreduce_mb(sum(buckets), topo.world_size)
    comm_mb = (state.sent_bytes if args.impl == "hand" else
               torch_hook_sent_bytes(state, model.module, topo.world_size)) / 2**20
    common.record(args, topo, stats, baseline="baseline_compression", model=model.module,
                  optimizer=opt, comm_mb=comm_mb, impl=args.impl,
                  uncompressed=args.uncompressed, start_iter=args.start_iter,
                  collectives_per_step=state.collectives if args.impl == "hand" else
                  3 * len(buckets),
                  compression=fp32_mb / comm_mb if comm_mb else None,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  theory={"comm_mb": common.ring_allreduce_mb(grad_bytes, topo.world_size)
                          / compression, "compression": compression})


if __name__ == "__main__":
    common.run_main(main)
