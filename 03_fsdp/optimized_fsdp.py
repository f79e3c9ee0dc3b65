"""FSDP2: shard parameters, gradients and optimizer state, gather each block only while it runs.

What it does: `fully_shard` on each transformer block (each ResNet stage), then on the root,
makes every parameter a DTensor sharded on dim 0, so each rank keeps 1/N of the weights, the
gradients and AdamW's state. A block's parameters are all-gathered just before it runs; its
gradients are reduce-scattered after its backward and each rank steps the shard it owns. Each
block prefetches the next one's all-gather to overlap its own compute. A MixedPrecisionPolicy
follows --dtype: bf16 gathers and compute with fp32 reductions on CUDA, plain fp32 on CPU.
On gloo, reduce-scatters go through AllToAllReduceScatter (gloo's own is an all-reduce).
  --reshard-after-forward true|false  FULL_SHARD: free a block's gathered weights after its
                   forward, gather them again for backward; or SHARD_GRAD_OP: keep them
  --hsdp R         hybrid: shard within groups of N/R ranks, replicate across the R groups
  --wrap root      one unit for the whole model, the usual first attempt (peak near DDP's)
Checkpoints and resume: optimized_fsdp_checkpoint.py, this script plus DCP saves.
Why it helps: per-rank state falls from 16 x params bytes (DDP, fp32 AdamW) to 16 x params / N,
so a model N times larger fits. It costs bytes: FULL_SHARD sends about 1.5x DDP's.
Run:        torchrun --nproc_per_node=2 03_fsdp/optimized_fsdp.py --size small
Look for:   `make fsdp report`: state MB and peak MB against baseline_fsdp (DDP), tokens/s,
            losses equal to DDP's to float rounding, comm MB beside theory.comm_mb.
Theory:     state 16 x (parameters, dim 0 padded to a multiple of the shard group S) / S bytes
            per rank. An all-gather or reduce-scatter of a unit sends (S-1)/S of it: a block is
            gathered twice under FULL_SHARD (once otherwise), the root once, every unit
            reduce-scattered once; --hsdp adds an all-reduce of the shard. DDP: 2(N-1)/N.
"""

