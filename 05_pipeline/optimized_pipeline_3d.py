"""Pipeline x FSDP2 x tensor parallelism on a 3-D device mesh ("pp", "dp", "tp"): 3-D parallelism.

What it does: the ranks form a pp x dp x tp grid, tp innermost. pipeline() composes as
torchtitan's pipeline_llama does, in named steps. Every rank takes global rank 0's whole
model; cut_stage cuts the decoder's layers into pp stages as the other pipeline scripts cut them
(stage s on the ranks whose pp coordinate is s); 03_fsdp/optimized_fsdp_tp.py's parallelize(), a
marked copy, runs apply_tp over "tp", then apply_fsdp over "dp" on each block and the stage;
apply_pp hands the stage to torch.distributed.pipelining: `PipelineStage` on the "pp" group,
`Schedule1F1B` (--schedule gpipe: ScheduleGPipe) over m micro-batches, the last stage's loss
under loss_parallel() (logits split by vocabulary). Between stages go each tp rank's sequence
shard of the residual stream: 1/tp of the activations. FSDP keeps each block gathered from its
first micro-batch's forward to its last's backward and reduce-scatters once a step. The GPT's tied
embedding and head, on the first and last stages, have their gradient shards summed over the
pair. Any mesh whose product is the world trains, a dp or tp of 1 included.
Why: each dim divides a different cost: pp the layers (activations cross a stage boundary
once a micro-batch: cheap, any link), tp each layer's weights and activations (traffic every
layer: fast links), dp what is left (weight traffic once a step). It is how models past one
node's memory train (torchtitan's Llama 3 405B: pp x FSDP x TP 8).
Run:        torchrun --nproc_per_node=8 05_pipeline/optimized_pipeline_3d.py --size small
            (--pp 2, tp the largest dividing the heads and a node, 2 on CPU; dp the rest)
Look for:   `make pipeline report`: beside baseline_pipeline_3d (DDP on the same world and global
            batch) the same losses, state MB near 16 x params / (pp x dp x tp), comm MB by dim.
Theory:     bubble (pp-1)/(m+pp-1). Rank 0 sends a step: pp, each micro-batch's activation
            shard (and the tied gradient shard); tp, 8 gathers or scatters a block and those of
            its ends, per micro-batch; dp, one gather and one reduce-scatter of its stage.
"""

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
# Against DDP, fp32: TP's partial sums, FSDP's and the micro-batches' gradient sums, each in
# another order (per step, absolute). bf16: the dtype's resolution.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


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


