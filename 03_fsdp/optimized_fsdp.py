"""FSDP2: shard parameters, gradients and optimizer state, gather each block only while it runs.

What it does: `fully_shard` on each transformer block (each ResNet stage) and then on the root
turns every parameter into a DTensor sharded on dim 0 across the mesh, so each rank keeps
1/N of the weights, of the gradients and of AdamW's state. Before a block runs its
parameters are all-gathered into full tensors; after its backward its gradients are
reduce-scattered, each rank keeping the averaged shard it owns and stepping only that.
  --reshard-after-forward true   FULL_SHARD: free a block's gathered weights after its forward
                                 and gather them again for backward (3 collectives a block).
  --reshard-after-forward false  SHARD_GRAD_OP: keep them until backward (2 a block; the
                                 gathered weights of every block live through the forward).
  --hsdp R                       hybrid: a (R x N/R) mesh, sharded within each group of N/R
                                 ranks, replicated across the R groups (one all-reduce of the
                                 reduced shard between groups): intra-node sharding, fewer
                                 bytes over the slow inter-node link.
  --wrap root                    one unit for the whole model, the usual first attempt: every
                                 weight is gathered at once (and kept until backward), so
                                 the peak comes close to DDP's.
Prefetching: each block is told which one runs next (the following block in forward, the
preceding one in backward), so its all-gather is issued before the current block computes and
overlaps it, at the cost of one more block's gathered weights alive at a time.
Mixed precision: a MixedPrecisionPolicy follows --dtype: bf16 weights gathered and computed
in bf16 with gradients reduced in fp32 on CUDA (BatchNorm's kept fp32); plain fp32 on CPU.
--validate trains a DDP replica beside it on the same batches and checks, step by step, equal
losses and, at the end, equal parameters (to float rounding).
Checkpoints: `--checkpoint-dir D --checkpoint-every K` saves the sharded model and optimizer
with torch.distributed.checkpoint, each rank writing its own shards (never gathered), into a
folder renamed into place once complete; `--resume` loads the newest one (or starts fresh)
and continues at the next step on the same data. Under `torchrun --max-restarts 1 ...
--resume`, a rank that dies makes torchrun restart the group, which resumes.
Why it helps: per-rank state falls from 16 x params bytes (DDP, fp32 AdamW) to 16 x params / N,
and the peak to that plus one or two gathered blocks and the activations, so a model N times
larger fits. It costs communication: with fp32 gathers FULL_SHARD sends about 1.5x DDP's
bytes (blocks gathered twice), SHARD_GRAD_OP and --wrap root about DDP's.
Run:        torchrun --nproc_per_node=2 03_fsdp/optimized_fsdp.py --size small
Look for:   `make fsdp report`: state MB and peak MB against baseline_fsdp (DDP), tokens/s,
            losses equal to DDP's to float rounding, comm MB beside theory.comm_mb.
Theory:     state 16 x (parameters as FSDP pads them: dim 0 rounded up to a multiple of the
            shard group) / group bytes per rank. Bytes sent per step: each all-gather and
            reduce-scatter of a unit moves (S-1)/S of it for a shard group of S; a block is
            gathered twice with FULL_SHARD (once otherwise), the root once (FSDP2 keeps it
            after forward), and every unit reduce-scattered once; DDP sends 2(N-1)/N.
"""

