"""DDP with PyTorch's Muon: every rank orthogonalizes every matrix, the work ownership divides.

What it does: DistributedDataParallel as tuned in 01_ddp/optimized_ddp.py, with
`torch.optim.Muon` on the hidden matrices (every 2-D weight of the transformer blocks) and AdamW
on the rest (embeddings, norms, biases, a head), as Muon's authors prescribe. Muon keeps one
momentum buffer a matrix and each step replaces the (Nesterov) momentum M by its nearest
semi-orthogonal matrix, five Newton-Schulz iterations X <- aX + (bA + cA^2)X, A = XX^T, in bf16
on the shorter side (torch's, after Keller Jordan's). Both take the same learning rate:
`adjust_lr_fn="match_rms_adamw"` scales Muon's update to AdamW's RMS (Moonlight's rule).
Why it is the baseline: it is how Muon runs on many ranks without a distributed optimizer.
After the all-reduce every rank holds the same gradient, so every rank runs the same Newton-
Schulz iterations on every matrix: N times the work of one, a cost that grows as d^3 a layer
while the step's forward and backward grow as d^2 a token.
Run:        torchrun --nproc_per_node=2 04_zero/baseline_muon.py --size small [--model llama]
Look for:   optimizer_ms beside step_ms (the optimizer alone, timed with the step), and
            theory.ns_gflop_rank: the Newton-Schulz work each rank does, all of it here.
            optimized_zero1_muon.py divides it between the ranks.
Theory:     Newton-Schulz on an m x n matrix (m <= n), k iterations: k(4m^2 n + 2m^3) FLOPs.
            Per rank 4P + 4P bytes (weights, gradients) + 4 a matrix value (momentum) + 8 a
            value of the rest (Adam's moments), in fp32; sent a step 2(N-1)/N x 4P (ring
            all-reduce), P = parameter count.
"""

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Muon's settings in every script of the folder: AdamW's learning rate for both (Muon's update
# scaled to AdamW's RMS, Moonlight's rule) and Moonlight's weight decay, 0.1, for both.
MUON = {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1, "ns_steps": 5}
SKIPS = {"resnet": "Muon orthogonalizes a decoder's hidden matrices; a ResNet's are "
                   "convolutions: run --model gpt or llama",
         "moe": "an expert no token reached has no gradient, which torch.optim.Muon skips and a "
                "flat gradient buffer cannot tell from a zero one: run --model gpt or llama"}


# Copied from 02_compression/baseline_compression.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """01_ddp's tuned wrapper: large buckets, gradients as views into them, a static graph; over
    the ranks of `group` (None: the world), from its first rank's weights and buffers."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
               static_graph=True)


def hidden_matrices(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Parameter]:
    """Muon's parameters: every 2-D weight of the repeated blocks (attention's and the MLP's
    projections), in the model's order. The embeddings and the head are 2-D too but take AdamW:
    a row of an embedding is looked up, not multiplied, and the head's output is the loss's."""
    in_blocks = {p for block in blocks for p in block.parameters()}
    return [p for p in model.parameters() if p in in_blocks and p.ndim == 2]


