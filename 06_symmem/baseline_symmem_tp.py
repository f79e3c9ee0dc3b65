"""Tensor parallelism with sequence parallelism, by hand, each collective blocking: the baseline
for async TP through symmetric memory.

What it does (Megatron-LM's split): every rank holds 1/N of each block's heads and MLP units,
all N ranks train one model on one batch. In a block, attention's qkv and the MLP's fc are
column-parallel (my rows: my heads' q, k, v, my hidden units), proj and fc_proj row-parallel (my
columns); each rank's output is a partial sum. Between blocks the activations are split along
the sequence (sequence parallelism: rank r holds tokens r*T*B/N.. of the sequence-major (T, B)
grid), so the norms and residual adds are 1/N each. Before a column-parallel linear an
all-gather of the sequence shards, after a row-parallel one a reduce-scatter into them;
backward is the mirror image. Embeddings, final norm and head are replicated, run on each
rank's own tokens (at this 1K vocab a vocab-parallel loss would cost more collectives than the
one all-reduce of their gradients). Heads and units that do not divide by N split unevenly.
--model llama: whole KV heads with their query heads, and SwiGLU (README, "How it works").
TensorParallelDecoder takes a model's parts (blocks, embedding, norm, head, its rotary) and the
collectives, which take the process group (default: world); biases are sliced with their rows
or added once after the reduce-scatter; what the layers do not compute is refused by name.
Why: a model whose layers do not fit one GPU's memory, or a batch too small to split, still
spreads over the GPUs of a node; the cost is 8 collectives of the activations per block.
Run:        torchrun --nproc_per_node=2 06_symmem/baseline_symmem_tp.py --size small
Look for:   `make symmem report`: the step time optimized_symmem_tp.py beats; losses equal to
            baseline_symmem_training's at the same global batch (N x 4 sequences).
Theory:     comm MB/step: per block 4 all-gathers and 4 reduce-scatters of T x B x d values
            (4 bytes, 2 in bf16), (N-1)/N each, plus an all-reduce of the replicated gradients.
            state: 16 bytes a parameter, of the blocks' 1/N plus every parameter they leave whole.
"""

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Per step, against the data-parallel baseline: row-parallel outputs are summed over ranks in
# another order than one matmul's, so fp32 rounding, compounded over the steps by AdamW. Under
# bf16 autocast each rank's partial sum is rounded to bf16 (8 bits) before the sum, where one
# matmul rounds once: the losses drift by bf16's resolution, as other exact techniques' do.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


class ProcessGroupCollectives:
    """TP's two communicating matmuls, through `group` (default: the world): the collective,
    whole, then the matmul. `b` is the weight as (in, out)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def all_gather_matmul(self, shard: torch.Tensor, b: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = shard.new_empty(self.world * shard.shape[0], shard.shape[1])
        common.all_gather_single(gathered, shard, group=self.group)
        return gathered, gathered @ b

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        partial = a @ b
        out = partial.new_empty(partial.shape[0] // self.world, partial.shape[1])
        common.reduce_scatter(out, partial, group=self.group)
        return out


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would multiply in: a custom Function's matmuls cast by hand, so that
    backward (outside autocast) sees the same dtypes. Its backward casts the incoming gradient
    to it too (the saved weight's dtype): under bf16 autocast that gradient can come in fp32,
    and the matmuls, the fused CUDA kernels too, take one dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class ColumnParallel(torch.autograd.Function):
    """y = gather(x) @ W^T (+ b) on my output rows. Backward: dW = dy^T gather(x) (the gathered
    input is kept), and dx, a partial sum on each rank, reduce-scattered to the shards."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        dtype = compute_dtype(x)
        weight = weight.to(dtype)
        gathered, y = comm.all_gather_matmul(x.to(dtype), weight.t())
        ctx.save_for_backward(gathered, weight)
        ctx.comm = comm
        return y if bias is None else y + bias.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dy = dy.to(weight.dtype)  # forward's dtype (compute_dtype)
        dx = ctx.comm.matmul_reduce_scatter(dy, weight)
        return dx, dy.t() @ gathered, dy.sum(0) if ctx.needs_input_grad[2] else None, None


