"""Every rank holds everything: DDP with AdamW, the replicated trainer ZeRO divides.

What it does: DistributedDataParallel as tuned in 01_ddp/optimized_ddp.py (25 MB buckets,
`gradient_as_bucket_view`, `static_graph`): each rank keeps the whole model, its whole gradient
(views into DDP's buckets, so no second copy) and the whole AdamW state, and all-reduces the
gradients each step.
Why it is the baseline: it is the fastest way to train a model that fits on every rank, and its
memory is what the ZeRO stages take apart. In fp32 every rank holds 16 bytes per parameter,
whatever the world size: 4 for the weight, 4 for its gradient, 8 for Adam's two moments.
(The ZeRO paper's 16 bytes are a mixed-precision count: 2 + 2 + 12 with fp32 master weights.)
Run:        torchrun --nproc_per_node=2 04_zero/baseline_zero.py --size small [--model llama]
Look for:   state MB = theory.state_mb (16P); `--summary` prints each rank's parameter,
            gradient and optimizer MB beside the formula. The ZeRO stages in `make zero report`
            are compared with this row's step time and peak memory.
Theory:     per rank 4P + 4P + 8P = 16P bytes (params, grads, optimizer), P = parameter count
            counted from the model (b bytes a value in place of 4 for another dtype); each rank
            sends 2(N-1)/N x 4P bytes a step (ring all-reduce).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


# Copied from 02_compression/baseline_compression.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               static_graph=True)


def add_summary_flag(parser: common.RecipeParser) -> None:
    """`--summary` (see `print_summary`); it prints more, so the run is no variant."""
    parser.add_argument("--summary", action="store_true",
                        help="print each rank's parameter, gradient and optimizer MB beside "
                             "the formula, its peak memory and the MB it sent per step")
    parser.output_only.add("summary")


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


# Copied from 01_ddp/baseline_ddp.py: ddp_bytes
def ddp_bytes(params: float, world: int, weight: float, grad: float, optim: float
              ) -> dict[str, float]:
    """DDP's bytes a rank: every weight, gradient and optimizer value kept (`weight`, `grad`,
    `optim` bytes each; fp32 AdamW: 4, 4, 8); sent a step, the gradients ring-all-reduced."""
    kept = {"params": weight * params, "grads": grad * params, "optim": optim * params}
    return {**kept, "state": sum(kept.values()),
            "sent": common.ring_allreduce_mb(grad * params, world) * 2**20}


def theory(model: torch.nn.Module, n: int) -> dict:
    """ddp_bytes at the run's shapes, in MB; sent, the gradients' all-reduce and, before each
    forward, DDP's broadcast of the buffers (BatchNorm's), if any."""
    param_count = sum(p.numel() for p in model.parameters())
    value_bytes = next(model.parameters()).element_size()  # AdamW keeps two values a weight
    predicted = ddp_bytes(param_count, n, value_bytes, value_bytes, 2 * value_bytes)
    figures = {f"{kind}_mb": predicted[kind] / 2**20
               for kind in ("params", "grads", "optim", "state")}
    figures["comm_mb"] = predicted["sent"] / 2**20 + (n - 1) / n * sum(
        b.numel() * b.element_size() for b in model.buffers()) / 2**20
    return figures


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, with torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    add_summary_flag(parser)
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    predicted = theory(model, topo.world_size)
    measured = common.state_split_mb(model, opt)
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=stats.comm_mb, theory=predicted, stage=0,
                  clip_grad_norm=args.clip_grad_norm, **measured)
    if args.summary:
        print_summary(args, topo, stats, baseline=None, measured=measured, theory=predicted)


if __name__ == "__main__":
    common.run_main(main)
