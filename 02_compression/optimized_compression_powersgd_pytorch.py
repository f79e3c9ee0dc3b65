"""PowerSGD with PyTorch's own DDP hook, `powerSGD_hook`, beside the hand-written recipe.

What it does: the same DDP as baseline_compression.py, with
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook` as its communication hook: after
`--start-iter` plain fp32 steps, every gradient matrix M worth it is all-reduced as two thin
factors, P = M Q and Q = M^T P, one power-iteration step per training step, Q warm-started and
what the approximation dropped fed back into the next step. Q starts from the same seeded
factors as optimized_compression_powersgd.py's, so with the same settings (there
`--uncompressed` with no names) both hooks give the same losses and bytes.
Why rank 64, not the hand-written 32: this hook has no per-tensor choice. It also compresses
the tied embedding/head, whose gradient is far from low rank here, and `min_compression_rate`
cannot leave it out alone (the MLP matrices share its shape at `small`); at rank 32 the losses
leave the tolerance. Rank 64 holds it, at fewer bytes saved (README).
Why it helps: r(n + m) values sent instead of n*m per matrix, in the hook a trainer already has.
Run:        torchrun --nproc_per_node=2 02_compression/optimized_compression_powersgd_pytorch.py
            --size small
Look for:   comm MB/step and max loss difference beside baseline_compression and the hand-written
            optimized_compression_powersgd in `make compression report`. On gloo with several
            buckets it records `skipped`: it issues collectives from future callbacks, in an
            order two ranks may not share.
Theory:     theory.compression = (sum of n*m + uncompressed) / (sum of r(n+m) + uncompressed),
            from the parameter shapes; each rank sends 2(N-1)/N x 4 bytes x that denominator, in
            three all-reduces a bucket (the uncompressed tensors, P, Q).
"""

import argparse
import sys
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Per step, against the baseline in the same dtype: 5% of the final loss at `small`, as the
# hand-written recipe's. The default rank holds it; rank 32 does not with the embedding/head
# compressed (README).
LOSS_TOLERANCE = {"fp32": 0.2, "bf16": 0.2}
# No planner row: compression changes the bytes DDP sends, not where state lives.
PLANNED = []
MIN_COMPRESSION_RATE = 2  # compress n x m only if r(n+m) is under half of n*m (PyTorch's default)


# Copied from 02_compression/optimized_compression_powersgd.py: as_matrix
def as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


# Copied from 02_compression/optimized_compression_powersgd.py: worth_compressing
def worth_compressing(matrix: torch.Tensor, rank: int) -> bool:
    n, m = matrix.shape
    return min(n, m, rank) * (n + m) * MIN_COMPRESSION_RATE < n * m


# Copied from 02_compression/optimized_compression_powersgd.py: initial_qs
def initial_qs(matrices: list[torch.Tensor], rank: int, seed: int) -> list[torch.Tensor]:
    """Random m x r starting factors, the same on every rank (drawn from a seeded generator),
    in each matrix's dtype."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(m.shape[1], min(*m.shape, rank), generator=gen).to(m.device, m.dtype)
            for m in matrices]


def seeded_powersgd_hook(seed: int):
    """PyTorch's powerSGD_hook, started from the hand-written recipe's Q.

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
                                  "optimized_compression_powersgd.py")
            matrices = [m for m in map(as_matrix, bucket.gradients())
                        if worth_compressing(m, rank)]
            if matrices:  # else its own start is empty too
                by_shape = defaultdict(list)
                for m, q in zip(matrices, initial_qs(matrices, rank, seed + index), strict=True):
                    by_shape[m.shape].append(q)
                state.q_memory_dict[index] = torch.cat(
                    [q.flatten() for group in by_shape.values() for q in group])
                state.p_memory_dict[index] = bucket.buffer().new_empty(
                    sum(m.shape[0] * min(*m.shape, rank) for m in matrices))
        return torch_powersgd.powerSGD_hook(state, bucket)

    return hook


# Copied from 02_compression/baseline_compression.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               static_graph=True)


