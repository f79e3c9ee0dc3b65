"""FSDP2 x tensor parallelism on a 2-D device mesh ("dp", "tp"): how models past one node train.

What it does: the ranks form a dp x tp grid, tp innermost (neighbouring ranks: one node's GPUs).
parallelize() composes as torchtitan's parallelize_llama does, a named step per dim. apply_tp over
"tp": in each block q, k, v and the MLP's input matrices column-wise, the output projections
row-wise, the norms sequence-parallel (activations between blocks split along the sequence: each
norm's output all-gathered, the projections' reduce-scattered); the token (and position) tables
row-wise, the head column-wise, its logits split by vocabulary for a loss under loss_parallel().
Then apply_fsdp over "dp": fully_shard on each block and the root, so each weight, already split
tp ways, is sharded dp ways more: every parameter ends a 2-D DTensor, and gradient clipping takes
one norm over the mesh. The GPT's fused qkv becomes three Linears (an even split of it would hand
rank 0 all of q); its tied head stays tied. The plans fit HuggingFace's Llama, Qwen2, Mistral.
Why it helps: TP divides every block's weights AND its activations by tp at the price of
activation traffic each layer (fast links only); FSDP divides what is left by dp at the price of
weight traffic once a step (slow links are fine). Why this order: fully_shard must see the TP
DTensors to shard their local pieces.
Run:        torchrun --nproc_per_node=4 03_fsdp/optimized_fsdp_tp.py --size small --tp 2
            (--tp 1: plain FSDP over every rank; --checkpoint-dir/--checkpoint-every/--resume:
            DCP checkpoints that load at any other --tp and world)
Look for:   `make fsdp report`: beside baseline_fsdp (DDP, same world and global batch) the
            same losses, state MB near 16 x params / (dp x tp), comm MB split by mesh dim.
Theory:     state 16 bytes x (each weight's tp piece, padded to dp) / dp. tp: per block 4
            all-gathers and 4 reduce-scatters of (tp-1)/tp x the dp rank's batch x T x d
            activations, the ends' 4, loss_parallel's 3 all-reduces of 4 bytes a token, the
            norms' gradients; dp: (dp-1)/dp x (2 gathers a block + 1 of the root + 1
            reduce-scatter) of the tp pieces.
"""

import argparse
import itertools
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
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

# Against DDP, fp32: TP splits each matrix multiply's sum over d (row-wise) into tp partial
# sums added by the reduce-scatter, FSDP sums gradients over dp in its own order: the same sums
# in another order, per step and absolute. bf16: the dtype's resolution.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def build_mesh(device_type: str, world: int, tp: int) -> DeviceMesh:
    """(dp, tp), tp the inner dim: a TP group is neighbouring ranks, on GPUs one node's."""
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


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


def block_input() -> PrepareModuleInput:
    """A block's input as its sequence shard, a local tensor: the embedding's DTensor (the whole
    sequence's shape, see ends_plan) before the first block, the previous block's shard after."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                              use_local_output=True)


def gpt_block_plan() -> dict:
    """The TP + sequence-parallel plan of one GPT block (after SplitQKVAttention)."""
    return {"": block_input(), "ln1": GatheredSequenceParallel(),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": GatheredSequenceParallel(), "fc": ColwiseParallel(),
            "fc_proj": RowwiseParallel(output_layouts=Shard(1))}


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


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """FSDP's dtypes for --dtype: bf16 weights in compute, gradients reduced in fp32; fp32 all
    through."""
    bf16 = dtype == "bf16"
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                reduce_dtype=torch.float32 if bf16 else None)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, max_norm: float | None,
               inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """One step on a dp rank's batch (B sequences of T tokens, given whole to its tp ranks):
    forward and backward under loss_parallel(), where the logits and their gradient stay split by
    vocabulary; the gradient clipped to `max_norm` (None: not), one norm over the whole mesh."""
    opt.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = model(inputs_BT, targets_BT)
        loss.backward()
    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss  # tp 1: a tensor


def decoder_plans(model: common.Decoder) -> tuple[dict, dict]:
    """The block and ends plans of the project's decoders (main's adapter: a trainer of one's
    own writes the plan for its own module names). The GPT's qkv is split first."""
    if isinstance(model, common.Llama):
        return decoder_layer_plan(), ends_plan(["model.embed_tokens"], "model.norm", "lm_head")
    for block in model.blocks:
        block.attn = SplitQKVAttention(block.attn)
    return gpt_block_plan(), ends_plan(["tok_emb", "pos_emb"], "ln_f", "head")


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


