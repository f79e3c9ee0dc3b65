"""PyTorch's own ZeRO on the same workload as the hand-written stages: the side-by-side check.

What it does: `--stage 1` (the default) trains with DDP, tuned as baseline_zero.py, and
torch.distributed.optim.ZeroRedundancyOptimizer around AdamW: DDP all-reduces the whole
gradient, each rank runs AdamW on the parameters assigned to it (whole tensors, spread over the
ranks greedily by size) and broadcasts them to the others. `--stage 3` applies FSDP2's
`fully_shard` to each transformer block and then to the model (the embeddings and final norm):
the same units as optimized_zero3.py's buckets, with FSDP2's own prefetching, and under bf16
autocast the same dtypes (MixedPrecisionPolicy: gathered in bf16, reduced in fp32);
`--stage 3 --cpu-offload` adds its CPUOffloadPolicy (CUDA), beside optimized_zero3_offload.py.
Why it is here: a technique written by hand is checked against the library's. The losses must
match the hand-written stage's to float rounding (tests/test_zero.py checks it), and
`make zero report` puts the step time, peak memory and bytes sent side by side.
Run:        torchrun --nproc_per_node=2 04_zero/optimized_zero_pytorch.py --size small
            torchrun --nproc_per_node=2 04_zero/optimized_zero_pytorch.py --stage 3 --model llama
Look for:   the rows `optimized_zero_pytorch` (beside optimized_zero1) and
            `optimized_zero_pytorch --stage 3` (beside optimized_zero3): step time, peak MB,
            state MB and comm MB/step.
Theory:     P = parameter count (4 bytes a value in fp32). Stage 1: per rank 4P + 4P + 8P/N
            bytes (its share of whole tensors is only close to 1/N); sent 2(N-1)/N x 4P
            all-reduced plus (N-1)/N x 4P broadcast (counted as a pipelined broadcast), 1.5x
            the hand-written ZeRO-1's reduce-scatter + all-gather, and DDP's broadcast of the
            buffers, if any. Stage 3: per rank 16P/N bytes; sent (N-1)/N x 4 bytes x (3 x the
            blocks' parameters + 2 x the root's, which FSDP2 keeps gathered to backward's end;
            under bf16 the all-gathers move 2 bytes a value).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Exact in fp32: the same sums, in another order at most. Under bf16 autocast (GPU) such
# last-bit differences grow through the low-precision steps, as for FSDP in 03_fsdp.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# No planner row: PyTorch's ZeRO, the same state and bytes as the hand-written stages' rows.
PLANNED = []


def pytorch_zero1(model: nn.Module, topo: common.Topology, lr: float,
                  group: dist.ProcessGroup | None = None):
    """DDP + ZeroRedundancyOptimizer, both over `group` (None: the world). Returns the model to
    train, the optimizer to step and the one whose state this rank holds
    (ZeroRedundancyOptimizer's AdamW over its share). Ranks seeded apart train alike: DDP
    broadcasts the group's first rank's parameters and buffers when it wraps the model."""
    ddp = DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
              process_group=group, gradient_as_bucket_view=True, static_graph=True)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  process_group=group, lr=lr)
    return ddp, opt, opt.optim


# Copied from 03_fsdp/optimized_fsdp.py: same_weights_on_every_rank
def same_weights_on_every_rank(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every rank of the mesh starts from the mesh's first rank's parameters and buffers, as DDP
    does: fully_shard keeps each rank's slice of that rank's own copy, so ranks seeded apart
    would train a patchwork of initializations. Dim by dim: after dim 0 each rank holds its
    dim-0 group's first rank's tensors, after the last every rank holds the mesh's first's."""
    tensors = [*model.parameters(), *model.buffers()]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        for t in tensors:
            dist.broadcast(t.detach(), dist.get_global_rank(group, 0), group=group)


def pytorch_zero3(model: nn.Module, blocks: list[nn.Module], lr: float,
                  group: dist.ProcessGroup | None = None, param_dtype: torch.dtype | None = None,
                  offload: bool = False):
    """FSDP2 on each block, then on the model for what is left (embeddings, final norm, head:
    the root unit of the hand-written stages), over `group` (None: the world) as a 1-D mesh,
    every rank starting from the group's first rank's weights, as under DDP. `param_dtype` as
    ZeRO3's: gathered in it, reduced in the parameters' own dtype. `offload`: FSDP2's
    CPUOffloadPolicy, the shards, their gradients and AdamW's state in host memory and the step
    there (optimized_zero3_offload.py's by hand)."""
    param = next(model.parameters())
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, param.device.type)
    same_weights_on_every_rank(model, mesh)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                     reduce_dtype=param.dtype if param_dtype else None)
    policy = {"mesh": mesh, "mp_policy": mp_policy,
              **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
    for block in blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, opt


# Copied from 04_zero/baseline_zero.py: add_summary_flag
def add_summary_flag(parser: common.RecipeParser) -> None:
    """`--summary` (see `print_summary`); it prints more, so the run is no variant."""
    parser.add_argument("--summary", action="store_true",
                        help="print each rank's parameter, gradient and optimizer MB beside "
                             "the formula, its peak memory and the MB it sent per step")
    parser.output_only.add("summary")


# Copied from 04_zero/baseline_zero.py: print_summary
def print_summary(args: argparse.Namespace, topo: common.Topology, stats: common.Stats, *,
                  baseline: str | None, measured: dict[str, float], theory: dict) -> None:
    """`--summary`: per rank, the state MB counted from its tensors and the MB it sent, each
    beside its formula, and its peak beside the baseline's last recorded run like this one."""
    peak = stats.memory["total"] if stats.memory else common.peak_memory_mb(topo.device)
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, {**measured, "peak_mb": peak, "comm_mb": stats.comm_mb})
    if not topo.is_main:
        return
    from tabulate import tabulate

    here = common.base_record(args, topo, baseline, "ok", None)
    base = next((r for r in reversed(common.load_results(args.results))
                 if r.get("script") == baseline and r.get("status") == "ok"
                 and common.run_key(r) == common.run_key(here)), None)
    kinds = ["params_mb", "grads_mb", "optim_mb"]
    table = [[rank, *[f"{row[k]:,.2f} ({theory[k]:,.2f})" for k in kinds],
              f"{sum(row[k] for k in kinds):,.2f} ({theory['state_mb']:,.2f})",
              f"{row['peak_mb']:,.1f}" + (f" ({base['peak_mem_mb']:,.1f})" if base else ""),
              f"{row['comm_mb']:,.2f} ({theory['comm_mb']:,.2f})"] for rank, row in enumerate(rows)]
    print(tabulate(table, ["rank", "params MB", "grads MB", "optim MB", "state MB", "peak MB",
                           "comm MB/step"], tablefmt="github"))
    compared = "" if baseline is None else f" ({baseline}'s busiest rank)" if base else \
        f"; {baseline} has no recorded run like this one to compare with"
    print(f"measured (formula); peak = live tensor MB at the step's peak{compared}", flush=True)


