"""LoRA on FSDP2: fine-tune low-rank adapters beside a frozen, sharded base model.

What it does: each adapted Linear (the attention's projections; --lora-mlp adds the MLP's)
keeps its weight W frozen and learns y = x W^T + (alpha / r) x A^T B^T, with A (r x d_in,
random) and B (d_out x r, zero: training starts from the base model's outputs exactly). Every
other weight is frozen too. fully_shard then shards it all as optimized_fsdp.py does: the
frozen weights have no gradient and no AdamW state, so only the adapters' gradients are
reduce-scattered; the base is all-gathered as in full fine-tuning. `merge()` folds B A into W.
  --init-from DIR  the weights of a checkpoint 03_fsdp/optimized_fsdp_checkpoint.py saved (at
                   the same --model, --size and --seed), then the fine-tuning task: the
                   pretraining pattern with 1/64 of it redrawn. The default, `scratch`, trains
                   on that task from random weights: the comparison that shows the start.
Why it helps: a rank holds 4 bytes a frozen parameter / N and 16 an adapter's / N, against 16 /
N for every parameter in full fine-tuning, and sends a few per cent of its gradient bytes.
Run:        torchrun --nproc_per_node=2 03_fsdp/optimized_fsdp_checkpoint.py --size small
            torchrun --nproc_per_node=2 03_fsdp/optimized_fsdp_lora.py --size small \\
              --init-from outputs/checkpoints
Look for:   `make fsdp report`: beside optimized_fsdp --init-from (full fine-tuning from the
            same checkpoint) the state MB, the reduce-scatter MB (comm_by_kind_mb) and the final
            loss; against --init-from scratch, a lower final loss.
Theory:     trainable r (d_in + d_out) a Linear; state 4 x frozen / N + 16 x adapters / N bytes
            (dim 0 padded to N); sent (N-1)/N of: every block's weights gathered twice, the
            root's once, in the gather dtype; the adapters' gradients reduce-scattered, 4 bytes.
"""

import fnmatch
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# From random weights (`--init-from scratch`) the adapters alone learn little: against full
# training no per-step tolerance is claimed.
LOSS_TOLERANCE = None
# Fine-tuning from a checkpoint, of another kind: the final loss within 10% of full fine-tuning's
# from the same checkpoint (optimized_fsdp.py --init-from). LoRA trains a few per cent of the
# weights: what it cannot express of the new task, full fine-tuning can.
FINAL_LOSS_TOLERANCE = 0.10
# The Linears adapted, by name (fnmatch): the GPT's attn.qkv and attn.proj, the Llama's and a
# HuggingFace Llama's self_attn.{q,k,v,o}_proj; with --lora-mlp also the GPT's fc and fc_proj,
# the Llamas' mlp.{gate,up,down}_proj.
ATTENTION = ("*attn.*",)
MLP = ("*mlp.*", "*.fc", "*.fc_proj")


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable rank-r update: base(x) + (alpha / r) (x A^T) B^T. B starts
    at zero, so the adapted model starts as the base model; A as nn.Linear starts a weight."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scaling = base.requires_grad_(False), alpha / rank
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """The base Linear with the update folded into its weight: W + (alpha / r) B A, the same
        outputs at no extra cost (for inference or export; on full, unsharded weights)."""
        self.base.weight += self.scaling * (self.lora_b @ self.lora_a).to(self.base.weight.dtype)
        return self.base


def apply_lora(model: nn.Module, patterns=ATTENTION, rank: int = 8, alpha: float = 16.0
               ) -> list[str]:
    """Freeze every weight of `model`, then replace each Linear whose name matches one of
    `patterns` by a LoRALinear around it; the names adapted (an error when none matches)."""
    model.requires_grad_(False)
    adapted = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(fnmatch.fnmatch(name, p) for p in patterns)]
    if not adapted:
        raise ValueError(f"no Linear of {type(model).__name__} is named like {list(patterns)}: "
                         "pass patterns that match its projections (model.named_modules())")
    for name in adapted:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoRALinear(getattr(owner, child), rank, alpha))
    return adapted