def default_tp(args: argparse.Namespace, world: int, node: int, stages: int = 1) -> int | None:
    """--tp's default: the largest tp >= 2 that divides a node's `node` processes (a TP group
    stays on one node's links) and that --size's model splits on a stage's `world / stages`
    ranks (tp_problem: heads, KV heads, ...), leaving dp >= 2 where the world has room for it,
    dp 1 where not; None where no tp >= 2 fits."""
    fits = [t for t in range(node, 1, -1) if node % t == 0 and world % (stages * t) == 0
            and tp_problem(args, t, world // stages) is None]
    return max(fits, key=lambda t: (world // (stages * t) >= 2, t), default=None)


def node_size(world: int) -> int:
    """The processes a TP group may span: a node's GPUs on CUDA; on CPU 2, where more would
    only share the same cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torch.cuda.is_available() else 2


def parsed_args() -> tuple[argparse.Namespace, int]:
    """The flags, and the tp they give on this world (--tp, or default_tp's). A tp the model
    cannot split stops in one line (tp_problem); a world with no room for dp and tp >= 2 skips."""
    parser = common.parser(__doc__, skips={
        "resnet": "a ResNet has no attention heads or MLP matrices for tensor parallelism to "
                  "split: FSDP x TP runs --model gpt or llama",
        "moe": "a MoE's MLP is a router and experts, not the one SwiGLU this TP plan splits: "
               "FSDP x TP runs --model gpt or llama (experts: 08_moe)"})
    parser.add_argument("--tp", type=common.int_at_least(1), default=None,
                        help="tensor-parallel degree, the inner mesh dim (default: the largest "
                             "that divides the heads, the KV heads and a node's GPUs, 2 on CPU, "
                             "leaving dp >= 2); dp = world / tp")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this 2-norm over the whole "
                        "mesh before each step (default: no clipping)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save DCP checkpoints here every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=common.int_at_least(1), default=10)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir, saved at "
                             "any --tp and world, at the step after it")
    args = parser.parse_args()
    world = common.launch_world_size()
    if (args.checkpoint_every != 10 or args.resume) and not args.checkpoint_dir:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir: add one")
    tp = args.tp or default_tp(args, world, node_size(world))
    if not args.tp and (tp is None or world // tp < 2):
        raise common.Skip(f"a 2-D mesh needs dp >= 2 and tp >= 2 (a divisor of a node's "
                          f"{node_size(world)} processes and of the heads), {world} processes "
                          f"have no room: launch 4 or more (or give --tp)")
    if why := tp_problem(args, tp, world):
        parser.error(why)
    return args, tp


# Copied from 03_fsdp/optimized_fsdp_checkpoint.py: save_checkpoint
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


# Copied from 03_fsdp/optimized_fsdp_checkpoint.py: load_latest_checkpoint
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


def comm_by_dim(stats: common.Stats, mesh: DeviceMesh,
                also: dict[str, dist.ProcessGroup | None] | None = None) -> dict[str, float]:
    """The measured bytes of each mesh dim: those sent on that dim's process group, and on the
    group `also` names for it, if any (the 3-D run's tied pairs, counted as pp's)."""
    sent, also = stats.comm_mb_by_group or {}, also or {}
    groups = {dim: [g for g in (mesh.get_group(dim), also.get(dim)) if g is not None]
              for dim in mesh.mesh_dim_names}
    return {dim: round(sum(sent.get(g.group_name, 0.0) for g in dim_groups), 3)
            for dim, dim_groups in groups.items()}


def sequence_parallel_bytes(tp: int, collectives: float, tokens: float, width: float,
                            value_bytes: float) -> float:
    """Bytes a rank of a TP group sends in `collectives` all-gathers or reduce-scatters of the
    group's `tokens` x `width` activations, `value_bytes` a value: (t-1)/t of each, a ring's
    share. Sequence parallelism runs 8 a layer: a gather before attention and before the MLP,
    a reduce-scatter after each, and their twins in backward."""
    return collectives * (tp - 1) / tp * tokens * width * value_bytes


def loss_parallel_bytes(tp: int, tokens: float) -> float:
    """Bytes a rank sends for the loss over logits split by vocabulary over a TP group
    (loss_parallel): 3 ring all-reduces of one fp32 value a token (the log-softmax's max and
    sum of exponentials, the target's log-probability)."""
    return 3 * common.ring_allreduce_mb(4 * tokens, tp) * 2**20


def fsdp_tp_bytes(block_pieces: float, root_pieces: float, norms: float, layers: int,
                  group_tokens: float, hidden: int, dp: int, tp: int, activation: float,
                  positions: int = 0, state: float = 16, reduce: float = 4) -> dict:
    """FSDP x TP's bytes a GPU, from its TP pieces (a parameter's share after TP, whole where
    TP replicates it) in the blocks and the root, FSDP sharding each dp ways: `state` bytes a
    value. Sent a step, by mesh dim (`activation`: a weight's and an activation's bytes, in the
    compute dtype; `reduce`: a gradient's, fp32). tp: sequence_parallel_bytes of the group's
    `group_tokens` x `hidden` activations, 8 a layer and 4 more at the ends (the embedding's
    scatter, the head's input gather, and their twins), loss_parallel_bytes, a learned
    position table's lookup (its `positions` rows of `hidden`, 0 without one: a gather and its
    twin) and the norms' gradients all-reduced. dp: (dp-1)/dp of each block's pieces gathered
    twice (FULL_SHARD), the root's once, every gradient reduce-scattered once. Held gathered
    beyond the shards: a block and the next's prefetch."""
    tp_bytes = sequence_parallel_bytes(tp, 8 * layers + 4, group_tokens, hidden, activation) \
        + loss_parallel_bytes(tp, group_tokens) \
        + sequence_parallel_bytes(tp, 2, positions, hidden, activation) \
        + common.ring_allreduce_mb(reduce * norms, tp) * 2**20
    gathered = (2 * block_pieces + root_pieces) * activation
    dp_bytes = (dp - 1) / dp * (gathered + reduce * (block_pieces + root_pieces))
    return {"state": state * (block_pieces + root_pieces) / dp, "sent": tp_bytes + dp_bytes,
            "by_dim": {"tp": tp_bytes, "dp": dp_bytes},
            "gathered": 2 * activation * block_pieces / layers}


def planned_fsdp_tp(plan: "PlanInput") -> dict:
    """The planner's FSDP x TP row: TP over `plan.tp` GPUs (a node's), FSDP over the dp that
    leaves; blocks split t ways but for what TP replicates, the tables and an untied head split
    t ways; each GPU one micro-batch, its group's t of them together. TP's bytes stay in the
    node, FSDP's cross nodes."""
    w, g, o = plan.state_bytes
    tp, dp = plan.tp, plan.gpus // plan.tp
    predicted = fsdp_tp_bytes((plan.blocks - plan.replicated) / tp + plan.replicated,
                              (plan.embedding + plan.head) / tp, plan.norms, plan.layers,
                              tp * plan.micro_batch * plan.seq, plan.hidden, dp, tp,
                              plan.compute_bytes, plan.seq if plan.position_table else 0,
                              w + g + o)
    # A column-wise Linear keeps its input for backward as it got it: the sequence gathered
    # from the group's tp GPUs (Megatron-LM keeps its own shard and gathers again). Two a layer
    # (attention's and the MLP's), (tp-1)/tp of them beyond a GPU's own tokens: tp-1 of its
    # micro-batch's, which a layer's count of its activations leaves out.
    gathered_inputs = 2 * (tp - 1) * plan.micro_batch * plan.seq * plan.hidden \
        * plan.compute_bytes
    return {**predicted, "mesh": f"dp {dp} x tp {tp}", "sequences": plan.gpus * plan.micro_batch,
            "layer_extra": gathered_inputs, "loss": "loss_parallel",
            "network": predicted["by_dim"]["dp"] if plan.gpus > plan.per_node else 0.0}


def theory(model: nn.Module, blocks: list[nn.Module], args, dp: int, tp: int) -> dict:
    """State and bytes per step, fsdp_tp_bytes from the shapes of the parallelized model: each
    parameter's tp piece (its shape split by its placement on tp, the mesh's last dim), padded
    by FSDP to dp rows along dim 0."""
    size, nbytes = common.SIZES[args.size], 2 if args.dtype == "bf16" else 4
    d, seq, batch = size.d_model, args.seq_len, tp * args.batch_size  # a dp rank's batch

    def split_over_tp(p):
        return tp > 1 and p.placements[-1].is_shard()

    def piece(p):  # the parameter's share after TP, padded to dp rows
        shape = list(p.shape)
        if split_over_tp(p):
            shape[p.placements[-1].dim] //= tp
        return math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])

    params = list(model.parameters())
    # the norms' weights, replicated over tp, each rank's gradient from its tokens: all-reduced
    # (a row-wise Linear's bias is replicated too, but its gradient is the whole batch's already)
    norms = [p for m in model.modules() if not isinstance(m, nn.Linear)
             for p in m.parameters(recurse=False) if not split_over_tp(p)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    replicated = [p for p in params if not split_over_tp(p)]
    predicted = fsdp_tp_bytes(sum(piece(p) for p in params if id(p) in in_blocks),
                              sum(piece(p) for p in params if id(p) not in in_blocks),
                              sum(p.numel() for p in norms), len(blocks), batch * seq, d, dp, tp,
                              nbytes, seq if args.model == "gpt" else 0)
    sent = predicted["by_dim"]
    total = sum(p.numel() for p in params)
    return {"state_mb": predicted["state"] / 2**20,
            "state_mb_even": 16 * total / (dp * tp) / 2**20,
            "replicated_params": sum(p.numel() for p in replicated),
            "comm_mb_by_dim": {dim: round(sent[dim] / 2**20, 3) for dim in ("dp", "tp")},
            "comm_mb": predicted["sent"] / 2**20}


def main():
    args, tp = parsed_args()
    world = common.launch_world_size()
    dp = world // tp
    topo = common.setup(args)
    mesh = build_mesh(topo.device.type, world, tp)
    # a dp rank's batch is its tp ranks' per-rank batches together: the global batch is DDP's
    model, batches = common.workload(common.resolved(args, batch_size=tp * args.batch_size),
                                     topo, dp_rank=mesh.get_local_rank("dp"), dp_world=dp)
    same_weights_on_every_rank(model, mesh)
    blocks, (block_plan, ends) = common.transformer_blocks(model), decoder_plans(model)
    parallelize(model, mesh, blocks, block_plan, ends, mixed_precision(args.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = load_latest_checkpoint(model, opt, args.checkpoint_dir) if args.resume else 0
    if len(batches) - start <= args.warmup:
        raise ValueError(f"resuming after step {start} leaves no timed step: raise --steps")
    done = itertools.count(start + 1)  # the steps, counted on from the checkpoint's

    def step_and_save(inputs, targets):
        loss = train_step(model, opt, args.clip_grad_norm, inputs, targets)
        if args.checkpoint_dir and (step := next(done)) % args.checkpoint_every == 0:
            save_checkpoint(model, opt, args.checkpoint_dir, step, topo)
        return loss

    stats = common.timed_steps(step_and_save, batches[start:], args, topo, memory_of=(model, opt))
    common.record(args, topo, stats, baseline="baseline_fsdp", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP,
                  comm_mb=stats.comm_mb, mesh={"dp": dp, "tp": tp},
                  comm_mb_by_dim=comm_by_dim(stats, mesh), resumed_from=start,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], clip_grad_norm=args.clip_grad_norm,
                  theory=theory(model, blocks, args, dp, tp))


# The planner's rows (report/planner.py reads this; the script never does): the 2-D layout,
# after the one-dimensional ones.
PLANNED = [{"strategy": "FSDP x TP", "place": 110, "figures": planned_fsdp_tp}]


if __name__ == "__main__":
    common.run_main(main)