# Copied from 04_zero/optimized_zero1.py: zero1_bytes
def zero1_bytes(params: float, world: int, weight: float, grad: float, optim: float,
                sent_values: float | None = None, buffer_bytes: float = 0.0) -> dict[str, float]:
    """ZeRO-1's bytes a rank, from the parameter count and the bytes a value of each kind:
    every weight and gradient kept, the optimizer's state 1/N. Sent a step: the gradients
    reduce-scattered and the updated weights all-gathered, (N-1)/N of `sent_values` each (the
    buckets' values, their padding included; `params` if not given), and the buffers' broadcast."""
    share = (world - 1) / world
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params / world}
    values = params if sent_values is None else sent_values
    return {**kept, "state": sum(kept.values()),
            "sent": share * (grad + weight) * values + share * buffer_bytes}


# Copied from 04_zero/optimized_zero3.py: zero3_bytes
def zero3_bytes(params: float, blocks: list[float], root: float, world: int, weight: float,
                grad: float, optim: float, gather: float, buffer_bytes: float = 0.0,
                reduce: float | None = None) -> dict[str, float]:
    """ZeRO-3's bytes a rank, from value counts: weights, gradients and the optimizer's state
    1/N each (`weight`, `grad`, `optim` bytes a value). Sent a step: each block's values
    (`blocks`) all-gathered twice, `gather` bytes a value (the compute dtype), the `root`'s once
    (kept gathered from forward to backward), every value reduce-scattered once, `reduce` bytes
    (default `grad`), (N-1)/N of each, and the buffers' broadcast. Held in full at once
    (`gathered`, beyond the shards): at most the root and two neighbouring blocks. The planner's
    figures are FSDP full's (03_fsdp/optimized_fsdp.py's fsdp_bytes), yet the two stay apart:
    each counts its own implementation's padding, here the flat buckets' (under N values a
    bucket)."""
    share = (world - 1) / world
    kept = {"params": weight * params / world, "grads": grad * params / world,
            "optim": optim * params / world}
    two_blocks = max((a + b for a, b in zip(blocks, blocks[1:], strict=False)), default=sum(blocks))
    reduce = grad if reduce is None else reduce
    sent = share * ((2 * gather + reduce) * sum(blocks) + (gather + reduce) * root + buffer_bytes)
    return {**kept, "state": sum(kept.values()), "sent": sent,
            "gathered": gather * (root + two_blocks)}