import functools
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Against DDP: in fp32 the same sums grouped differently (per step, absolute). In bf16 FSDP
# gathers bf16 weights where DDP autocasts fp32 ones: they round differently, so the losses may
# drift by bf16's resolution.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def build_mesh(topo: common.Topology, hsdp: int) -> DeviceMesh:
    """All ranks on one dim (FSDP), or (replicate, shard) groups for hybrid sharding. The
    device type is explicit: on a machine with CUDA, FSDP2 would otherwise pick it for a CPU
    run (pytorch/pytorch#132471)."""
    if hsdp == 1:
        return init_device_mesh(topo.device.type, (topo.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(topo.device.type, (hsdp, topo.world_size // hsdp),
                            mesh_dim_names=("replicate", "shard"))


def sharding_units(blocks: list[torch.nn.Module], wrap: str) -> list[torch.nn.Module]:
    """The modules that get their own all-gather: each of the model's blocks (transformer
    blocks, ResNet stages), or none (`--wrap root`: the root is the one unit)."""
    return list(blocks) if wrap == "block" else []


def batchnorms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def keep_batchnorm_fp32(model: torch.nn.Module, policy: dict) -> None:
    """Under a bf16 policy, every BatchNorm in one unit of its own that stays fp32: its running
    statistics are fp32 buffers, which bf16 weights would not match (FSDP1 kept `_BatchNorm`
    out of mixed precision for this reason). Grouped, its weights are one small all-gather a
    forward (and one reduce-scatter), not one per layer."""
    norms = batchnorms(model)
    if norms:
        fully_shard(norms, **{**policy, "mp_policy": MixedPrecisionPolicy()})


class AllToAllReduceScatter:
    """FSDP2's ReduceScatter interface (`allocate`, `__call__`) on common.reduce_scatter: an
    all_to_all and a local sum. FSDP2 calls the process group's reduce_scatter_tensor, which
    gloo runs as an all-reduce of the whole input, twice the bytes and time a reduce-scatter
    needs. NCCL's is a true reduce-scatter, so CUDA runs keep FSDP2's own."""

    def allocate(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        return common.reduce_scatter(output_tensor, input_tensor, group, op, async_op)


def reduce_scatter_by_all_to_all_on_gloo(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every FSDP unit of `model` reduce-scatters through AllToAllReduceScatter, if the shard
    group (the mesh's last dim) runs on gloo."""
    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(AllToAllReduceScatter())


def shard_mesh(mesh: DeviceMesh | dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over: a DeviceMesh as given, or a process group (None: the world) as
    a 1-D mesh of its ranks."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    return DeviceMesh.from_group(mesh or dist.group.WORLD, device_type)


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


def shard(model: torch.nn.Module, blocks: list[torch.nn.Module],
          mesh: DeviceMesh | dist.ProcessGroup | None = None, *,
          reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
          offload: bool = False) -> DeviceMesh:
    """fully_shard bottom-up over `mesh` (a DeviceMesh, or a process group; None: the world):
    BatchNorms under a bf16 policy, each of `blocks` (transformer blocks, ResNet stages; none
    for one unit), then the root (what is left: embeddings, final norm, head). The root keeps
    FSDP2's default of not resharding after forward: its weights are the first backward needs.
    Sharded weights keep the dtype they have (bf16 stays bf16); mp_policy casts for compute."""
    mesh = shard_mesh(mesh, next(model.parameters()).device.type)
    same_weights_on_every_rank(model, mesh)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    policy = {"mesh": mesh, "mp_policy": mp_policy,
              "offload_policy": CPUOffloadPolicy() if offload else None}
    policy = {k: v for k, v in policy.items() if v is not None}
    if mp_policy.param_dtype is not None:
        keep_batchnorm_fp32(model, policy)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **policy)
    fully_shard(model, **policy)
    reduce_scatter_by_all_to_all_on_gloo(model, mesh)
    return mesh


def prefetch_one_ahead(units: list[torch.nn.Module]) -> None:
    """Forward: block i issues block i+1's all-gather before it computes; backward (blocks in
    reverse), block i+1 issues block i's."""
    for earlier, later in zip(units, units[1:], strict=False):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])


def padded_numel(p: torch.Tensor, group: int) -> int:
    """Elements FSDP allocates for `p` across a shard group: dim 0 rounded up to the group."""
    return math.ceil(p.shape[0] / group) * group * math.prod(p.shape[1:])


def fsdp_bytes(blocks: float, root: float, group: int, replicas: int = 1, reshard: bool = True,
               gather: float = 4, reduce: float = 4, state: float = 16, fp32: float = 0.0,
               largest_block: float = 0.0) -> dict[str, float]:
    """FSDP's bytes a rank, from value counts (padded as FSDP pads them): the blocks' values,
    the root's (FSDP2 never reshards it) and `fp32`'s (BatchNorm's under bf16: fp32, gathered
    again for backward), sharded over `group` ranks, `state` bytes each. Sent a step, (g-1)/g
    of each: every block all-gathered twice with reshard (FULL_SHARD), once without
    (SHARD_GRAD_OP), `gather` bytes a value, the root once, every gradient reduce-scattered,
    `reduce` bytes; HSDP's `replicas` all-reduce each shard (`across_replicas`). Held gathered
    beyond the shards: the root and a block with its prefetched next (`largest_block` each),
    or, without reshard, everything. The planner's figures are ZeRO-3's
    (04_zero/optimized_zero3.py's zero3_bytes), yet the two stay apart: each counts its own
    implementation's padding, here FSDP2's (each parameter's dim 0 rounded up to the group)."""
    share, gathers, values = (group - 1) / group, 2 if reshard else 1, blocks + root + fp32
    across_replicas = 2 * (replicas - 1) / replicas * values / group * reduce
    sent = share * (blocks * (gathers * gather + reduce) + root * (gather + reduce)
                    + fp32 * (2 * 4 + reduce)) + across_replicas
    return {"state": state * values / group, "sent": sent, "across_replicas": across_replicas,
            "gathered": gather * (root + 2 * largest_block) if reshard else gather * values}


def planned_fsdp(plan: "PlanInput", reshard: bool = True, hybrid: bool = False
                 ) -> dict[str, float]:
    """The planner's FSDP rows: FULL_SHARD over every GPU, SHARD_GRAD_OP (`reshard` False), or
    HSDP (`hybrid`): a node's GPUs shard, the nodes replicate. Blocks of equal size; the root
    the tables and an untied head; bytes across nodes: HSDP's all-reduce, else all of them.
    Gradients reduce in fp32 whatever the compute dtype, as `main`'s MixedPrecisionPolicy does
    (a bf16 run's dry run sends 4/3 of bf16 reductions' bytes)."""
    w, g, o = plan.state_bytes
    group = min(plan.per_node, plan.gpus) if hybrid else plan.gpus
    root = plan.embedding + plan.head
    predicted = fsdp_bytes(plan.params - root, root, group, plan.gpus // group, reshard,
                           plan.compute_bytes, 4, w + g + o,
                           largest_block=(plan.params - root) / plan.layers)
    across = predicted["across_replicas"] if hybrid else predicted["sent"]
    return {"state": predicted["state"], "sent": predicted["sent"],
            "gathered": predicted["gathered"],
            "network": across if plan.gpus > plan.per_node else 0.0}


def theory(model: torch.nn.Module, units: list, group: int, replicas: int,
           reshard_after_forward: bool, param_bytes: int) -> dict:
    """Per-rank state (fp32 AdamW) and bytes sent per step: fsdp_bytes of the parameters'
    padded shapes."""
    in_blocks = {id(p) for u in units for p in u.parameters()}
    kept_fp32 = {id(p) for m in batchnorms(model) for p in m.parameters()} \
        if param_bytes == 2 else set()
    values = {"blocks": 0, "root": 0, "fp32": 0}
    for p in model.parameters():
        kind = "fp32" if id(p) in kept_fp32 else "blocks" if id(p) in in_blocks else "root"
        values[kind] += padded_numel(p, group)
    predicted = fsdp_bytes(values["blocks"], values["root"], group, replicas,
                           reshard_after_forward, param_bytes, fp32=values["fp32"])
    return {"state_mb": predicted["state"] / 2**20, "comm_mb": predicted["sent"] / 2**20}


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                        help="true: FULL_SHARD; false: SHARD_GRAD_OP")
    parser.add_argument("--hsdp", type=common.int_at_least(1), default=1,
                        help="replicate groups R for hybrid sharding (1: plain FSDP)")
    parser.add_argument("--wrap", choices=["block", "root"], default="block",
                        help="one FSDP unit per block (ResNet stage) plus the root, or the root "
                             "alone")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="let FSDP2 issue each all-gather when the block is reached")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep sharded parameters, gradients and optimizer state in host "
                             "memory (CUDA only)")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step: torch.nn.utils.clip_grad_norm_ on the DTensor gradients, "
                        "each rank's shard once, the norm all-reduced (default: no clipping)")
    common.add_init_from(parser)  # full fine-tuning, the baseline of optimized_fsdp_lora.py
    args = parser.parse_args()
    world = common.launch_world_size()
    if world % args.hsdp or (args.hsdp > 1 and args.hsdp == world):
        parser.error(f"--hsdp {args.hsdp} must divide the world size {world} into groups of "
                     f"two or more ranks: use a divisor of {world} below it, or 1")
    if args.cpu_offload and args.clip_grad_norm:
        parser.error("--clip-grad-norm with --cpu-offload: clip_grad_norm_ would all-reduce the "
                     "norm of host-memory gradients over NCCL (pytorch/pytorch#148532): drop one")
    if args.cpu_offload and not torch.cuda.is_available():
        parser.error("--cpu-offload moves parameters to host memory, where a CPU run keeps them "
                     "already: drop it, or run on CUDA")
    reshard = args.reshard_after_forward == "true"
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    started_from = common.init_weights_from(model, args.init_from)
    bf16 = args.dtype == "bf16"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    units = sharding_units(common.transformer_blocks(model), args.wrap)
    mesh = shard(model, units, build_mesh(topo, args.hsdp), reshard_after_forward=reshard,
                 mp_policy=mp_policy, offload=args.cpu_offload)
    if not args.no_prefetch:
        prefetch_one_ahead(units)
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
    group = topo.world_size // args.hsdp
    resharded = reshard and bool(units)  # FSDP2 keeps the root unit gathered until backward
    strategy = ("hybrid_" if args.hsdp > 1 else "") + ("full_shard" if resharded else
                                                        "shard_grad_op")
    common.record(args, topo, stats, baseline="baseline_fsdp", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP,
                  comm_mb=stats.comm_mb, strategy=strategy, wrap=args.wrap,
                  mesh=list(mesh.shape), prefetch=len(units) > 1 and not args.no_prefetch,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  init_from=args.init_from, started_from=started_from,
                  theory=theory(model, units, group, args.hsdp, reshard, 2 if bf16 else 4))


# The planner's rows (report/planner.py reads this; the script never does): its three
# sharding strategies, by --reshard-after-forward and --hsdp.
PLANNED = [{"strategy": "FSDP full", "place": 50, "figures": planned_fsdp},
           {"strategy": "FSDP grad-op", "place": 60,
            "figures": functools.partial(planned_fsdp, reshard=False)},
           {"strategy": "FSDP hybrid", "place": 70,
            "figures": functools.partial(planned_fsdp, hybrid=True)}]


if __name__ == "__main__":
    common.run_main(main)