import copy
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Against DDP: in fp32 the same sums grouped differently (per step, absolute; --validate checks
# 1e-5 relative). In bf16 FSDP gathers bf16 weights where DDP autocasts fp32 ones: they round
# differently, so the losses may drift by bf16's resolution.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
RELATIVE_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def build_mesh(topo: common.Topology, hsdp: int) -> DeviceMesh:
    """All ranks on one dim (FSDP), or (replicate, shard) groups for hybrid sharding. The
    device type is explicit: on a machine with CUDA, FSDP2 would otherwise pick it for a CPU
    run (pytorch/pytorch#132471)."""
    if hsdp == 1:
        return init_device_mesh(topo.device.type, (topo.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(topo.device.type, (hsdp, topo.world_size // hsdp),
                            mesh_dim_names=("replicate", "shard"))


def sharding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that get their own all-gather: transformer blocks, or ResNet stages."""
    if isinstance(model, common.GPT):
        return list(model.blocks)
    return [model.net.layer1, model.net.layer2, model.net.layer3, model.net.layer4]


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


def shard(model: torch.nn.Module, mesh: DeviceMesh, wrap: str, reshard_after_forward: bool,
          mp_policy: MixedPrecisionPolicy, offload: bool) -> list[torch.nn.Module]:
    """fully_shard bottom-up: BatchNorms under bf16, each unit, then the root (what is left:
    embeddings, final norm, head). The root keeps FSDP2's default of not resharding after
    forward: its weights are the first backward needs."""
    policy = {"mesh": mesh, "mp_policy": mp_policy,
              "offload_policy": CPUOffloadPolicy() if offload else None}
    policy = {k: v for k, v in policy.items() if v is not None}
    if mp_policy.param_dtype is not None:
        keep_batchnorm_fp32(model, policy)
    units = sharding_units(model) if wrap == "block" else []
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **policy)
    fully_shard(model, **policy)
    return units


def prefetch_one_ahead(units: list[torch.nn.Module]) -> None:
    """Forward: block i issues block i+1's all-gather before it computes; backward (blocks in
    reverse), block i+1 issues block i's."""
    for earlier, later in zip(units, units[1:], strict=False):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])


def padded_numel(p: torch.Tensor, group: int) -> int:
    """Elements FSDP allocates for `p` across a shard group: dim 0 rounded up to the group."""
    return math.ceil(p.shape[0] / group) * group * math.prod(p.shape[1:])


def theory(model: torch.nn.Module, units: list, group: int, replicas: int,
           reshard_after_forward: bool, param_bytes: int) -> dict:
    """Per-rank state (fp32 AdamW) and bytes sent per step, from the parameter shapes."""
    params = list(model.parameters())
    unit_of = {id(p): 1 for u in units for p in u.parameters()}  # 1: a block, else the root
    kept_fp32 = {id(p) for m in batchnorms(model) for p in m.parameters()} \
        if param_bytes == 2 else set()
    gathers = 2 if reshard_after_forward else 1
    sent = 0.0
    for p in params:
        n = padded_numel(p, group)
        if id(p) in kept_fp32:  # BatchNorm's unit under bf16: fp32, gathered again for backward
            times, nbytes = 2, 4
        else:  # FSDP2 never reshards the root
            times, nbytes = (gathers if unit_of.get(id(p)) else 1), param_bytes
        sent += (group - 1) / group * n * (times * nbytes + 4)  # all-gathers, reduce-scatter
        sent += 2 * (replicas - 1) / replicas * n / group * 4  # HSDP: all-reduce of the shard
    return {"state_mb": 16 * sum(padded_numel(p, group) for p in params) / group / 2**20,
            "comm_mb": sent / 2**20}


def full_parameter(p: DTensor, device: torch.device) -> torch.Tensor:
    """A sharded parameter gathered whole on the compute device: with --cpu-offload its shard
    lives in host memory, which an NCCL group cannot gather from."""
    local = p.to_local().to(device)
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride()).full_tensor()


def validated(train_step, reference: DDP, reference_opt, tolerance: float,
              clip_grad_norm: float | None):
    """Wrap `train_step` so a DDP replica takes the same step (clipped alike) and their losses
    are compared."""
    def step(inputs, targets):
        loss = train_step(inputs, targets)
        reference_opt.zero_grad(set_to_none=True)
        expected = reference(inputs, targets)
        expected.backward()
        if clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_grad_norm)
        reference_opt.step()
        if abs(loss.item() - expected.item()) > tolerance * abs(expected.item()):
            raise AssertionError(f"FSDP loss {loss.item():.7f} != DDP loss "
                                 f"{expected.item():.7f}")
        return loss
    return step