def theory(stage: int, model: nn.Module, blocks: list[nn.Module], n: int, bf16: bool) -> dict:
    """The stage's bytes at the run's shapes, in MB, from the model before PyTorch's ZeRO wraps
    it (the weights' dtype: 4 bytes a value in fp32)."""
    param_count = sum(p.numel() for p in model.parameters())
    block_values = [sum(p.numel() for p in block.parameters()) for block in blocks]
    bytes_per = next(model.parameters()).element_size()
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    if stage == 1:  # DDP broadcasts the buffers (BatchNorm's) before each forward
        predicted = zero1_bytes(param_count, n, bytes_per, bytes_per, 2 * bytes_per,
                                buffer_bytes=buffer_bytes)
        # DDP all-reduces the gradients where ZeRO-1 reduce-scatters them: (N-1)/N of them more
        predicted["sent"] += (n - 1) / n * bytes_per * param_count
    else:
        # Each value is all-gathered twice (in 2 bytes under bf16) and reduce-scattered once;
        # the root's are gathered once: they stay gathered.
        predicted = zero3_bytes(param_count, block_values, param_count - sum(block_values), n,
                                bytes_per, bytes_per, 2 * bytes_per, 2 if bf16 else bytes_per)
    figures = {f"{kind}_mb": predicted[kind] / 2**20
               for kind in ("params", "grads", "optim", "state")}
    figures["comm_mb"] = predicted["sent"] / 2**20
    return figures


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--stage", type=int, choices=[1, 3], default=1,
                        help="1: DDP + ZeroRedundancyOptimizer; 3: FSDP2 fully_shard per block")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, with torch.nn.utils.clip_grad_norm_: on DDP's full "
                        "gradients (stage 1), on FSDP2's DTensor shards (stage 3, the norm "
                        "all-reduced) (default: no clipping)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="with --stage 3: FSDP2's CPUOffloadPolicy, the shards and AdamW's "
                             "state in host memory (CUDA only)")
    add_summary_flag(parser)
    args = parser.parse_args()
    if args.cpu_offload and args.stage != 3:
        parser.error("--cpu-offload is FSDP2's: add --stage 3")
    if args.cpu_offload and args.clip_grad_norm:
        parser.error("--clip-grad-norm with --cpu-offload: clip_grad_norm_ would all-reduce the "
                     "norm of host-memory gradients over NCCL (pytorch/pytorch#148532): drop one")
    if args.cpu_offload and not torch.cuda.is_available():
        raise common.Skip("--cpu-offload moves the shards from the GPU to host memory; a CPU run "
                          "keeps them there already: run on CUDA")
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    blocks = common.transformer_blocks(model)
    predicted = theory(args.stage, model, blocks, topo.world_size, args.dtype == "bf16")
    if args.stage == 1:
        model, opt, counted_opt = pytorch_zero1(model, topo, args.lr)
    else:
        model, opt, counted_opt = pytorch_zero3(
            model, blocks, args.lr, param_dtype=torch.bfloat16 if args.dtype == "bf16" else None,
            offload=args.cpu_offload)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, counted_opt))
    measured = common.state_split_mb(model, counted_opt)
    common.record(args, topo, stats, baseline="baseline_zero", model=model, optimizer=counted_opt,
                  overlapped={**common.DDP_OVERLAP, **common.FSDP_OVERLAP},
                  comm_mb=stats.comm_mb, theory=predicted, stage=args.stage,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  cpu_offload=args.cpu_offload, **measured)
    if args.summary:
        print_summary(args, topo, stats, baseline="baseline_zero", measured=measured,
                      theory=predicted)


if __name__ == "__main__":
    common.run_main(main)