class RowParallel(torch.autograd.Function):
    """y = reduce_scatter(x @ W^T) over my input columns (bias added by the caller, on the
    shard). Backward: dy gathered, then dx = gather(dy) @ W and dW = gather(dy)^T x."""

    @staticmethod
    def forward(ctx, x, weight, comm):
        dtype = compute_dtype(x)
        x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return comm.matmul_reduce_scatter(x, weight.t())

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.to(weight.dtype)  # forward's dtype (compute_dtype)
        gathered, dx = ctx.comm.all_gather_matmul(dy.contiguous(), weight)
        return dx, gathered.t() @ x, None


def my_share(total: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of `total` items: sizes differ by one at most."""
    return slice(total * rank // world, total * (rank + 1) // world)


def keep_rows(linear: nn.Linear, rows) -> None:
    """Column-parallel: the linear keeps its output rows `rows` (weight and bias), as new leaves."""
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone())


def keep_columns(linear: nn.Linear, cols) -> None:
    """Row-parallel: the linear keeps its input columns `cols`; a bias stays whole (replicated),
    added once to the reduced shard."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())


class TensorParallelBlock(nn.Module):
    """common.Block with my heads and hidden units only (of comm's group): the same weights,
    sliced. `sliced` lists the parameters the ranks hold parts of."""

    def __init__(self, block: common.Block, comm):
        super().__init__()
        d, n_heads, self.comm = block.ln1.normalized_shape[0], block.attn.n_heads, comm
        self.head_dim, heads = d // n_heads, my_share(n_heads, comm.rank, comm.world)
        cols = torch.arange(heads.start * self.head_dim, heads.stop * self.head_dim)
        rows = torch.cat([cols + k * d for k in range(3)])  # my heads' q, k and v
        units = my_share(block.fc.out_features, comm.rank, comm.world)
        self.ln1, self.ln2, self.attn, self.fc, self.fc_proj = (
            block.ln1, block.ln2, block.attn, block.fc, block.fc_proj)
        keep_rows(block.attn.qkv, rows)
        keep_rows(block.fc, units)
        keep_columns(block.attn.proj, cols)
        keep_columns(block.fc_proj, units)
        self.sliced = [block.attn.qkv.weight, block.attn.qkv.bias, block.attn.proj.weight,
                       block.fc.weight, block.fc.bias, block.fc_proj.weight]

    def forward(self, x: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
        qkv = ColumnParallel.apply(self.ln1(x), self.attn.qkv.weight, self.attn.qkv.bias,
                                   self.comm)
        q, k, v = qkv.view(seq_len, batch, 3, -1, self.head_dim).permute(2, 1, 3, 0, 4)
        y = self.attn.attention(q, k, v).permute(2, 0, 1, 3).reshape(seq_len * batch, -1)
        x = x + (RowParallel.apply(y, self.attn.proj.weight, self.comm) + self.attn.proj.bias)
        h = F.gelu(ColumnParallel.apply(self.ln2(x), self.fc.weight, self.fc.bias, self.comm))
        return x + (RowParallel.apply(h, self.fc_proj.weight, self.comm) + self.fc_proj.bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x (batch, heads, seq, head_dim) by the model's angles (cos and sin,
    broadcast to x), in HuggingFace's layout (`rotate_half`): the first and second halves of
    each head are the pairs turned."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def joint_bias(linears: tuple[nn.Linear, ...]) -> torch.Tensor | None:
    """The biases of linears multiplied as one (their rows side by side): None if none has one,
    zeros for one that has none."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.weight.new_zeros(linear.weight.shape[0]) if linear.bias is None
                      else linear.bias for linear in linears])  # rows kept: not out_features


def plus_bias(y: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A row-parallel output with its linear's bias, if any: added once, to the reduced shard."""
    return y if linear.bias is None else y + linear.bias


def unsupported_feature(layer: nn.Module) -> str | None:
    """What of a decoder layer TensorParallelLlamaLayer would compute otherwise than the model,
    in a phrase that names the module or config key; None when it computes all of it. (The
    sliding window depends on the sequence: the layer checks it in forward.)"""
    # the modules it computes, by owner ("": the layer); any other (a fused projection, q/k
    # norms, another norm) it would skip
    computed = {"self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
                "mlp": {"gate_proj", "up_proj", "down_proj", "act_fn"},
                "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}}
    for owner, known in computed.items():
        for name, _ in layer.get_submodule(owner).named_children():
            if name not in known:
                where = f"{owner}.{name}" if owner else name
                return (f"{where}: a module TensorParallelLlamaLayer does not compute (its "
                        f"{owner or 'layer'} holds {', '.join(sorted(known))} only)")
    attn = layer.self_attn
    config = getattr(attn, "config", None)  # HuggingFace's; common.Llama's layers have none
    if (act := getattr(config, "hidden_act", "silu")) not in ("silu", "swish"):
        return f"hidden_act {act!r}: TensorParallelLlamaLayer's MLP is SwiGLU (silu)"
    if (cap := getattr(config, "attn_logit_softcapping", None)) is not None:
        return f"attn_logit_softcapping {cap}: TensorParallelLlamaLayer's attention has no cap"
    if getattr(attn, "scaling", attn.head_dim**-0.5) != attn.head_dim**-0.5:
        return (f"scaling {attn.scaling}: TensorParallelLlamaLayer's attention scales by "
                f"1/sqrt(head_dim {attn.head_dim})")
    if dropout := getattr(attn, "attention_dropout", 0.0):
        return (f"attention_dropout {dropout}: TensorParallelLlamaLayer's attention drops "
                "nothing (set it to 0)")
    return None


class TensorParallelLlamaLayer(nn.Module):
    """A Llama-shaped decoder layer (HuggingFace's names: self_attn.q/k/v/o_proj,
    mlp.gate/up/down_proj, input_layernorm, post_attention_layernorm: Llama, Qwen2, Mistral)
    with my KV heads, their query heads and my SwiGLU units: q, k, v and gate, up
    column-parallel (each trio or pair one gather: their rows side by side, their biases
    with them), o and down row-parallel (a bias whole, added once to the reduced shard). A
    rank holds whole KV groups: KV heads that do not divide by N split unevenly, as the GPT's
    heads. `attention(q, k, v)`: causal, on (batch, heads, seq, head_dim), each KV head
    repeated for its query heads (common.causal_sdpa takes them as they are). Rotary: the
    model's angles, which forward takes (TensorParallelDecoder's `rotary`). A module or
    setting it would compute otherwise than the model is refused (unsupported_feature)."""

    def __init__(self, layer: nn.Module, comm, attention: Callable = common.causal_sdpa):
        super().__init__()
        if why := unsupported_feature(layer):
            raise ValueError(why)
        attn, mlp, self.comm, self.attention = layer.self_attn, layer.mlp, comm, attention
        self.head_dim = attn.head_dim
        kv_heads = attn.k_proj.out_features // self.head_dim
        if kv_heads < comm.world:
            raise ValueError(f"{kv_heads} KV heads cannot split over {comm.world} ranks (a rank "
                             f"holds whole KV heads): use a group of at most {kv_heads}")
        # HuggingFace's: on the attention (Qwen2's sliding layers) or for every layer (Mistral)
        self.sliding_window = getattr(attn, "sliding_window",
                                      getattr(getattr(attn, "config", None), "sliding_window",
                                              None))
        group = attn.q_proj.out_features // attn.k_proj.out_features  # query heads a KV head
        mine = my_share(kv_heads, comm.rank, comm.world)
        kv_rows = slice(mine.start * self.head_dim, mine.stop * self.head_dim)
        q_rows = slice(kv_rows.start * group, kv_rows.stop * group)  # their query heads
        units = my_share(mlp.gate_proj.out_features, comm.rank, comm.world)
        self.input_layernorm, self.self_attn = layer.input_layernorm, attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, mlp
        columns = ((attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows),
                   (mlp.gate_proj, units), (mlp.up_proj, units))
        for linear, rows in columns:
            keep_rows(linear, rows)
        keep_columns(attn.o_proj, q_rows)
        keep_columns(mlp.down_proj, units)
        # o's and down's biases stay whole: replicated, their gradients all-reduced
        self.sliced = [*(linear.weight for linear, _ in columns), attn.o_proj.weight,
                       mlp.down_proj.weight,
                       *(linear.bias for linear, _ in columns if linear.bias is not None)]

    def forward(self, x: torch.Tensor, seq_len: int, batch: int,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`rotary`: the model's (cos, sin) of positions 0..seq_len-1, (1, seq, head_dim)."""
        if self.sliding_window is not None and self.sliding_window < seq_len:
            raise ValueError(f"sliding_window {self.sliding_window} is shorter than the "
                             f"{seq_len}-token sequence: TensorParallelLlamaLayer attends to "
                             f"the whole sequence (train at most {self.sliding_window} tokens)")
        if (turned := rotary[0].shape[-1]) != self.head_dim:
            raise ValueError(f"the rotary turns {turned} of the {self.head_dim} dims of a head "
                             "(partial_rotary_factor): TensorParallelLlamaLayer turns them all")
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)  # my rows
        qkv = ColumnParallel.apply(self.input_layernorm(x),
                                   torch.cat([linear.weight for linear in projections]),
                                   joint_bias(projections), self.comm)
        q, k, v = (t.reshape(seq_len, batch, -1, self.head_dim).permute(1, 2, 0, 3)
                   for t in qkv.split([linear.weight.shape[0] for linear in projections], -1))
        # (1, 1, seq, head_dim): every head alike, in q's dtype (the compute dtype)
        cos, sin = (t.unsqueeze(1).to(q.dtype) for t in rotary)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # the whole sequence: 0..T-1
        if self.attention is not common.causal_sdpa:  # SDPA groups the KV heads itself
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = self.attention(q, k, v).permute(2, 0, 1, 3).reshape(seq_len * batch, -1)
        x = x + plus_bias(RowParallel.apply(y, attn.o_proj.weight, self.comm), attn.o_proj)
        gate, up = ColumnParallel.apply(
            self.post_attention_layernorm(x), torch.cat([mlp.gate_proj.weight,
                                                         mlp.up_proj.weight]),
            joint_bias((mlp.gate_proj, mlp.up_proj)), self.comm).chunk(2, dim=-1)
        return x + plus_bias(RowParallel.apply(F.silu(gate) * up, mlp.down_proj.weight,
                                               self.comm), mlp.down_proj)


class TensorParallelDecoder(nn.Module):
    """A decoder split over comm's group, from its parts: the TP blocks, and replicated parts
    each rank runs on its sequence shard (token embedding, a position table if the model has
    one, final norm, head, tied or not). `rotary`, the model's rotary embedding, is called as
    HuggingFace's `rotary_emb(x, position_ids) -> (cos, sin)`, once a forward, and its angles
    handed to every block: the model's base, scaling and attention factor. Every parameter no
    block sliced is in `replicated_parameters()`, whose gradients the ranks all-reduce.
    `forward` returns its shard's share of the mean loss (the sum over ranks is the loss)."""

    def __init__(self, blocks: list[nn.Module], token_embedding: nn.Embedding,
                 final_norm: nn.Module, head: nn.Module, comm,
                 position_embedding: nn.Embedding | None = None,
                 autocast_dtype: torch.dtype | None = None, rotary: Callable | None = None):
        super().__init__()
        if rotary is None and any(isinstance(b, TensorParallelLlamaLayer) for b in blocks):
            raise ValueError("TensorParallelLlamaLayer turns q and k by the model's angles: pass "
                             "rotary=model.model.rotary_emb")
        self.comm, self.autocast_dtype, self.rotary = comm, autocast_dtype, rotary
        self.token_embedding, self.position_embedding = token_embedding, position_embedding
        self.final_norm, self.head, self.blocks = final_norm, head, nn.ModuleList(blocks)

    def replicated_parameters(self) -> list[nn.Parameter]:
        sliced = {id(p) for block in self.blocks for p in block.sliced}
        return [p for p in self.parameters() if id(p) not in sliced]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, seq_len = tokens.shape
        if seq_len * batch % self.comm.world:
            raise ValueError(f"{batch} x {seq_len} tokens do not split over {self.comm.world} "
                             "ranks: feed a batch whose tokens are a multiple of the group's size")
        mine = my_share(seq_len * batch, self.comm.rank, self.comm.world)  # (T, B) rows
        positions = torch.arange(seq_len, device=tokens.device)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            x = self.token_embedding(tokens.t().reshape(-1)[mine])
            if self.position_embedding is not None:
                x = x + self.position_embedding(positions.repeat_interleave(batch)[mine])
            angles = None if self.rotary is None else self.rotary(x, positions[None])
            for block in self.blocks:
                x = block(x, seq_len, batch) if angles is None else block(x, seq_len, batch,
                                                                          angles)
            logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.float(), targets.t().reshape(-1)[mine],
                               reduction="sum") / (seq_len * batch)


def same_loss_or_refuse(tp_model: TensorParallelDecoder, tokens: torch.Tensor,
                        targets: torch.Tensor, expected: torch.Tensor, name: str,
                        group=None) -> None:
    """The split model's loss on one batch held to the whole model's, `expected` (taken before
    the split), to rounding: what the layers would compute otherwise and no check names (an
    interleaved rotary, a scaled residual or logit, clamped q, k, v) stops it in one line
    naming the model. In bf16 rounding hides differences under ~8%: check in fp32 first."""
    with torch.no_grad():
        loss = tp_model(tokens, targets)
        dist.all_reduce(loss, group=group)
    tolerance = 10 * torch.finfo(next(tp_model.parameters()).dtype).eps
    if not torch.allclose(loss, expected.to(loss.dtype), rtol=tolerance, atol=tolerance):
        raise ValueError(f"{name} computes otherwise than the split layers (loss {loss.item():.6g}"
                         f" against its own {expected.item():.6g}): its layers or forward do "
                         "more than Llama's; TP it with a plan of its own")


def same_weights_as_first_rank(model: nn.Module, group=None) -> None:
    """Every rank of the group starts from its first rank's weights (as DDP does), before the
    blocks are sliced: ranks seeded differently still split one model."""
    src = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)


def tensor_parallel(model: common.Decoder, comm) -> TensorParallelDecoder:
    """The project's decoders split by TensorParallelDecoder (main's adapter: a trainer of
    one's own passes its own parts). common.Llama's rotary is common.apply_rotary's (base
    10,000), given here in the call shape of HuggingFace's rotary_emb."""
    blocks = common.transformer_blocks(model)
    final_norm = model.pipeline_layers()[-1].ln_f  # the LossHead's: the GPT's ln_f, model.norm
    if isinstance(model, common.GPT):
        return TensorParallelDecoder([TensorParallelBlock(b, comm) for b in blocks],
                                     model.tok_emb, final_norm, model.head, comm,
                                     model.pos_emb, model.autocast_dtype)
    head_dim = blocks[0].self_attn.head_dim

    def rotary(x: torch.Tensor, position_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = common.rotary_table(position_ids.shape[-1], head_dim, x.device, x.dtype,
                                       10_000.0, position_ids[0])
        return cos[None], sin[None]

    return TensorParallelDecoder([TensorParallelLlamaLayer(b, comm, b.self_attn.attention)
                                  for b in blocks],
                                 common.input_embedding(model), final_norm,
                                 common.output_head(model), comm,
                                 autocast_dtype=model.autocast_dtype, rotary=rotary)


def tp_degree_problem(args, world: int) -> str | None:
    """Why `world` ranks cannot split --size's heads: a rank needs a head (the Llama: a KV head
    and its query heads) of its own."""
    size = common.SIZES[args.size]
    heads, what = ((size.n_kv_heads, "KV heads") if args.model == "llama"
                   else (size.n_heads, "heads"))
    if world > heads:
        return (f"--size {args.size} has {heads} {what}, fewer than the {world} processes to "
                f"split them over: launch at most {heads}")
    return None


@dataclass
class TensorParallelRun:
    """What tensor_parallel_setup hands a TP script's main."""
    settings: argparse.Namespace  # the flags, batch_size resolved to the whole global batch
    topo: common.Topology
    model: TensorParallelDecoder  # its collectives: model.comm
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # the whole global batch, on every rank
    grads: torch.Tensor  # every parameter's gradient in one flat buffer, the replicated first
    replicated: int  # values at the head of `grads` that the ranks all-reduce
    params: int  # the unsplit model's parameter count


def tensor_parallel_setup(parser, comm_of) -> TensorParallelRun:
    """Flags, topology, the workload (one global batch, N x --batch-size sequences, on every
    rank) and the TP model with `comm_of(settings, topo)` as its collectives (`model.comm`); the
    replicated parameters first, so that their gradients are one slice of one flat buffer."""
    parser.set_defaults(batch_size=0)
    parser.skips["resnet"] = ("a ResNet has no attention heads or MLP matrices for tensor "
                              "parallelism to split: TP runs --model gpt or llama")
    parser.skips["moe"] = ("a MoE's MLP is a router and experts, not the one SwiGLU these layers "
                           "split: TP runs --model gpt or llama (experts: 08_moe)")
    args = parser.parse_args()
    world = common.launch_world_size()
    if why := tp_degree_problem(args, world):
        raise common.Skip(why)
    # one global batch on every rank: N x the per-rank batch
    settings = common.resolved(
        args, batch_size=world * (args.batch_size or common.SIZES[args.size].batch_size))
    topo = common.setup(settings)
    whole, batches = common.workload(settings, topo, dp_rank=0, dp_world=1)
    params = sum(p.numel() for p in whole.parameters())
    same_weights_as_first_rank(whole)
    model = tensor_parallel(whole, comm_of(settings, topo))
    replicated = model.replicated_parameters()
    kept = {id(p) for p in replicated}
    ordered = replicated + [p for p in model.parameters() if id(p) not in kept]
    grads = torch.zeros(sum(p.numel() for p in ordered), device=topo.device,
                        dtype=ordered[0].dtype)
    offset = 0
    for p in ordered:  # backward accumulates into views of one buffer
        p.grad = grads[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return TensorParallelRun(settings, topo, model, batches, grads,
                             sum(p.numel() for p in replicated), params)


# Copied from 03_fsdp/optimized_fsdp_tp.py: sequence_parallel_bytes
def sequence_parallel_bytes(tp: int, collectives: float, tokens: float, width: float,
                            value_bytes: float) -> float:
    """Bytes a rank of a TP group sends in `collectives` all-gathers or reduce-scatters of the
    group's `tokens` x `width` activations, `value_bytes` a value: (t-1)/t of each, a ring's
    share. Sequence parallelism runs 8 a layer: a gather before attention and before the MLP,
    a reduce-scatter after each, and their twins in backward."""
    return collectives * (tp - 1) / tp * tokens * width * value_bytes


def tp_bytes(kept: float, reduced: float, layers: int, tokens: float, hidden: int, world: int,
             activation: float, state: float = 16, grad: float = 4) -> dict[str, float]:
    """Tensor parallelism's bytes a rank: `state` bytes for each of the `kept` parameters (its
    slices and what it keeps whole). Sent a step: sequence_parallel_bytes over the N ranks, 8
    a layer, of the `tokens` x `hidden` activations, `activation` bytes a value, and the ring
    all-reduce of the `reduced` parameters' gradients (the whole ones, each rank's tokens'
    share), `grad` bytes."""
    return {"state": state * kept,
            "sent": sequence_parallel_bytes(world, 8 * layers, tokens, hidden, activation)
            + common.ring_allreduce_mb(grad * reduced, world) * 2**20}


def planned_tp(plan: "PlanInput", across_nodes: bool = False) -> dict[str, float]:
    """The planner's TP rows. TP: the blocks split over every GPU, the tables, norms and
    row-parallel biases whole, the group working on its G GPUs' micro-batches together. TP x DP
    (`across_nodes`): TP over a node's GPUs, its replicas on the other nodes all-reducing each
    GPU's gradients (the bytes across nodes)."""
    w, g, o = plan.state_bytes
    t = min(plan.per_node, plan.gpus) if across_nodes else plan.gpus
    whole = plan.embedding + plan.head + plan.replicated  # an untied head is replicated too
    kept = (plan.params - whole) / t + whole
    predicted = tp_bytes(kept, whole, plan.layers, t * plan.micro_batch * plan.seq,
                         plan.hidden, t, plan.compute_bytes, w + g + o, g)
    replicas = plan.gpus // t
    across = 2 * (replicas - 1) / replicas * g * kept
    return {"state": predicted["state"], "sent": predicted["sent"] + across,
            "cast": plan.cast(kept), "fp32_residual": True,
            # ColumnParallel keeps its gathered input for backward: the whole sequence of the
            # group's tokens, twice a layer, t-1 micro-batches beyond a GPU's own
            "layer_extra": 2 * (t - 1) * plan.micro_batch * plan.seq * plan.hidden
            * plan.compute_bytes,
            "network": (across if across_nodes else predicted["sent"])
            if plan.gpus > plan.per_node else 0.0}


def tp_theory(args, topo, model, replicated: int) -> dict:
    """comm MB/step and the busiest rank's state MB, tp_bytes from the shapes: activations in
    the compute dtype, the replicated gradients in fp32; the blocks sliced by heads (the
    Llama's by KV groups: k, v for its KV heads, q, o for their query heads; no biases) and by
    hidden units (the Llama's SwiGLU: three matrices), the most any rank gets."""
    n, size = topo.world_size, common.SIZES[args.size]
    d, head_dim = size.d_model, size.d_model // size.n_heads
    if args.model == "llama":
        kv_heads = -(-size.n_kv_heads // n)
        heads, units = kv_heads * size.n_heads // size.n_kv_heads, -(-common.llama_ffn_dim(d) // n)
        per_block = (2 * heads + 2 * kv_heads) * head_dim * d + 3 * units * d
    else:
        heads, units = -(-size.n_heads // n), -(-4 * d // n)
        per_block = 3 * heads * head_dim * (d + 1) + d * heads * head_dim + units * (2 * d + 1)
    kept = replicated + len(model.blocks) * per_block
    predicted = tp_bytes(kept, replicated, len(model.blocks), args.seq_len * args.batch_size, d,
                         n, 2 if args.dtype == "bf16" else 4)
    return {"comm_mb": predicted["sent"] / 2**20, "state_mb": predicted["state"] / 2**20}


def main():
    run = tensor_parallel_setup(common.parser(__doc__),
                                lambda settings, topo: ProcessGroupCollectives())
    settings, topo, model = run.settings, run.topo, run.model
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, fused=True)

    def train_step(inputs, targets):
        run.grads.zero_()
        loss = model(inputs, targets)
        loss.backward()
        dist.all_reduce(run.grads[:run.replicated])  # the replicated parts, each rank's share
        opt.step()
        return loss.detach() * topo.world_size  # averaged over ranks: the whole batch's loss

    stats = common.timed_steps(train_step, run.batches, settings, topo, memory_of=(model, opt),
                               dp_world=1)
    common.record(settings, topo, stats, baseline=None, model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=run.params,
                  loss_tolerance=LOSS_TOLERANCE[settings.dtype], overlap=0.0,
                  theory=tp_theory(settings, topo, model, run.replicated))


# The planner's rows (report/planner.py reads this; the script never does): TP over every GPU,
# and over a node's with data parallelism across nodes.
PLANNED = [{"strategy": "TP", "place": 90, "figures": planned_tp},
           {"strategy": "TP x DP", "place": 100,
            "figures": functools.partial(planned_tp, across_nodes=True)}]


if __name__ == "__main__":
    common.run_main(main)