def save_checkpoint(model, opt, directory: Path, step: int, topo: common.Topology) -> None:
    """Each rank writes its own shards (nothing is gathered) into a hidden folder, which rank 0
    renames once every rank is done: a run killed mid-save leaves the last checkpoint intact."""
    partial, final = directory / f".step-{step:06d}.partial", directory / f"step-{step:06d}"
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
    dist.barrier()
    if topo.is_main:
        if final.exists():  # a rerun without --resume: the new state replaces the old
            shutil.rmtree(final)
        partial.rename(final)


def load_latest_checkpoint(model, opt, directory: Path) -> int:
    """Load the newest complete checkpoint, each rank reading its own shards; return its step
    (0, and nothing loaded, when there is none yet)."""
    found = [sorted(directory.glob("step-*"))[-1:] if directory.exists() else []]
    dist.broadcast_object_list(found)  # rank 0's listing: every rank loads the same one
    if not found[0]:
        return 0
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=found[0][0])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(found[0][0].name.removeprefix("step-"))


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
    parser.add_argument("--validate", action="store_true",
                        help="train a DDP replica beside it and assert equal losses and "
                             "parameters (its bytes and memory then count in the record)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save sharded checkpoints here (a folder every rank can reach)")
    parser.add_argument("--checkpoint-every", type=common.int_at_least(1), default=None,
                        help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir (start "
                             "fresh if there is none), at the step after it, on the same data")
    args = parser.parse_args()
    if (args.checkpoint_every or args.resume) and args.checkpoint_dir is None:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir DIR")
    if args.resume and args.validate:
        parser.error("--validate cannot resume: its DDP replica is not checkpointed; drop one")
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
    reference = copy.deepcopy(model) if args.validate else None
    mesh = build_mesh(topo, args.hsdp)
    bf16 = args.dtype == "bf16"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    units = shard(model, mesh, args.wrap, reshard, mp_policy, args.cpu_offload)
    if not args.no_prefetch:
        prefetch_one_ahead(units)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = load_latest_checkpoint(model, opt, args.checkpoint_dir) if args.resume else 0
    if len(batches) - start <= args.warmup:
        raise ValueError(f"resuming after step {start} leaves no timed step: raise --steps")
    batches, done = batches[start:], start  # the data the interrupted run would have seen next

    def train_step(inputs, targets):
        nonlocal done
        opt.zero_grad(set_to_none=True)  # first, so the gradients still exist when state is counted
        loss = model(inputs, targets)
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        done += 1
        if args.checkpoint_every and done % args.checkpoint_every == 0:
            save_checkpoint(model, opt, args.checkpoint_dir, done, topo)
        return loss

    step = train_step
    if reference is not None:
        reference = DDP(reference, device_ids=[topo.device] if topo.device.type == "cuda" else None)
        step = validated(train_step, reference, torch.optim.AdamW(reference.parameters(),
                                                                  lr=args.lr),
                         RELATIVE_TOLERANCE[args.dtype], args.clip_grad_norm)
    stats = common.timed_steps(step, batches, args, topo, memory_of=(model, opt))
    if reference is not None:
        diff = max((full_parameter(p, q.device) - q).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        common.log(topo, f"validate: losses equal DDP's every step; largest parameter "
                         f"difference {diff:.2e}")
        if diff > 10 * LOSS_TOLERANCE[args.dtype]:
            raise AssertionError(f"FSDP and DDP parameters differ by {diff:.2e}")
    group = topo.world_size // args.hsdp
    resharded = reshard and bool(units)  # FSDP2 keeps the root unit gathered until backward
    strategy = ("hybrid_" if args.hsdp > 1 else "") + ("full_shard" if resharded else
                                                        "shard_grad_op")
    common.record(args, topo, stats, baseline="baseline_fsdp", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, strategy=strategy, wrap=args.wrap,
                  mesh=list(mesh.shape), prefetch=len(units) > 1 and not args.no_prefetch,
                  validated=args.validate, loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  resumed_from=start, clip_grad_norm=args.clip_grad_norm,
                  theory=theory(model, units, group, args.hsdp, reshard, 2 if bf16 else 4))


if __name__ == "__main__":
    common.run_main(main)