class MuonWithAdamW:
    """torch.optim.Muon over `matrices` and torch.optim.AdamW over every other parameter of
    `model`, stepped as one optimizer; `param_groups` and `state` are both's (common counts
    them)."""

    def __init__(self, model: nn.Module, matrices: list[nn.Parameter], lr: float):
        rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
        self.muon = torch.optim.Muon(matrices, lr=lr, **MUON)
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=MUON["weight_decay"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def timed(step, device: torch.device, seconds: list[float]) -> None:
    """Run `step()` and append its seconds, the device synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds.append(time.perf_counter() - start)

def optimizer_ms(seconds: list[float], args) -> float | None:
    """The timed steps' median optimizer time in ms (`timed`'s seconds); none for a dry run,
    whose fake tensors take no real time."""
    if common.dry_run():
        return None
    return round(common.summarize_times(common.of_timed_steps(seconds, args))[0], 3)



def newton_schulz_flops(shape: torch.Size | tuple[int, int], steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a matrix of `shape`, on its shorter
    side m (n the longer): A = XX^T (2m^2 n), B = bA + cA^2 (2m^3), X <- aX + BX (2m^2 n)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def planned_matrix_shapes(plan: "PlanInput") -> list[tuple[int, int]]:
    """The planner's decoder's hidden matrices: a layer's q and o (h x h), k and v (the KV width
    x h) and as many MLP matrices (ffn x h) as its blocks' parameters hold (a GPT's 2, a
    Llama's 3). A GPT's fused qkv counts as three: Newton-Schulz costs it 14h^3 FLOPs a step
    where the three cost 18h^3, within what the planner prices."""
    h, kv = plan.hidden, plan.kv_width or plan.hidden
    attention = [(h, h), (kv, h), (kv, h), (h, h)]
    mlp = round((plan.blocks / plan.layers - 2 * h * h - 2 * kv * h) / (plan.ffn * h))
    return (attention + [(plan.ffn, h)] * mlp) * plan.layers


def theory(model: nn.Module, matrices: list[nn.Parameter], n: int) -> dict:
    """Per rank in MB: weights and gradients whole, Muon's momentum for every matrix, Adam's
    two moments for the rest; sent, the gradients' ring all-reduce. The Newton-Schulz GFLOP a
    rank runs a step: every matrix's."""
    value_bytes = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    matrix_values = sum(p.numel() for p in matrices)
    optim = value_bytes * (matrix_values + 2 * (params - matrix_values))
    figures = {"params_mb": value_bytes * params / 2**20, "grads_mb": value_bytes * params / 2**20,
               "optim_mb": optim / 2**20, "comm_mb": common.ring_allreduce_mb(
                   value_bytes * params, n)}
    figures["state_mb"] = figures["params_mb"] + figures["grads_mb"] + figures["optim_mb"]
    figures["ns_gflop_rank"] = sum(newton_schulz_flops(p.shape, MUON["ns_steps"])
                                   for p in matrices) / 1e9
    return figures


def planned_ddp_muon(plan: "PlanInput") -> dict[str, float] | None:
    """The planner's DDP + Muon row: DDP's weights and gradients, Muon's one value a matrix
    weight and AdamW's state for the rest (half of AdamW's bytes a value for a matrix), the
    gradients all-reduced, and every matrix's Newton-Schulz on every GPU. None for an MoE,
    whose experts this folder leaves to 08_moe."""
    if plan.experts:
        return None
    w, g, o = plan.state_bytes
    shapes = planned_matrix_shapes(plan)
    matrices = sum(m * n for m, n in shapes)
    return {"state": (w + g) * plan.params + o / 2 * matrices + o * (plan.params - matrices),
            "sent": common.ring_allreduce_mb(g * plan.params, plan.gpus) * 2**20,
            "cast": plan.cast(plan.params), "fp32_residual": True,
            "optimizer_flops": sum(newton_schulz_flops(s, MUON["ns_steps"]) for s in shapes)}


def main():
    parser = common.parser(__doc__, skips=SKIPS)
    parser.add_argument("--bucket-mb", type=common.positive_float, default=25.0,
                        help="gradient bucket size in MiB (DDP's default: 25)")
    parser.set_defaults(steps=10)  # the optimizer is most of a step: fewer steps fit make zero
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    matrices = hidden_matrices(model, common.transformer_blocks(model))
    model = wrap_ddp(model, topo, args.bucket_mb)
    opt = MuonWithAdamW(model.module, matrices, args.lr)
    optimizer_seconds = []

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        timed(opt.step, topo.device, optimizer_seconds)
        return loss

    stats = common.timed_steps(train_step, batches, args, topo,
                               memory_of=(model, opt.muon, opt.adamw))
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP, comm_mb=stats.comm_mb,
                  theory=theory(model.module, matrices, topo.world_size),
                  optimizer_ms=optimizer_ms(optimizer_seconds, args),
                  **common.state_split_mb(model.module, opt))


# The planner's rows (report/planner.py reads this; the script never does), with --muon only:
# Muon is an optimizer to choose, not a layout; this is its simplest.
PLANNED = [{"strategy": "DDP + Muon", "place": 12, "figures": planned_ddp_muon, "muon": True}]


if __name__ == "__main__":
    common.run_main(main)