# Copied from 02_compression/optimized_compression_powersgd.py: resolve_start_iter
def resolve_start_iter(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The plain steps before compression: --start-iter, or by default --warmup - 2. At least 2
    plain steps (DDP rebuilds its buckets in them), and at least 2 compressed warm-up steps, so
    that the last one, which measures bytes and memory, already carries the error-feedback
    residual like the timed steps. (A dry run's two: its DDP says why it cannot run.)"""
    if args.start_iter is None and args.warmup < 4 and args.dry_run is None:
        parser.error(f"--warmup {args.warmup} leaves no room for 2 plain steps (DDP rebuilds "
                     f"its buckets in them) and 2 compressed ones before the timed steps: use "
                     f"--warmup 4 or more")
    start_iter = args.warmup - 2 if args.start_iter is None else args.start_iter
    if start_iter > args.warmup - 2:
        parser.error(f"--start-iter {start_iter} leaves fewer than 2 compressed warm-up steps "
                     f"before the timed ones (--warmup {args.warmup}): raise --warmup or lower "
                     f"--start-iter")
    return start_iter


def sent_bytes(state: torch_powersgd.PowerSGDState, model: torch.nn.Module,
               world_size: int) -> float:
    """What the hook hands to its all-reduces per step: its P and Q buffers and the
    uncompressed tensors (it keeps no count of its own)."""
    values = sum(t.numel() for t in [*state.p_memory_dict.values(),
                                     *state.q_memory_dict.values()])
    values += sum(p.numel() for p in model.parameters()
                  if not worth_compressing(as_matrix(p), state.matrix_approximation_rank))
    return 2 * (world_size - 1) / world_size * 4 * values


# Copied from 02_compression/optimized_compression_powersgd.py: compression_theory
def compression_theory(model: torch.nn.Module, rank: int,
                       uncompressed: Collection[torch.Tensor]) -> float:
    """Values sent uncompressed over values sent by PowerSGD, from the parameter shapes; the
    `uncompressed` weights (found by identity) are sent whole."""
    full = sent = 0
    kept_whole = {id(p) for p in uncompressed}
    for p in model.parameters():  # a tied weight once, as DDP sends it
        matrix = as_matrix(p)
        full += p.numel()
        sent += (min(*matrix.shape, rank) * sum(matrix.shape)
                 if id(p) not in kept_whole and worth_compressing(matrix, rank) else p.numel())
    return full / sent


def main():
    parser = common.parser(__doc__)
    parser.set_defaults(warmup=6, steps=19)  # the folder's: 4 plain steps, 2 compressed untimed
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.add_argument("--rank", type=common.int_at_least(1), default=64,
                        help="rank r of the approximation P Q^T (default 64: with every matrix "
                             "compressed, 32 misses the loss tolerance at `small`, README)")
    parser.add_argument("--start-iter", type=common.int_at_least(2), default=None,
                        help="plain fp32 steps before compression: at least 2 and at most "
                             "--warmup - 2 (default: --warmup - 2, 4 of 25)")
    args = parser.parse_args()
    start_iter = resolve_start_iter(parser, args)
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    # the hook sends a matrix whole where the rank would not shrink it: at too high a rank it
    # runs as plain DDP, which the log and the record say rather than a table hiding it
    compressed = sum(worth_compressing(as_matrix(p), args.rank) for p in model.parameters())
    nothing_compressed = None if compressed else (
        f"powerSGD_hook at rank {args.rank} compresses no matrix of this model (n x m is sent as "
        f"a product only where r(n + m) is under 1/{MIN_COMPRESSION_RATE} of n*m): every "
        f"gradient is sent whole, as plain DDP; pass a lower --rank")
    if nothing_compressed:
        common.log(topo, nothing_compressed)
    model = wrap_ddp(model, topo, args.bucket_mb)
    state = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.rank,
        start_powerSGD_iter=start_iter, min_compression_rate=MIN_COMPRESSION_RATE,
        use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, seeded_powersgd_hook(args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    buckets = common.ddp_bucket_bytes(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    compression = compression_theory(model.module, args.rank, [])
    fp32_mb = common.ring_allreduce_mb(sum(buckets), topo.world_size)
    comm_mb = sent_bytes(state, model.module, topo.world_size) / 2**20
    common.record(args, topo, stats, baseline="baseline_compression", model=model.module,
                  overlapped=common.DDP_OVERLAP,
                  optimizer=opt, comm_mb=comm_mb, impl="torch", uncompressed=[],
                  start_iter=start_iter, collectives_per_step=3 * len(buckets),
                  compressed_matrices=compressed,
                  **({"compressed_matrices_reason": nothing_compressed} if not compressed else {}),
                  compression=fp32_mb / comm_mb if comm_mb else None,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  theory={"comm_mb": common.ring_allreduce_mb(grad_bytes, topo.world_size)
                          / compression, "compression": compression})


if __name__ == "__main__":
    common.run_main(main)