# Copied from 03_fsdp/optimized_fsdp_tp.py: SplitQKVAttention
class SplitQKVAttention(nn.Module):
    """common's CausalSelfAttention with its fused qkv as three Linears (the same weights): a
    column-wise split of each gives a rank whole heads of q, k and v. The head count is read
    from q's width, so a rank's share of the heads runs the same code."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        d = attn.proj.in_features
        self.head_dim, self.attention, self.proj = d // attn.n_heads, attn.attention, attn.proj
        self.q, self.k, self.v = (nn.Linear(d, d, device=attn.proj.weight.device)
                                  for _ in range(3))
        with torch.no_grad():
            for i, linear in enumerate((self.q, self.k, self.v)):
                linear.weight.copy_(attn.qkv.weight[i * d:(i + 1) * d])
                linear.bias.copy_(attn.qkv.bias[i * d:(i + 1) * d])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (lin(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        return self.proj(self.attention(q, k, v).transpose(1, 2).flatten(2))


# Copied from 03_fsdp/optimized_fsdp_tp.py: GatheredSequenceParallel
class GatheredSequenceParallel(ParallelStyle):
    """SequenceParallel for a norm whose output feeds column-wise matrices: each rank normalizes
    its own positions, then the output is all-gathered along the sequence and kept a Replicate
    DTensor, so the matrices' input gradients add up to one partial sum, reduce-scattered once.
    The gather is the norm's output, not the next module's input: attention and MLP get the whole
    sequence however the layer calls them, positionally (the project's models) or by keyword
    (HuggingFace's `self_attn(hidden_states=...)`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        SequenceParallel()._apply(module, device_mesh)
        return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                   use_local_output=False)._apply(module, device_mesh)


# Copied from 03_fsdp/optimized_fsdp_tp.py: block_input
def block_input() -> PrepareModuleInput:
    """A block's input as its sequence shard, a local tensor: the embedding's DTensor (the whole
    sequence's shape, see ends_plan) before the first block, the previous block's shard after."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                              use_local_output=True)


# Copied from 03_fsdp/optimized_fsdp_tp.py: gpt_block_plan
def gpt_block_plan() -> dict:
    """The TP + sequence-parallel plan of one GPT block (after SplitQKVAttention)."""
    return {"": block_input(), "ln1": GatheredSequenceParallel(),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": GatheredSequenceParallel(), "fc": ColwiseParallel(),
            "fc_proj": RowwiseParallel(output_layouts=Shard(1))}


# Copied from 03_fsdp/optimized_fsdp_tp.py: decoder_layer_plan
def decoder_layer_plan() -> dict:
    """torchtitan's plan of a decoder layer under HuggingFace's module names: the layers of
    HuggingFace's Llama, Qwen2 and Mistral, and common.Llama's, alike. A column-wise Linear's
    bias (Qwen2's q, k, v) is split with its rows; a row-wise one's is replicated and added once,
    to the sum of the ranks' partial products."""
    return {"": block_input(), "input_layernorm": GatheredSequenceParallel(),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": GatheredSequenceParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}


# Copied from 03_fsdp/optimized_fsdp_tp.py: ends_plan
def ends_plan(embeddings: list[str], norm: str | None, head: str | None) -> dict:
    """The model's ends (those it has: a pipeline stage may hold none): token (and position)
    tables row-wise, their lookups reduce-scattered along the sequence (a position table's
    output is (T, d): its dim 0) and kept DTensors of the whole sequence's shape, so that a
    model that builds positions and its causal mask from the embedding's length (HuggingFace's
    LlamaModel) builds them whole; the final norm sequence-parallel, its output a plain local
    shard (HuggingFace slices it before the head); the head column-wise from the gathered
    sequence, its logits left split by vocabulary (a Shard(-1) DTensor): the loss
    runs under loss_parallel(), and no rank holds B x T x vocabulary logits."""
    plan = {name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(i),
                                  use_local_output=False)
            for i, name in zip((1, 0), embeddings, strict=False)}
    if norm:
        plan[norm] = SequenceParallel(use_local_output=True)
    if head:
        plan[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                     use_local_output=False)
    return plan


# Copied from 03_fsdp/optimized_fsdp_tp.py: apply_tp
def apply_tp(model: nn.Module, blocks: list[nn.Module], block_plan: dict, ends: dict,
             tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism: `block_plan` on each block and `ends` on the root over `tp_mesh`. A
    weight shared by two modules (a tied head) would come out as two DTensors: tied again after."""
    shared = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((module, name))
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(model, tp_mesh, ends)
    for uses in shared.values():
        (first, name), *others = uses
        for module, other in others:
            setattr(module, other, getattr(first, name))


# Copied from 03_fsdp/optimized_fsdp_tp.py: apply_fsdp
def apply_fsdp(model: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh,
               mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool = True) -> None:
    """FSDP2: fully_shard each block, then the root, over `dp_mesh`; on gloo through an all-to-all
    reduce-scatter (gloo's own is an all-reduce: twice the bytes)."""
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    reduce_scatter_by_all_to_all_on_gloo(model, dp_mesh)


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


# Copied from 03_fsdp/optimized_fsdp_tp.py: split_problem
def split_problem(model: nn.Module, blocks: list[nn.Module], block_plan: dict, ends: dict,
                  tp: int) -> str | None:
    """Why `tp` ranks cannot split `model` by these plans, or None. The plans must name each
    module they split and each module holding weights: parallelize_module warns and skips an
    entry that matches no module, and leaves a module no entry names whole on every rank, so a
    layer with fused q, k, v (Phi-3's qkv_proj) or a norm inside attention (Qwen3's q_norm)
    would train wrong without a word. The block plan must fit every block (a pipeline stage
    may hold none: the head alone), the ends plan what the blocks leave. And each column-wise
    matrix must split into whole heads (counted where its module has a `head_dim`:
    HuggingFace's attention and the project's) or equal shares of units."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    for root, plan, skip in [(model, ends, in_blocks), *((b, block_plan, set()) for b in blocks)]:
        modules = dict(root.named_modules(remove_duplicate=False))
        missing = [key for key in plan if key not in modules]
        unnamed = [name for name, module in modules.items() if name not in plan and any(
            id(p) not in skip for p in module.parameters(recurse=False))]
        if missing or unnamed:
            lacks = [f"it lacks {', '.join(missing)}, which the plan names"] if missing else []
            holds = [f"it holds weights in {', '.join(unnamed)}, which the plan does not "
                     f"name"] if unnamed else []
            return (f"the {'ends' if root is model else 'layer'} plan does not fit "
                    f"{type(root).__name__}: {'; '.join(lacks + holds)}: pass a plan that "
                    f"names each of its modules with weights, a fused projection split into "
                    f"its parts first")
    for key, style in block_plan.items():
        for block in blocks if isinstance(style, ColwiseParallel) else ():
            head_dim = getattr(block.get_submodule(key.rpartition(".")[0]), "head_dim", None)
            width = block.get_submodule(key).out_features
            width, what = (width // head_dim, "heads") if head_dim else (width, "units")
            if width % tp:
                return (f"tp {tp} does not split the {width} {what} of {key}: pass a mesh "
                        f"whose tp dim divides {width}")
    return None


# Copied from 03_fsdp/optimized_fsdp_tp.py: weights_problem
def weights_problem(model: nn.Module, mesh: DeviceMesh) -> str | None:
    """Why the mesh's ranks cannot shard `model`, or None: they hold different weights, and each
    would keep its slice of its own. A cheap check: each parameter's sum and norm in float64 (the
    same weights give the same bits); their max over dp, then over tp, is the max over the ranks
    holding this model (a 3-D mesh's stages hold other layers), that of their negatives minus
    the min."""
    if common.dry_run():  # fake weights have no values to compare
        common.stand_in("weights check", "none: fake weights have no values")
        return None
    held = torch.stack([torch.stack([p.detach().sum(dtype=torch.float64),
                                     torch.linalg.vector_norm(p.detach(), dtype=torch.float64)])
                        for p in model.parameters()])
    extremes = torch.cat([held, -held])
    for dim in ("dp", "tp"):
        dist.all_reduce(extremes, dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if torch.equal(extremes[:len(held)], -extremes[len(held):]):
        return None
    return ("the mesh's ranks hold different weights: call same_weights_on_every_rank(model, "
            "mesh) before parallelize")


# Copied from 03_fsdp/optimized_fsdp_tp.py: parallelize
def parallelize(model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module], block_plan: dict,
                ends: dict, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """The composition, torchtitan's parallelize_llama: apply_tp over mesh["tp"] (each of `blocks`
    by `block_plan`, the root by `ends`; skipped at tp 1), then apply_fsdp over mesh["dp"]
    (`mp_policy`: FSDP's dtypes, default fp32). A plan the model does not split (split_problem)
    and ranks holding different weights (weights_problem: call same_weights_on_every_rank
    first) are refused in one line, before anything is sent."""
    tp = mesh["tp"].size()
    if tp > 1 and (why := split_problem(model, blocks, block_plan, ends, tp)):
        raise ValueError(why)
    if why := weights_problem(model, mesh):
        raise ValueError(why)
    if tp > 1:
        apply_tp(model, blocks, block_plan, ends, mesh["tp"])
    apply_fsdp(model, blocks, mesh["dp"], mp_policy or MixedPrecisionPolicy(),
               reshard_after_forward)
    return model


# Copied from 03_fsdp/optimized_fsdp_tp.py: mixed_precision
def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP's dtypes for --dtype: bf16 weights in compute, gradients reduced in fp32; fp32 all
    through."""
    bf16 = dtype == "bf16"
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                reduce_dtype=torch.float32 if bf16 else None)


# Copied from 05_pipeline/baseline_pipeline.py: cross_entropy
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a pipeline's last stage is given: what the project's decoders compute."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# Copied from 05_pipeline/baseline_pipeline.py: plain_layers
def plain_layers(stage: list[nn.Module], last: bool) -> list[nn.Module]:
    """A stage of the project's `pipeline_stages` as a runtime takes it: the last one ends in
    the loss head (norm, head and loss), whose norm and head become its last two layers."""
    return [*stage[:-1], stage[-1].ln_f, stage[-1].head] if last else stage


# Copied from 05_pipeline/baseline_pipeline.py: tied_weights
def tied_weights(model: common.Decoder) -> list[nn.Parameter]:
    """The weights on two stages: the input embedding's if the output head is the same
    Parameter (the GPT's), none if untied (the Llama's). Found by identity, not by name."""
    embedding, head = common.input_embedding(model), common.output_head(model)
    return [embedding.weight] if embedding.weight is head.weight else []


def pair_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's first- and last-stage ranks of its (dp, tp) coordinate: the holders of a tied
    weight. Every rank creates every pair's group, in the same order, as new_group requires."""
    with common.real_tensors():  # the mesh's ranks, read on the host
        grid = mesh.mesh.flatten(1)
        pairs = [(int(grid[0, c]), int(grid[-1, c])) for c in range(grid.shape[1])]
    mine = None
    for pair in pairs:
        group = dist.new_group(list(pair))
        if dist.get_rank() in pair:
            mine = group
    return mine


def stage_plans(layers: list[nn.Module]) -> tuple[list[nn.Module], dict, dict]:
    """A stage's blocks, their plan and its ends' plan, named as in nn.Sequential(*layers)
    (main's adapter for the project's decoders: a trainer of one's own names its own)."""
    blocks = [m for m in layers if isinstance(m, (common.Block, common.LlamaDecoderLayer))]
    for block in blocks:
        if isinstance(block, common.Block):
            block.attn = SplitQKVAttention(block.attn)
    block_plan = gpt_block_plan() if blocks and isinstance(blocks[0], common.Block) \
        else decoder_layer_plan()
    tables = [f"0.{name}" for name in ("tok_emb", "pos_emb")] \
        if isinstance(layers[0], common.Embeddings) else \
        ["0"] if isinstance(layers[0], nn.Embedding) else []
    last = isinstance(layers[-1], nn.Linear)  # the head
    n = len(layers)
    return blocks, block_plan, ends_plan(tables, f"{n - 2}" if last else None,
                                         f"{n - 1}" if last else None)


def cut_stage(model: common.Decoder, mesh: DeviceMesh) -> list[nn.Module]:
    """This rank's layers: the decoder cut into mesh["pp"] stages as the other pipeline scripts
    cut it (`pipeline_stages`), stage s on the ranks whose pp coordinate is s."""
    pp, s = mesh["pp"].size(), mesh.get_local_rank("pp")
    return plain_layers(model.pipeline_stages(pp)[s], s == pp - 1)


def apply_pp(stage: nn.Module, mesh: DeviceMesh, schedule: type, m: int,
             inputs_BT: torch.Tensor, width: int, vocab: int, dtype: torch.dtype
             ) -> Schedule1F1B | ScheduleGPipe:
    """Pipeline parallelism: `stage` as torch.distributed.pipelining's PipelineStage on the "pp"
    group, run by `schedule` over `m` micro-batches of a dp rank's batch `inputs_BT`, the last
    stage's loss cross_entropy. A stage takes and gives one micro-batch's: the first its tokens,
    the last its logits, the others a tp rank's sequence shard (requires_grad: its gradient
    flows back). B, b = B/m: a dp rank's and a micro-batch's sequences; T their tokens, S = T/tp
    a tp rank's; D `width`; V `vocab`."""
    pp, s, tp = mesh["pp"].size(), mesh.get_local_rank("pp"), mesh["tp"].size()
    (B, T), device = inputs_BT.shape, inputs_BT.device
    b, S = B // m, T // tp
    tokens_bT = torch.zeros(b, T, dtype=torch.long, device=device)
    shard_bSD = torch.empty(b, S, width, dtype=dtype, device=device, requires_grad=True)
    logits_bTV = torch.empty(b, T, vocab, dtype=dtype, device=device)
    pipe_stage = PipelineStage(stage, s, pp, device, input_args=tokens_bT if s == 0 else shard_bSD,
                               output_args=logits_bTV if s == pp - 1 else shard_bSD,
                               group=mesh.get_group("pp"))
    return schedule(pipe_stage, m, loss_fn=cross_entropy)


class Stage(NamedTuple):
    """This rank's part of the pipelined model, as pipeline() leaves it (torchtitan's
    pipeline_llama: the schedule, the model parts, whether they hold the first and last stage)."""
    module: nn.Sequential  # the stage's layers, parallelized
    schedule: Schedule1F1B | ScheduleGPipe
    blocks: list[nn.Module]  # its decoder layers
    first: bool
    last: bool
    tied: list[nn.Parameter]  # the tied embedding's and head's weight, where the stage holds it
    pairs: dist.ProcessGroup | None  # the tied weight's two holders at this (dp, tp) place


def pipeline(model: common.Decoder, mesh: DeviceMesh, schedule: type, m: int,
             inputs_BT: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> Stage:
    """The composition, torchtitan's pipeline_llama: this rank's stage cut from `model`
    (cut_stage), parallelized as 03's 2-D run is (parallelize: apply_tp, then apply_fsdp, the
    stage kept gathered through the step), then run by `schedule` (apply_pp). Every rank calls
    it, `model` global rank 0's on each (same_weights_on_every_rank)."""
    pp, s = mesh["pp"].size(), mesh.get_local_rank("pp")
    tied = tied_weights(model)
    pairs = pair_group(mesh) if tied else None
    width = common.input_embedding(model).embedding_dim
    vocab = common.output_head(model).out_features
    layers = cut_stage(model, mesh)
    stage = nn.Sequential(*layers)
    # where the stage holds the tied weight: TP and FSDP replace the Parameter, not its place
    holders = [(mod, name) for mod in stage.modules()
               for name, p in mod.named_parameters(recurse=False) if any(p is w for w in tied)]
    blocks, block_plan, ends = stage_plans(layers)
    parallelize(stage, mesh, blocks, block_plan, ends, mp_policy, reshard_after_forward=False)
    pipe = apply_pp(stage, mesh, schedule, m, inputs_BT, width, vocab,
                    mp_policy.param_dtype or torch.float32)
    return Stage(stage, pipe, blocks, s == 0, s == pp - 1,
                 [getattr(mod, name) for mod, name in holders], pairs)


def all_reduce_tied_gradients(stage: Stage) -> None:
    """The tied embedding's and head's gradient shards summed over their pair (the first and
    the last stage's ranks at this (dp, tp) place): the one weight's gradient."""
    for w in stage.tied:
        dist.all_reduce(w.grad.to_local(), group=stage.pairs)


def clip_grad_norm_over_stages(stage: Stage, max_norm: float, pp_group: dist.ProcessGroup
                               ) -> torch.Tensor:
    """Clip every stage's gradients to one 2-norm over the whole model. Within a stage the
    gradients are DTensors over (dp, tp): their norm is one all-reduce away (full_tensor); the
    stages' squared norms are then summed over pp. A tied head's gradient, the embedding's
    summed, is counted once: on the first stage."""
    params = list(stage.module.parameters())
    counted = [p for p in params
               if not (stage.last and not stage.first and any(p is t for t in stage.tied))]
    norm = torch.nn.utils.get_total_norm([p.grad for p in counted])
    squared = (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def global_mean_loss(losses: list[torch.Tensor], mesh: DeviceMesh) -> torch.Tensor:
    """The step's loss from the last stage's micro-batch losses (DTensors under loss_parallel):
    their mean, then the mean over the dp ranks' batches, the global batch's."""
    loss = torch.stack([loss.full_tensor() if isinstance(loss, DTensor) else loss
                        for loss in losses]).mean().detach()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return loss / mesh["dp"].size()


def train_step(stage: Stage, opt: torch.optim.Optimizer, mesh: DeviceMesh,
               max_norm: float | None, inputs_BT: torch.Tensor, targets_BT: torch.Tensor
               ) -> torch.Tensor:
    """One step on a dp rank's batch, every stage given it: the schedule's forwards and backwards
    under loss_parallel() (the last stage's logits stay split by vocabulary), the tied gradient
    summed, the gradient clipped to `max_norm` (None: not), AdamW. Returns the global batch's
    loss on the last stage, 0 elsewhere."""
    opt.zero_grad(set_to_none=True)
    losses = []
    with loss_parallel():
        stage.schedule.step(*([inputs_BT] if stage.first else []),
                            **({"target": targets_BT, "losses": losses} if stage.last else {}))
    all_reduce_tied_gradients(stage)
    if max_norm:
        clip_grad_norm_over_stages(stage, max_norm, mesh.get_group("pp"))
    opt.step()
    if not stage.last:
        return torch.zeros((), device=inputs_BT.device)
    return global_mean_loss(losses, mesh)


def stages_problem(args: argparse.Namespace, m: int) -> str | None:
    """Why --pp stages of `m` micro-batches cannot pipeline --size's decoder, or None. pp counts
    decoder layers, not the embedding and the head, which go with the first and last stages: a
    first stage of the embedding alone would send on its table's output, not a block's. (The cut
    by compute may leave the last stage the head alone, where the vocabulary costs as much as
    layers, --size medium from pp 4: such a stage trains as any.) torch's 1F1B takes m >= pp
    (the first stage runs pp forwards before its first backward)."""
    pp, layers = args.pp, common.SIZES[args.size].n_layers
    if pp > layers:
        return (f"--pp {pp} is more stages than the {layers} decoder layers of --size "
                f"{args.size}: use --pp {layers} or fewer")
    if args.schedule == "1f1b" and m < pp:
        return (f"--microbatches {m} is fewer than the --pp {pp} stages, which 1F1B needs: use "
                f"--microbatches {pp} or more, or --schedule gpipe")
    return None


def mesh_problem(args: argparse.Namespace, world: int, tp: int, m: int, batch: int
                 ) -> str | None:
    """Why `world` ranks cannot form a --pp x dp x `tp` mesh for --size's decoder (a dp rank's
    `batch` sequences in `m` micro-batches), or None; within a stage, tp_problem's."""
    pp = args.pp
    if world % (pp * tp):
        return (f"--pp {pp} x --tp {tp} = {pp * tp} does not divide the {world} processes: "
                f"launch a multiple of {pp * tp}")
    if batch % m:
        return (f"a dp rank's {batch} sequences do not split into --microbatches {m}: use a "
                f"divisor of {batch}")
    return tp_problem(args, tp, world // pp)


# Copied from 03_fsdp/optimized_fsdp_tp.py: tp_problem
def tp_problem(args: argparse.Namespace, tp: int, world: int) -> str | None:
    """Why a (world / tp) x tp mesh cannot train --size's decoder: a TP rank needs whole heads
    (the Llama: whole KV heads) and an even share of the MLP, the vocabulary and the sequence.
    No padding: a checkpoint's shapes must not depend on --tp."""
    if world % tp:
        return f"--tp {tp} does not divide the {world} processes: use a divisor of {world}"
    size = common.SIZES[args.size]
    widths = {"heads": size.n_heads, "MLP units": 4 * size.d_model,
              "vocabulary": size.vocab_size, "sequence positions": args.seq_len}
    if args.model == "llama":
        widths.update({"KV heads": size.n_kv_heads,
                       "MLP units": size.llama_ffn})
    for what, width in widths.items():
        if width % tp:
            return (f"--tp {tp} does not divide the {width} {what} of --size {args.size}: use "
                    f"a --tp that divides {width}")
    return None


# Copied from 03_fsdp/optimized_fsdp_tp.py: default_tp
def default_tp(args: argparse.Namespace, world: int, node: int, stages: int = 1) -> int | None:
    """--tp's default: the largest tp >= 2 that divides a node's `node` processes (a TP group
    stays on one node's links) and that --size's model splits on a stage's `world / stages`
    ranks (tp_problem: heads, KV heads, ...), leaving dp >= 2 where the world has room for it,
    dp 1 where not; None where no tp >= 2 fits."""
    fits = [t for t in range(node, 1, -1) if node % t == 0 and world % (stages * t) == 0
            and tp_problem(args, t, world // stages) is None]
    return max(fits, key=lambda t: (world // (stages * t) >= 2, t), default=None)


# Copied from 03_fsdp/optimized_fsdp_tp.py: node_size
def node_size(world: int) -> int:
    """The processes a TP group may span: a node's GPUs on CUDA; on CPU 2, where more would
    only share the same cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torch.cuda.is_available() else 2


# Copied from 05_pipeline/baseline_pipeline_3d.py: default_3d_tp
def default_3d_tp(args: argparse.Namespace, world: int, pp: int = 2) -> int:
    """The tp of the 3-D run's default mesh, pp x dp x tp with tp >= 2 (default_tp's), or Skip
    where `world` processes hold none: the 3-D run skips then, and its baseline with it, for the
    same reason (a DDP row with no 3-D row beside it compares nothing)."""
    node = node_size(world)
    if tp := default_tp(args, world, node, stages=pp):
        return tp
    raise common.Skip(f"a 3-D mesh of pp {pp} x dp x tp >= 2 (tp dividing a node's {node} "
                      f"processes and the heads) does not fit {world} processes: launch a "
                      f"multiple of {2 * pp} (or give optimized_pipeline_3d.py --tp 1)")


def parsed_args() -> tuple[argparse.Namespace, dict[str, int], int]:
    """The flags, the mesh they give on this world ({"pp", "dp", "tp"}: --pp, --tp or
    default_3d_tp's, dp the rest) and the micro-batches m; a mesh the model cannot take, or m
    that the schedule cannot, stops in one line."""
    parser = common.parser(__doc__, skips={
        "resnet": "a pipeline cuts a decoder's list of layers into stages, and a ResNet's is no "
                  "such list: pipelines run --model gpt or llama",
        "moe": "its TP plan splits a stage's MLP as one SwiGLU, and a MoE's is a router and "
               "experts: the 3-D run takes --model gpt or llama (experts: 08_moe)"})
    parser.add_argument("--pp", type=common.int_at_least(1), default=2,
                        help="pipeline stages, the outer mesh dim (default: 2)")
    parser.add_argument("--tp", type=common.int_at_least(1), default=None,
                        help="tensor-parallel degree, the inner mesh dim (default: the largest "
                             "that divides the heads, the KV heads and a node's GPUs, 2 on CPU, "
                             "leaving dp >= 2 where the world has room); dp = world / (pp x tp)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this 2-norm over the whole "
                        "model, every stage's, before each step (default: no clipping)")
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=None,
                        help="micro-batches m a dp rank's batch is split into (default: 2 pp)")
    parser.set_defaults(steps=6, warmup=3)  # the folder's: 14 runs in `make pipeline`
    args = parser.parse_args()
    world, pp = common.launch_world_size(), args.pp
    m = args.microbatches or 2 * pp
    if why := stages_problem(args, m):
        parser.error(why)
    tp = args.tp or default_3d_tp(args, world, pp)
    if why := mesh_problem(args, world, tp, m, pp * tp * args.batch_size):
        parser.error(why)
    return args, {"pp": pp, "dp": world // (pp * tp), "tp": tp}, m


# Copied from 03_fsdp/optimized_fsdp_tp.py: comm_by_dim
def comm_by_dim(stats: common.Stats, mesh: DeviceMesh,
                also: dict[str, dist.ProcessGroup | None] | None = None) -> dict[str, float]:
    """The measured bytes of each mesh dim: those sent on that dim's process group, and on the
    group `also` names for it, if any (the 3-D run's tied pairs, counted as pp's)."""
    sent, also = stats.comm_mb_by_group or {}, also or {}
    groups = {dim: [g for g in (mesh.get_group(dim), also.get(dim)) if g is not None]
              for dim in mesh.mesh_dim_names}
    return {dim: round(sum(sent.get(g.group_name, 0.0) for g in dim_groups), 3)
            for dim, dim_groups in groups.items()}


# Copied from 03_fsdp/optimized_fsdp_tp.py: sequence_parallel_bytes
def sequence_parallel_bytes(tp: int, collectives: float, tokens: float, width: float,
                            value_bytes: float) -> float:
    """Bytes a rank of a TP group sends in `collectives` all-gathers or reduce-scatters of the
    group's `tokens` x `width` activations, `value_bytes` a value: (t-1)/t of each, a ring's
    share. Sequence parallelism runs 8 a layer: a gather before attention and before the MLP,
    a reduce-scatter after each, and their twins in backward."""
    return collectives * (tp - 1) / tp * tokens * width * value_bytes


# Copied from 03_fsdp/optimized_fsdp_tp.py: loss_parallel_bytes
def loss_parallel_bytes(tp: int, tokens: float) -> float:
    """Bytes a rank sends for the loss over logits split by vocabulary over a TP group
    (loss_parallel): 3 ring all-reduces of one fp32 value a token (the log-softmax's max and
    sum of exponentials, the target's log-probability)."""
    return 3 * common.ring_allreduce_mb(4 * tokens, tp) * 2**20


def stage_bytes(pieces: float, tied_pieces: float, norms: float, layers: int,
                micro_tokens: float, hidden: int, dp: int, tp: int, m: int, activation: float,
                first: bool, last: bool, positions: int = 0, state: float = 16,
                reduce: float = 4) -> dict:
    """PP x FSDP x TP's bytes a GPU of a stage, from its TP pieces (`pieces`, of which the tied
    table's `tied_pieces`), FSDP sharding them dp ways: `state` bytes a value. Sent a step, by
    mesh dim, over m micro-batches of `micro_tokens` (the TP group's) x `hidden` activations,
    `activation` bytes a value, gradients `reduce` bytes. tp: a micro-batch's
    sequence_parallel_bytes, 8 a layer; the first stage's embedding scatter and its twin (and
    a learned position table's lookup: its `positions` rows), the last's head gather and its
    twin and loss_parallel_bytes; the norms' gradients all-reduced once a step. dp: one gather
    (kept to the last backward) and one reduce-scatter of the pieces. pp: each micro-batch's
    activation shard to the next stage, its gradient to the previous, and the tied table's
    gradient shard all-reduced with the other end's (a pair: once)."""
    collectives = 8 * layers + 2 * first + 2 * last
    per_micro = sequence_parallel_bytes(tp, collectives, micro_tokens, hidden, activation) \
        + first * sequence_parallel_bytes(tp, 2, positions, hidden, activation) \
        + last * loss_parallel_bytes(tp, micro_tokens)
    tp_bytes = m * per_micro + common.ring_allreduce_mb(reduce * norms, tp) * 2**20
    dp_bytes = (dp - 1) / dp * (activation + reduce) * pieces
    boundary = micro_tokens // tp * hidden * activation  # a micro-batch's activation shard
    pp_bytes = m * boundary * ((not last) + (not first)) + reduce * tied_pieces / dp
    return {"state": state * pieces / dp, "sent": pp_bytes + dp_bytes + tp_bytes,
            "by_dim": {"pp": pp_bytes, "dp": dp_bytes, "tp": tp_bytes}}


# Copied from 05_pipeline/baseline_pipeline.py: uniform_bubble
def uniform_bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a step whose actions all take the same time: a stage waits p-1
    slots in m+p-1, (p-1)/(m+p-1): GPipe's and 1F1B's alike, and this baseline's with its one
    batch (m = 1), (p-1)/p."""
    return (stages - 1) / (microbatches + stages - 1)


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: planned_end_stage_layers
def planned_end_stage_layers(plan: "PlanInput", stages: int) -> tuple[int, int]:
    """The decoder layers of a pipeline's first and last stages, cut as the scripts cut them
    (common's Decoder.pipeline_stages: by the weights of the matrix multiplies a token meets,
    the head's among them; a MoE's experts counted as if in every layer)."""
    if stages == 1:
        return plan.layers, plan.layers
    final_norm = plan.norms / (2 * plan.layers + 1)  # a layer holds two
    layer = (plan.blocks - final_norm) / plan.layers
    experts = plan.expert_params / plan.layers
    meets = layer - 2 * final_norm - (experts * (1 - plan.top_k / plan.experts)
                                      if plan.experts else 0.0)
    cut = common.cut_into_stages([0.0, *[meets] * plan.layers, plan.vocab * plan.hidden], stages)
    return len(cut[0]) - 1, len(cut[-1]) - 1


def planned_pipeline_3d(plan: "PlanInput") -> dict:
    """The planner's PP x FSDP x TP row at pp = `plan.pp` stages (planned_end_stage_layers), TP
    over `plan.tp` GPUs, FSDP over the dp that leaves, m micro-batches (2 pp by default), a GPU's
    micro-batch of one sequence shard a TP rank. State and the stage held gathered (FSDP's bf16
    param_dtype): the heavier end's (the first's tables, or the head and a tied head's copy of
    the token table). The rest, the first stage's, the one activations bind (the most layers,
    min(pp, m) micro-batches in flight, no loss): its bytes (the last runs loss_parallel instead
    of the embedding's collectives) and, as FSDP x TP's, each column-wise Linear's gathered
    input kept."""
    w, g, o = plan.state_bytes
    pp, tp = plan.pp, plan.tp
    dp, m = plan.gpus // (pp * tp), plan.micro_batches or 2 * pp
    final_norm = plan.norms / (2 * plan.layers + 1)

    def pieces(layers: int, end: float, last: bool) -> float:  # a stage's parameters after TP
        share = layers / plan.layers
        whole = (plan.replicated - final_norm) * share + final_norm * last
        return ((plan.blocks - plan.replicated) * share + end) / tp + whole

    layers, last_layers = planned_end_stage_layers(plan, pp)
    first_pieces = pieces(layers, plan.embedding + (plan.head + plan.tied) * (pp == 1), pp == 1)
    heavier = max(first_pieces, pieces(last_layers, plan.head + plan.tied, True))
    first = stage_bytes(first_pieces, plan.tied / tp,
                        (plan.norms - final_norm) * layers / plan.layers, layers,
                        tp * plan.micro_batch * plan.seq, plan.hidden, dp, tp, m,
                        plan.compute_bytes, True, pp == 1,
                        plan.seq if plan.position_table else 0)
    sent = first["by_dim"]
    return {"state": (w + g + o) * heavier / dp, "sent": first["sent"], "by_dim": sent,
            "gathered": plan.compute_bytes * heavier, "bubble": uniform_bubble(pp, m),
            "mesh": f"pp {pp} x dp {dp} x tp {tp}, m {m}",
            "sequences": dp * m * tp * plan.micro_batch,
            "stage_layers": layers, "in_flight": min(pp, m),
            "layer_extra": 2 * (tp - 1) * plan.micro_batch * plan.seq * plan.hidden
            * plan.compute_bytes, "loss": "loss_parallel" if pp == 1 else None,
            "network": sent["dp"] + sent["pp"] if plan.gpus > plan.per_node else 0.0}


def theory(stage: Stage, args: argparse.Namespace, mesh: DeviceMesh, m: int, params: int
           ) -> dict:
    """The record's theory: this rank's state and bytes per step, stage_bytes from its
    parallelized stage's shapes (each weight's tp piece, split by its placement on tp, padded to
    dp rows along dim 0), the state the busiest stage's (as the record's state_mb); beside them
    16 bytes of each of the model's `params` split evenly, and the uniform bubble."""
    pp, dp, tp = (mesh[dim].size() for dim in ("pp", "dp", "tp"))
    size, nbytes = common.SIZES[args.size], 2 if args.dtype == "bf16" else 4
    d, seq, micro = size.d_model, args.seq_len, pp * tp * args.batch_size // m

    def split_over_tp(p):
        return tp > 1 and p.placements[-1].is_shard()

    def piece(p):
        shape = list(p.shape)
        if split_over_tp(p):
            shape[p.placements[-1].dim] //= tp
        return math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])

    weights = list(stage.module.parameters())
    norms = [p for mod in stage.module.modules() if not isinstance(mod, nn.Linear)
             for p in mod.parameters(recurse=False) if not split_over_tp(p)]
    predicted = stage_bytes(sum(piece(p) for p in weights), sum(piece(p) for p in stage.tied),
                            sum(p.numel() for p in norms), len(stage.blocks), micro * seq, d, dp,
                            tp, m, nbytes, stage.first, stage.last,
                            seq if args.model == "gpt" else 0)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, predicted["state"] / 2**20)
    return {"state_mb": max(states),  # the busiest stage's, as the record's state_mb
            "comm_mb_by_dim": {dim: round(sent / 2**20, 3)
                               for dim, sent in predicted["by_dim"].items()},
            "comm_mb": predicted["sent"] / 2**20,
            "state_mb_even": 16 * params / (pp * dp * tp) / 2**20,
            "bubble_uniform": round(uniform_bubble(pp, m), 4)}


def main():
    args, dims, m = parsed_args()
    pp, dp, tp = dims["pp"], dims["dp"], dims["tp"]
    topo = common.setup(args)
    # a default mesh with dp 1 (4 GPUs: pp 2 x tp 2) is 3-D in name only: say so, and what fixes it
    no_dp = (f"pp {pp} x dp 1 x tp {tp}: no data-parallel dim; a dp of 2 needs "
             f"{2 * pp * tp} processes" if dp == 1 and not args.tp else None)
    if no_dp:
        common.log(topo, no_dp)
    mesh = init_device_mesh(topo.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    # a dp rank's batch is its pp x tp ranks' per-rank batches: the global batch is DDP's
    model, batches = common.workload(common.resolved(args, batch_size=pp * tp * args.batch_size),
                                     topo, dp_rank=mesh.get_local_rank("dp"), dp_world=dp)
    # global rank 0's whole model on every rank before the cut, as DDP starts: each stage's
    # layers (and a tied weight's two ends) then hold the same weights, however ranks were seeded
    same_weights_on_every_rank(model, mesh)
    params = sum(q.numel() for q in model.parameters())
    stage = pipeline(model, mesh, SCHEDULES[args.schedule], m, batches[0][0],
                     mixed_precision(args.dtype))
    del model  # the other stages' layers are freed: a rank holds its stage only
    opt = torch.optim.AdamW(stage.module.parameters(), lr=args.lr)
    with common.real_tensors():
        last_stage_rank = int(mesh.mesh[-1].flatten()[0])
    stats = common.timed_steps(
        functools.partial(train_step, stage, opt, mesh, args.clip_grad_norm), batches, args,
        topo, memory_of=(stage.module, opt), loss_rank=last_stage_rank)
    common.record(args, topo, stats, baseline="baseline_pipeline_3d", model=stage.module,
                  optimizer=opt, overlapped=common.FSDP_OVERLAP, comm_mb=stats.comm_mb,
                  params=params, mesh=dims,
                  comm_mb_by_dim=comm_by_dim(stats, mesh, {"pp": stage.pairs}),
                  schedule=args.schedule, microbatches=m, stages=pp,
                  clip_grad_norm=args.clip_grad_norm, note=no_dp,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  theory=theory(stage, args, mesh, m, params))


# The planner's rows (report/planner.py reads this; the script never does): the 3-D layout,
# last; "pipelined": the planner tries each pipeline depth that divides its GPUs.
PLANNED = [{"strategy": "PP x FSDP x TP", "place": 120, "figures": planned_pipeline_3d,
            "pipelined": True}]


if __name__ == "__main__":
    common.run_main(main)
