"""DeepSpeed-Ulysses context parallelism: all-to-all from sequence shards to head shards and back.

What it does: the ranks of a cp group each hold a contiguous 1/cp of every sequence (embeddings,
MLP, norms and the loss run on that chunk alone). Before attention one all-to-all each for q, k
and v turns (batch, heads, T/cp, head_dim) into (batch, heads/cp, T, head_dim): every rank then
holds whole sequences for its own heads, runs ordinary causal SDPA on them, and one all-to-all
turns the output back into sequence chunks. A Llama sends only its KV heads (GQA): query heads
r x H/cp.. meet KV heads r x KVH/cp.. on rank r, as HF's repeat_kv pairs them. Backward is the
same all-to-alls reversed. DDP averages the gradients over the whole world (dp x cp).
Why it helps: a rank holds T/cp tokens of each sequence, so sequences cp times longer than one
rank could hold train; the attention itself is unchanged (any kernel, exact, no ring merging),
and a rank sends less than its own q, k, v and output each way, whatever cp. Heads (and KV
heads) must divide by cp.
Run:        torchrun --nproc_per_node=2 07_context/optimized_context_ulysses.py --size small
            [--model llama] [--cp 2]   (4 processes with --cp 2: dp 2 x cp 2)
Look for:   `make context report`: the same losses as baseline_context (fp32: to rounding) at
            the same global batch; comm MB with ulysses_mb beside its theory.
Theory:     a rank sends per layer 4 all-to-alls forward (q, k, v in, the output back) and 4
            backward, each (cp-1)/cp of its tensor: 2 x 2 x (cp-1)/cp x tokens x head_dim x
            (heads + KV heads) x value bytes a layer, tokens = this rank's (batch x T/cp); plus
            DDP's 2(N-1)/N x gradient bytes. Activations and attention FLOPs: baseline_context's
            formulas at this rank's share (T/cp tokens; heads/cp over all T).
"""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Exact: every rank computes the baseline's attention for its heads over the whole sequence; only
# the mean loss and DDP's sums group the same numbers differently (fp32: within 1e-6 at tiny on
# 2 and 4 ranks). Under bf16 autocast such last-bit differences grow by bf16's resolution.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# No planner row yet: the planner plans parameter state, and Ulysses moves activations.
PLANNED = []
# Shapes in names: B batch, H query heads, G KV heads, h = H/cp and g = G/cp a rank's share of
# them, T the whole sequence, S = T/cp a rank's chunk of it, D head_dim.


class AllToAll(torch.autograd.Function):
    """all_to_all_single of equal chunks along dim 0 (chunk j to rank j, chunk i from rank i), as
    an autograd op. Such an exchange is its own inverse, so backward sends the gradient back the
    same way. Through c10d's all_to_all_single, which `common.CollectiveBytes` counts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x cut into cp equal chunks along `scatter_dim`, chunk j sent to rank j of `group`; what
    arrives is joined along `gather_dim` in rank order (rank i's chunk i-th)."""
    cp = dist.get_world_size(group)
    received = AllToAll.apply(torch.stack(x.chunk(cp, dim=scatter_dim)), group)
    return torch.cat(received.unbind(0), dim=gather_dim)


# Copied from 07_context/optimized_context_ring.py: unsupported_attention
def unsupported_attention(module, query: torch.Tensor, attention_mask, cp: int,
                          **kwargs) -> str | None:
    """What a transformers attention call (`fn(module, query, key, value, attention_mask,
    **kwargs)`, query (B, heads, T/cp, D)) asks that plain causal attention over the whole
    sequence, softmax(q k^T / sqrt(D)) v, does not compute, in one line naming it and what to
    change (None: nothing). A sliding window at least the sequence long masks nothing (Mistral's
    4096 on shorter sequences): accepted. Any other argument set to more than None or False is
    refused by name: a feature of a later model is never ignored."""
    length, head_dim = query.shape[2] * cp, query.shape[-1]
    scaling, window = kwargs.pop("scaling", None), kwargs.pop("sliding_window", None)
    dropout, softcap = kwargs.pop("dropout", 0.0), kwargs.pop("softcap", None)
    if attention_mask is not None:
        return ("attention_mask: this causal attention takes no mask (padding, documents): "
                "fill every sequence to its full length and pass none")
    if not kwargs.pop("is_causal", getattr(module, "is_causal", True)):
        return f"is_causal False ({type(module).__name__}): this attention is causal only"
    if window is not None and window < length:
        return (f"sliding_window {window} is shorter than the {length}-token sequence: this "
                f"attention sees every earlier token; set sliding_window=None in the config")
    if softcap is not None:
        return (f"softcap {softcap} (attn_logit_softcapping): this attention does not cap its "
                f"logits")
    if scaling is not None and not math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-6):
        return (f"scaling {scaling:g} is not 1/sqrt(head_dim) = {head_dim ** -0.5:g}, the only "
                f"one this attention computes")
    if dropout:
        return f"dropout {dropout:g} (attention_dropout): set attention_dropout=0 in the config"
    bookkeeping = {"position_ids", "cache_position", "use_cache"}  # ask nothing of the arithmetic
    for name, value in kwargs.items():
        if name not in bookkeeping and value is not None and value is not False:
            return f"{name}: an attention argument this attention does not compute"
    return None