def keep_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Every frozen floating-point parameter of `model` cast to `dtype` (bf16: 2 bytes a weight,
    not fp32's 4), the trainable ones left as they are (fp32 for AdamW)."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def merge_lora(model: nn.Module) -> None:
    """Every LoRALinear of `model` replaced by its merged Linear (`LoRALinear.merge`)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, m.merge())


# Copied from 03_fsdp/optimized_fsdp.py: batchnorms
def batchnorms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


# Copied from 03_fsdp/optimized_fsdp.py: keep_batchnorm_fp32
def keep_batchnorm_fp32(model: torch.nn.Module, policy: dict) -> None:
    """Under a bf16 policy, every BatchNorm in one unit of its own that stays fp32: its running
    statistics are fp32 buffers, which bf16 weights would not match (FSDP1 kept `_BatchNorm`
    out of mixed precision for this reason). Grouped, its weights are one small all-gather a
    forward (and one reduce-scatter), not one per layer."""
    norms = batchnorms(model)
    if norms:
        fully_shard(norms, **{**policy, "mp_policy": MixedPrecisionPolicy()})


# Copied from 03_fsdp/optimized_fsdp.py: AllToAllReduceScatter
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


# Copied from 03_fsdp/optimized_fsdp.py: reduce_scatter_by_all_to_all_on_gloo
def reduce_scatter_by_all_to_all_on_gloo(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every FSDP unit of `model` reduce-scatters through AllToAllReduceScatter, if the shard
    group (the mesh's last dim) runs on gloo."""
    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(AllToAllReduceScatter())


# Copied from 03_fsdp/optimized_fsdp.py: shard_mesh
def shard_mesh(mesh: DeviceMesh | dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over: a DeviceMesh as given, or a process group (None: the world) as
    a 1-D mesh of its ranks."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    return DeviceMesh.from_group(mesh or dist.group.WORLD, device_type)


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


# Copied from 03_fsdp/optimized_fsdp.py: shard
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


# Copied from 03_fsdp/optimized_fsdp.py: prefetch_one_ahead
def prefetch_one_ahead(units: list[torch.nn.Module]) -> None:
    """Forward: block i issues block i+1's all-gather before it computes; backward (blocks in
    reverse), block i+1 issues block i's."""
    for earlier, later in zip(units, units[1:], strict=False):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])


# Copied from 03_fsdp/optimized_fsdp.py: padded_numel
def padded_numel(p: torch.Tensor, group: int) -> int:
    """Elements FSDP allocates for `p` across a shard group: dim 0 rounded up to the group."""
    return math.ceil(p.shape[0] / group) * group * math.prod(p.shape[1:])


def lora_bytes(blocks: float, root: float, trainable: float, group: int, gather: float = 4,
               reduce: float = 4, frozen_bytes: float = 4, trained_bytes: float = 16
               ) -> dict[str, float]:
    """LoRA under FSDP2's bytes a rank, from value counts (padded as FSDP pads them): `blocks`
    and `root` all the values (frozen and trainable) of the blocks and of the root, `trainable`
    the adapters'. State, / group: `frozen_bytes` a frozen value (no gradient, no AdamW state),
    `trained_bytes` a trainable one. Sent a step, (group-1)/group of: every block's values
    gathered twice (forward, then backward: a frozen weight carries the input's gradient), the
    root's once, `gather` bytes each; the trainable ones' gradients reduce-scattered, `reduce`
    bytes each. Beside them what full fine-tuning of the base would reduce-scatter: every
    frozen value's gradient."""
    share, frozen = (group - 1) / group, blocks + root - trainable
    return {"state": (frozen_bytes * frozen + trained_bytes * trainable) / group,
            "allgather": share * gather * (2 * blocks + root),
            "reduce_scatter": share * reduce * trainable,
            "full_reduce_scatter": share * reduce * frozen}


def theory(model: nn.Module, blocks: list[nn.Module], group: int, rank: int, gather: int
           ) -> dict:
    """lora_bytes of the model's padded shapes (a frozen value kept in the gather dtype), and
    the adapters' r (d_in + d_out) each."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    values = {"blocks": 0, "root": 0, "trainable": 0}
    for p in model.parameters():
        n = padded_numel(p, group)
        values["blocks" if id(p) in in_blocks else "root"] += n
        values["trainable"] += n if p.requires_grad else 0
    predicted = lora_bytes(values["blocks"], values["root"], values["trainable"], group, gather,
                           frozen_bytes=gather)
    return {"state_mb": predicted["state"] / 2**20,
            "comm_mb": (predicted["allgather"] + predicted["reduce_scatter"]) / 2**20,
            "comm_by_kind_mb": {k: round(predicted[k] / 2**20, 4)
                                for k in ("allgather", "reduce_scatter")},
            "trainable_params": sum(rank * (m.base.in_features + m.base.out_features)
                                    for m in model.modules() if isinstance(m, LoRALinear)),
            "full_finetune_reduce_scatter_mb": predicted["full_reduce_scatter"] / 2**20}


def planned_lora(plan: "PlanInput") -> dict[str, float]:
    """The planner's FSDP + LoRA row: the frozen model sharded over every GPU in the weights'
    dtype, the adapters (PlanInput.lora_params) with their gradients and AdamW's state; sent,
    lora_bytes; held gathered, the root and a block with its prefetched next. Its step: the
    frozen weights' matmuls skip the weight gradient (4 of 6 FLOPs a weight, the adapters'
    few ignored) and AdamW steps the adapters alone."""
    w, g, o = plan.state_bytes
    root, adapters = plan.embedding + plan.head, plan.lora_params
    frozen = plan.compute_bytes  # frozen weights are kept in the compute dtype
    predicted = lora_bytes(plan.params - root + adapters, root, adapters, plan.gpus, frozen, g,
                           frozen, w + g + o)
    return {"state": predicted["state"], "sent": predicted["allgather"] +
            predicted["reduce_scatter"],
            "gathered": frozen * (root + 2 * plan.blocks / plan.layers),
            # a frozen Linear keeps no input for backward (it makes no weight gradient): the
            # MLP's input and its down projection's, a layer's activations less
            "layer_extra": -(plan.hidden + plan.ffn) * plan.micro_batch * plan.seq
            * plan.compute_bytes,
            "matmul_share": 4 / 6, "stepped": adapters / plan.gpus}


def main():
    parser = common.parser(__doc__, skips={"resnet": "LoRA adapts a decoder's projections: "
                                                     "use --model gpt or llama"})
    common.add_init_from(parser, default="scratch")
    parser.add_argument("--lora-rank", type=common.int_at_least(1), default=8,
                        help="the adapters' rank r (default: 8)")
    parser.add_argument("--lora-alpha", type=common.positive_float, default=16.0,
                        help="the update's scale is alpha / r (default: 16)")
    parser.add_argument("--lora-mlp", action="store_true",
                        help="adapt the MLP's Linears too, not only the attention's")
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    started_from = common.init_weights_from(model, args.init_from)
    adapted = apply_lora(model, ATTENTION + (MLP if args.lora_mlp else ()), args.lora_rank,
                         args.lora_alpha)
    bf16 = args.dtype == "bf16"
    if bf16:  # what never trains needs no fp32 copy: the policy would compute with bf16 anyway
        keep_frozen_in(model, torch.bfloat16)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    units = common.transformer_blocks(model)
    shard(model, units, mp_policy=mp_policy)
    prefetch_one_ahead(units)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    measured = {kind: sum(mb for op, (mb, _) in stats.comm_by_op.items()
                          if op.startswith(f"{kind}/")) for kind in ("allgather", "reduce_scatter")}
    fine_tuning = args.init_from not in (None, "scratch")
    common.record(args, topo, stats, baseline="optimized_fsdp", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP, comm_mb=stats.comm_mb,
                  init_from=args.init_from, started_from=started_from, adapted=adapted,
                  lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                  trainable_params=sum(p.numel() for p in trainable),
                  trainable_share=sum(p.numel() for p in trainable)
                  / sum(p.numel() for p in model.parameters()),
                  comm_by_kind_mb={k: round(v, 4) for k, v in measured.items()},
                  **({"loss_tolerance_final_rel": FINAL_LOSS_TOLERANCE} if fine_tuning
                     else {"loss_tolerance": LOSS_TOLERANCE}),
                  theory=theory(model, units, topo.world_size, args.lora_rank,
                                2 if bf16 else 4))


# The planner's row, planned when `make plan` is given --lora-rank (fine-tuning, not training)
PLANNED = [{"strategy": "FSDP + LoRA", "place": 55, "figures": planned_lora,
            "fine_tuning": True}]


if __name__ == "__main__":
    common.run_main(main)