class UlyssesAttention:
    """Causal attention over sequences cut into contiguous chunks across `group` (rank r holding
    chunk r): q, k, v (batch, heads, T/cp, head_dim) in, the output in the same layout out. k and
    v may have fewer heads than q (GQA): only those travel, and `attention` (default SDPA, which
    groups them itself) sees each rank's query heads with the KV heads they share. In a
    HuggingFace model, `refuse_unsupported` and `no_mask` refuse in one line what transformers
    asks of it that it does not compute (07_context/README.md)."""

    takes_kv_heads = True  # the model hands over K and V unrepeated
    zigzag = False  # contiguous chunks: common.sequence_positions(T, rank, cp, zigzag=False)

    def __init__(self, group: dist.ProcessGroup | None = None, attention=common.causal_sdpa):
        self.group, self.attention = group, attention

    def refuse_unsupported(self, module, query: torch.Tensor, attention_mask, **kwargs) -> None:
        """A ValueError naming what transformers' call asks beyond causal attention
        (`unsupported_attention`), before anything is sent."""
        if problem := unsupported_attention(module, query, attention_mask,
                                            dist.get_world_size(self.group), **kwargs):
            raise ValueError(f"{type(self).__name__}: {problem}")

    def no_mask(self, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
        """transformers' mask builder for this attention (`AttentionMaskInterface`): no mask,
        causal by itself. A padding mask given to the model (a 0 in its 2-D `attention_mask`) is
        refused, not dropped as transformers drops it for an attention with no mask builder; by
        every rank of the group alike (one all-reduce), though the padding be in one's shard."""
        if attention_mask is not None:
            padded = (attention_mask == 0).any().float()
            dist.all_reduce(padded, group=self.group)
            if padded.item():
                raise ValueError("attention_mask with padding: context-parallel attention takes "
                                 "no mask; fill every sequence to its full length")

    def __call__(self, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor
                 ) -> torch.Tensor:
        cp = dist.get_world_size(self.group)
        H, G = q_BHSD.shape[1], k_BGSD.shape[1]
        if H % cp or G % cp:  # the model's own shapes, not a flag's
            raise ValueError(f"UlyssesAttention: cp {cp} does not divide the {H} attention heads "
                             f"and {G} KV heads: each rank takes whole heads, use a cp group "
                             f"that divides both")
        # sequence-sharded -> head-sharded: send heads, gather the sequence
        q_BhTD, k_BgTD, v_BgTD = (all_to_all(x_BHSD, scatter_dim=1, gather_dim=2, group=self.group)
                                  for x_BHSD in (q_BHSD, k_BGSD, v_BGSD))
        out_BThD = self.attention(q_BhTD, k_BgTD, v_BgTD).transpose(1, 2)
        # head-sharded -> sequence-sharded, joined as (B, S, H, D): the layout the model's output
        # projection reads without another copy
        out_BSHD = all_to_all(out_BThD, scatter_dim=1, gather_dim=2, group=self.group)
        return out_BSHD.transpose(1, 2)


def cp_problem(cp: int, world: int, heads: int, kv_heads: int, seq_len: int) -> str | None:
    """Why cp ranks of a world cannot share sequences of `seq_len` tokens, `heads` query and
    `kv_heads` KV heads the Ulysses way (None: they can)."""
    if world % cp:
        return f"--cp {cp} does not divide the world size {world}: use a divisor of it"
    if heads % cp or kv_heads % cp:
        return (f"--cp {cp} does not divide the {heads} attention heads and {kv_heads} KV "
                f"heads: Ulysses gives each rank whole heads, use a --cp that divides both")
    if seq_len % cp:
        return (f"--seq-len {seq_len} does not cut into {cp} equal chunks, one a rank of --cp "
                f"{cp}: use a multiple of {cp}")
    return None


def default_cp(world: int, heads: int, kv_heads: int, seq_len: int) -> int:
    """The world, or where it cannot be cp (6 ranks, 8 heads), its largest divisor that can."""
    return max(cp for cp in range(1, world + 1)
               if cp_problem(cp, world, heads, kv_heads, seq_len) is None)


def kv_heads(model: str, size: common.Size) -> int:
    """The heads K and V have: a Llama's KV heads (GQA; the MoE Llama's too), else one for each
    query head."""
    return size.n_kv_heads if model in ("llama", "moe") else size.n_heads


# Copied from 01_ddp/baseline_ddp_flash.py: wrap_ddp
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """DDP for long context. With O(T) attention activations the gradients are a large share of
    the peak, so each .grad is a view into its bucket (one gradient-sized copy less); buckets of
    one block's gradients let a block's all-reduce start as soon as its backward ends and run
    under the next block's. Over the ranks of `group` (None: the world), from its first rank's
    weights."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)


# Copied from 07_context/optimized_context_ring.py: recorded_settings
def recorded_settings(settings, cp: int):
    """The run's settings as its record states them: the batch as a rank's share, 1/cp of each
    of its group's sequences (the baseline's batch at the defaults), so that the report holds the
    run to the baseline at the same global batch and tokens."""
    share = settings.batch_size / cp
    return common.resolved(settings, batch_size=int(share) if share.is_integer() else share)


# --- Theory: what the run predicts from its shapes -----------------------------------------------
def ulysses_bytes(layers: int, tokens: int, heads: int, kv_heads: int, head_dim: int, cp: int,
                  value_bytes: int) -> float:
    """Bytes a rank sends a step in Ulysses' all-to-alls, `tokens` its own (batch x T/cp): per
    layer q and the output (heads each) and k, v (kv_heads each), forward and backward, each
    all-to-all keeping 1/cp of its tensor at home."""
    values = tokens * head_dim * (2 * heads + 2 * kv_heads)
    return layers * 2 * (cp - 1) / cp * values * value_bytes


# Copied from 03_fsdp/optimized_fsdp_fp8.py: activation_bytes
def activation_bytes(layers: int, tokens: float, hidden: int, heads: int, value_bytes: float,
                     checkpointing: bool, ffn: int | None = None) -> float:
    """Bytes `layers` blocks save for backward over `tokens` tokens, `value_bytes` a value (see
    Theory above; Korthikanti et al. 2022's 34 bytes a token and hidden unit in 16-bit, with
    flash attention: no seq x seq scores). A token: a GPT block's 17 x `hidden` values, or,
    `ffn` given (a Llama's SwiGLU width), a Llama layer's 9 x `hidden`, 4 x `ffn` and each of
    its two RMSNorms' scale for the token; either, a log-sum-exp for each of its `heads`.
    Checkpointed: each block's input, and while one recomputes, that block's."""
    per_token = 9 * hidden + 4 * ffn + 2 + heads if ffn else 17 * hidden + heads
    per_block = tokens * per_token
    saved = layers * tokens * hidden + per_block if checkpointing else layers * per_block
    return saved * value_bytes


# Copied from 07_context/baseline_context.py: activation_mb
def activation_mb(args, tokens: int) -> float:
    """MB a rank saves for backward over `tokens` tokens of its own: the blocks'
    (activation_bytes) and the loss's fp32 logits, kept by cross-entropy for backward."""
    size = common.SIZES[args.size]
    # the MoE Llama's MLP saves a token's rows for its top_k experts, each expert's SwiGLU (4 x
    # expert_ffn), their outputs and the shared expert's SwiGLU: a Llama MLP of that width
    ffn = (common.llama_ffn_dim(size.d_model) if args.model == "llama" else
           size.top_k * (size.d_model + 2 * size.expert_ffn) // 2 + size.shared_expert_ffn
           if args.model == "moe" else None)
    value_bytes = 2 if args.dtype == "bf16" else 4
    blocks = activation_bytes(size.n_layers, tokens, size.d_model, size.n_heads, value_bytes,
                              False, ffn)
    return (blocks + tokens * size.vocab_size * 4) / 2**20


# Copied from 07_context/baseline_context.py: attention_flops
def attention_flops(positions: torch.Tensor, d_model: int) -> float:
    """Forward FLOPs of causal attention for the queries at `positions` of one sequence: query p
    takes the dot products with, and the weighted sum of, the p + 1 keys at or before it, 2 x 2
    x d_model FLOPs a key. Where the queries sit decides the work: the late ones cost most."""
    return 4.0 * d_model * float((positions.double() + 1).sum())


# Copied from 01_ddp/baseline_ddp_flash.py: block_gradient_mb
def block_gradient_mb(block: torch.nn.Module) -> float:
    """One transformer block's gradient bytes: the bucket size that aligns buckets with blocks."""
    return sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20


def theory(settings, world: int, cp: int, grad_bytes: int) -> dict[str, float]:
    """The run's predicted figures, from its shapes: bytes sent (DDP's and Ulysses'), this rank's
    activations and attention GFLOP (whole sequences, heads/cp of the heads)."""
    size = common.SIZES[settings.size]
    tokens = settings.batch_size * settings.seq_len // cp  # this rank's
    ulysses = ulysses_bytes(size.n_layers, tokens, size.n_heads, kv_heads(settings.model, size),
                            size.d_model // size.n_heads, cp,
                            2 if settings.dtype == "bf16" else 4) / 2**20
    attention_gflop = settings.batch_size * size.n_layers * attention_flops(
        torch.arange(settings.seq_len), size.d_model) / cp / 1e9
    return {"activations_mb": activation_mb(settings, tokens), "attention_gflop": attention_gflop,
            "comm_mb": common.ring_allreduce_mb(grad_bytes, world) + ulysses,
            "ulysses_mb": ulysses}


def main():
    parser = common.parser(__doc__, long_context=True, skips={
        "resnet": "a ResNet has no sequence to split: context parallelism runs --model gpt or "
                  "llama"})
    parser.add_argument("--cp", type=common.int_at_least(1), default=None,
                        help="ranks that share each sequence: divides the world, the heads, the "
                             "KV heads and --seq-len (default: the world, or its largest "
                             "divisor that does)")
    parser.set_defaults(steps=8, warmup=3)  # the folder's: `make context` launches 16 runs
    parser.set_defaults(batch_size=0)  # default: the baseline's global batch (below)
    args = parser.parse_args()
    world = common.launch_world_size()
    size = common.SIZES[args.size]
    shape = (size.n_heads, kv_heads(args.model, size), args.seq_len)
    cp = args.cp or default_cp(world, *shape)
    if why := cp_problem(cp, world, *shape):
        parser.error(f"{why} (--size {args.size}, --model {args.model})")
    if cp == 1 and world > 1:
        raise common.Skip(f"no cp > 1 divides the world size {world}, the {shape[0]} heads, "
                          f"{shape[1]} KV heads and --seq-len {shape[2]}: launch another world")
    # a dp rank's cp ranks share its sequences: the baseline's global batch and tokens per rank
    settings = common.resolved(args, batch_size=args.batch_size or size.long_batch_size * cp)
    topo = common.setup(settings)
    mesh = init_device_mesh(topo.device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    # this rank's contiguous chunk of every sequence; the dp rank's sequences
    positions = common.sequence_positions(settings.seq_len, mesh.get_local_rank("cp"), cp,
                                          zigzag=False)
    attention = UlyssesAttention(mesh["cp"].get_group())
    model, batches = common.workload(settings, topo, attention=attention,
                                     dp_rank=mesh.get_local_rank("dp"), dp_world=world // cp,
                                     positions=positions)
    positions = positions.to(topo.device)
    model = wrap_ddp(model, topo, block_gradient_mb(common.transformer_blocks(model)[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets, positions)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(model, opt),
                               dp_world=world // cp)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ulysses_mb = sum(mb for kind, mb in stats.comm_mb_by_kind.items()
                     if kind.startswith("alltoall"))
    common.record(recorded_settings(settings, cp), topo, stats,
                  overlapped=common.DDP_OVERLAP,
                  baseline="baseline_context", model=model.module,
                  optimizer=opt, comm_mb=stats.comm_mb, cp=cp,
                  ulysses_mb=round(ulysses_mb, 3), loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  theory=theory(settings, world, cp, grad_bytes))


if __name__ == "__main__":
    common.run_main(main)
