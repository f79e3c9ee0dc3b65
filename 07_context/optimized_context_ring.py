"""Ring attention by hand: each rank holds a slice of every sequence; K and V travel the ring.

What it does: context parallelism. The cp ranks of a group each hold 2 of every sequence's 2 x cp
chunks, zigzag: rank r chunks r and 2cp-1-r, an early and a late one, so the causal work evens
out (`--balance none`: chunk r of cp, to see the imbalance). Attention is an autograd function:
forward passes the K/V blocks (the KV heads only) round the ring, the next block's isend/irecv
posted before this one's attention runs (`--no-overlap`: wait first), and merges block outputs
by their log-sum-exp; backward sends K/V round again, recomputes each block from the merged
log-sum-exp, and dK/dV travel with their K/V, home after the last step. Each rank's tokens take
their global positions (GPT's learned table, Llama's rotary); DDP averages over all ranks, or
with `--fsdp` FSDP2 shards the weights over dp x cp flattened (torchtitan's dp_shard_cp).
Why it helps: a rank holds T/cp of each sequence, so its activations shrink cp-fold and a
sequence cp times longer fits; fused block kernels keep no T x T scores, and the K/V exchange
runs under the block attention.
Run:        torchrun --nproc_per_node=2 07_context/optimized_context_ring.py --size small
            [--cp 2 --fsdp] [--balance none] [--no-overlap] [--model llama]
Look for:   `make context report`: peak MB per rank against baseline_context at the same global
            batch; losses within fp32 rounding; attention_balance (max/min of the ranks' block
            attention time) near 1 zigzag and near 2cp-1 with --balance none (theory: from the
            positions); ring_mb equal to its theory; --no-overlap slower over a slow link.
Theory:     activations of batch x T/cp tokens (baseline_context's formula); a rank sends, a
            layer and step, 2(cp-1) K/V blocks forward, then 2(cp-1) K/V and 2cp dK/dV blocks
            (fp32) in backward, a block batch x kv_heads x T/cp x head_dim values; plus DDP's
            2(N-1)/N x gradient bytes over all N ranks (--fsdp: FSDP's, state 16 x params / N).
            Unbalanced causal work: about 2cp-1 times the least loaded rank's; zigzag: equal.
"""

import itertools
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

if TYPE_CHECKING:  # the planner's numbers, for PLANNED's formulas (never imported when run)
    from report.plan_input import PlanInput

# Exact: the ring computes the same attention as one fused kernel over the whole sequence, its
# softmax sums regrouped by block (fp32 rounding), which training carries from step to step: 3e-5
# at cp 4 after 11 steps at `small` (5e-6 of the loss); 5e-5 is 1e-5 of a loss of 5. bf16 rounds
# each block's output to 8 bits.
LOSS_TOLERANCE = {"fp32": 5e-5, "bf16": 5e-2}
aten = torch.ops.aten

# Shapes in names: B batch, H query heads, G KV heads (H/G query heads share each), S this rank's
# tokens of a sequence (T/cp), D head_dim; R, C a block's query rows and key columns; 2: K and V.


def block_schedule(rank: int, source: int, cp: int, length: int, zigzag: bool):
    """Which of this rank's `length` query rows meet which of `source`'s key columns at a ring
    step, and whether causally: (rows, cols, causal), or None (nothing to compute). Zigzag, a
    rank's rows are its chunks r and 2cp-1-r (halves of `length`): an earlier source's first
    chunk is before both of them, its second after both; a later source's both chunks are after
    chunk r and before chunk 2cp-1-r. Unbalanced, an earlier source is wholly before, a later
    wholly after."""
    every, half = slice(0, length), slice(0, length // 2)
    if source == rank:
        return every, every, True
    if not zigzag:
        return (every, every, False) if source < rank else None
    if source < rank:
        return every, half, False
    return slice(length // 2, length), every, False


def repeat_kv(x_BGCD: torch.Tensor, heads: int) -> torch.Tensor:
    """KV head h serves query heads h*g..h*g+g-1 (HuggingFace's repeat_kv): the fused kernels
    take equal head counts, so each is repeated here, on this rank, after it travelled."""
    G = x_BGCD.shape[1]
    return x_BGCD if heads == G else x_BGCD.repeat_interleave(heads // G, dim=1)


def block_forward(q_BHRD, k_BGCD, v_BGCD, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and its rows' log-sum-exp (fp32), by PyTorch's fused kernels: no
    rows x cols score matrix is kept (CPU: flash; CUDA: flash in 16 bits, efficient in fp32)."""
    H, R = q_BHRD.shape[1:3]
    qkv = q_BHRD, repeat_kv(k_BGCD, H), repeat_kv(v_BGCD, H)
    if q_BHRD.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu(*qkv, 0.0, causal)
    if q_BHRD.dtype in (torch.float16, torch.bfloat16):
        out_BHRD, lse_BHR, *_ = aten._scaled_dot_product_flash_attention(*qkv, 0.0, causal)
        return out_BHRD, lse_BHR
    out_BHRD, lse_BHr, *_ = aten._scaled_dot_product_efficient_attention(*qkv, None, True, 0.0,
                                                                          causal)
    return out_BHRD, lse_BHr[..., :R]  # its log-sum-exp comes padded to 32 rows (r)


def block_backward(dout_BHRD, q_BHRD, k_BGCD, v_BGCD, out_BHRD, lse_BHR, causal: bool):
    """dQ, dK, dV of one block, recomputed from the merged (whole-row) `out` and `lse`; dK and dV
    summed back over each KV head's group of query heads."""
    (B, H, R, D), (G, C) = q_BHRD.shape, k_BGCD.shape[1:3]
    dout_qkv = dout_BHRD, q_BHRD, repeat_kv(k_BGCD, H), repeat_kv(v_BGCD, H)
    none = torch.empty(0, device=q_BHRD.device)  # no dropout: no seed, offset or varlen offsets
    if q_BHRD.device.type != "cuda":
        dq_BHRD, dk_BHCD, dv_BHCD = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *dout_qkv, out_BHRD, lse_BHR, 0.0, causal)
    elif q_BHRD.dtype in (torch.float16, torch.bfloat16):
        dq_BHRD, dk_BHCD, dv_BHCD = aten._scaled_dot_product_flash_attention_backward(
            *dout_qkv, out_BHRD, lse_BHR, None, None, R, C, 0.0, causal, none, none)
    else:
        lse_BHr = torch.nn.functional.pad(lse_BHR, (0, -R % 32))  # as the forward padded it
        dq_BHRD, dk_BHCD, dv_BHCD, _ = aten._scaled_dot_product_efficient_attention_backward(
            *dout_qkv, None, out_BHRD, lse_BHr, none, none, 0.0, [True, True, True, False], causal)
    return dq_BHRD, *(d_BHCD.view(B, G, H // G, C, D).sum(2) for d_BHCD in (dk_BHCD, dv_BHCD))


def merge(out_BHRD: torch.Tensor, lse_BHR: torch.Tensor, block_out_BHRD: torch.Tensor,
          block_lse_BHR: torch.Tensor) -> None:
    """Fold a block's softmax-weighted output into the rows' running one, in place: each side
    weighted by its share exp(lse_side - lse_both) of the rows' total exponent mass."""
    both_BHR = torch.logaddexp(lse_BHR, block_lse_BHR)
    out_BHRD.mul_((lse_BHR - both_BHR).exp_().unsqueeze(-1)).add_(
        block_out_BHRD * (block_lse_BHR - both_BHR).exp_().unsqueeze(-1))
    lse_BHR.copy_(both_BHR)


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


class RingAttention:
    """`attention(q, k, v)` over a context-parallel group: q (B, H, S, D) this rank's queries,
    k and v (B, G, S, D) its keys and values with the KV heads only (`takes_kv_heads`), laid out
    as `common.sequence_positions(T, rank, cp, zigzag)`. Any dtype the fused kernels take; K/V
    travel in it, dK/dV in fp32. In a HuggingFace model, `refuse_unsupported` and `no_mask`
    refuse in one line what transformers asks of it that it does not compute
    (07_context/README.md)."""

    takes_kv_heads = True  # LlamaAttention then hands over K and V unrepeated: fewer bytes sent
    # the block kernels, looked up on the instance: MeasuredRingAttention wraps them
    block_forward, block_backward = staticmethod(block_forward), staticmethod(block_backward)

    def __init__(self, group: dist.ProcessGroup | None = None, zigzag: bool = True,
                 overlap: bool = True):
        self.group = group if group is not None else dist.group.WORLD
        self.zigzag, self.overlap = zigzag, overlap

    def __call__(self, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor
                 ) -> torch.Tensor:
        return RingAttentionFunction.apply(q_BHSD, k_BGSD, v_BGSD, self)

    def refuse_unsupported(self, module, query: torch.Tensor, attention_mask, **kwargs) -> None:
        """A ValueError naming what transformers' call asks beyond causal attention
        (`unsupported_attention`), before any K/V travels."""
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

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Send `send` to the next rank of the ring, receive the previous rank's: the receive
        buffer and the requests (the sent tensor kept alive in them until they are waited)."""
        cp, rank = self.group.size(), self.group.rank()
        received = torch.empty_like(send)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=(rank + 1) % cp),
            dist.P2POp(dist.irecv, received, group=self.group, tag=tag,
                       group_peer=(rank - 1) % cp)])
        pending = [send, *works]
        if not self.overlap:
            wait(pending)
        return received, pending


def wait(pending: list) -> None:
    for work in pending[1:]:
        work.wait()
    pending.clear()


def ring_forward(q_BHSD, k_BGSD, v_BGSD, ring: RingAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and merged log-sum-exp of this rank's queries against every rank's keys."""
    cp, rank = ring.group.size(), ring.group.rank()
    kv_2BGSD = torch.stack([k_BGSD, v_BGSD])  # one message a step
    pending, out_BHSD, lse_BHS = [], None, None
    for step in range(cp):
        if step < cp - 1:  # post the next block's exchange before this block's attention
            incoming_2BGSD, pending = ring.exchange(kv_2BGSD, tag=0)
        block = block_schedule(rank, (rank - step) % cp, cp, q_BHSD.shape[2], ring.zigzag)
        if block:
            rows, cols, causal = block
            block_out_BHRD, block_lse_BHR = ring.block_forward(
                q_BHSD[:, :, rows], *kv_2BGSD[:, :, :, cols], causal)
            if out_BHSD is None:  # step 0: the rank's own block, every row
                out_BHSD, lse_BHS = block_out_BHRD.float(), block_lse_BHR.float()
            else:
                merge(out_BHSD[:, :, rows], lse_BHS[:, :, rows], block_out_BHRD.float(),
                      block_lse_BHR.float())
        if step < cp - 1:
            wait(pending)
            kv_2BGSD = incoming_2BGSD
    return out_BHSD.to(q_BHSD.dtype), lse_BHS


def ring_backward(dout_BHSD, q_BHSD, k_BGSD, v_BGSD, out_BHSD, lse_BHS, ring: RingAttention):
    """dQ, dK, dV: K/V go round as in forward (cp-1 sends); each block's dK/dV add into the
    accumulator that travels with its K/V, cp sends, the last one bringing this rank's home."""
    cp, rank = ring.group.size(), ring.group.rank()
    kv_2BGSD, dq_BHSD = torch.stack([k_BGSD, v_BGSD]), torch.zeros_like(q_BHSD, dtype=torch.float32)
    dkv_2BGSD, kv_pending, dkv_pending = torch.zeros_like(kv_2BGSD, dtype=torch.float32), [], []
    for step in range(cp):
        if step < cp - 1:
            next_kv_2BGSD, kv_pending = ring.exchange(kv_2BGSD, tag=1)
        block = block_schedule(rank, (rank - step) % cp, cp, q_BHSD.shape[2], ring.zigzag)
        if block:
            rows, cols, causal = block
            dq_BHRD, *dkv_BGCD = ring.block_backward(
                dout_BHSD[:, :, rows], q_BHSD[:, :, rows], *kv_2BGSD[:, :, :, cols],
                out_BHSD[:, :, rows], lse_BHS[:, :, rows].contiguous(), causal)
        wait(dkv_pending)  # this K/V's accumulator, from the previous rank, under this block
        if block:
            dq_BHSD[:, :, rows] += dq_BHRD
            dkv_2BGSD[:, :, :, cols] += torch.stack(dkv_BGCD)
        if cp > 1:
            dkv_2BGSD, dkv_pending = ring.exchange(dkv_2BGSD, tag=2)
        if step < cp - 1:
            wait(kv_pending)
            kv_2BGSD = next_kv_2BGSD
    wait(dkv_pending)
    return dq_BHSD.to(q_BHSD.dtype), dkv_2BGSD[0].to(k_BGSD.dtype), dkv_2BGSD[1].to(v_BGSD.dtype)


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BGSD, v_BGSD, ring: RingAttention):
        out_BHSD, lse_BHS = ring_forward(q_BHSD, k_BGSD, v_BGSD, ring)
        ctx.save_for_backward(q_BHSD, k_BGSD, v_BGSD, out_BHSD, lse_BHS)
        ctx.ring = ring
        return out_BHSD

    @staticmethod
    def backward(ctx, dout_BHSD):
        return *ring_backward(dout_BHSD.contiguous(), *ctx.saved_tensors, ctx.ring), None


def shard_over_dp_and_cp(model: torch.nn.Module, blocks: list[torch.nn.Module], mesh):
    """FSDP2 over every rank of the (dp, cp) mesh, flattened into one dim (torchtitan's
    dp_shard_cp): the cp ranks of a group hold the same weights, so they shard them as data-
    parallel ranks do; each block, then the root. Every rank built the same seeded model."""
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    for block in blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)


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


# Copied from 03_fsdp/optimized_fsdp.py: padded_numel
def padded_numel(p: torch.Tensor, group: int) -> int:
    """Elements FSDP allocates for `p` across a shard group: dim 0 rounded up to the group."""
    return math.ceil(p.shape[0] / group) * group * math.prod(p.shape[1:])


def recorded_settings(settings, cp: int):
    """The run's settings as its record states them: the batch as a rank's share, 1/cp of each
    of its group's sequences (the baseline's batch at the defaults), so that the report holds the
    run to the baseline at the same global batch and tokens."""
    share = settings.batch_size / cp
    return common.resolved(settings, batch_size=int(share) if share.is_integer() else share)


# --- Measuring: outside the algorithm ------------------------------------------------------------
class MeasuredRingAttention(RingAttention):
    """RingAttention whose block kernels add up their wall time (CPU kernels return when done)
    and the q-k pairs the forward ones compute, x batch x heads, since `reset()`."""

    kernel_s, pairs = 0.0, 0

    def reset(self) -> None:
        self.kernel_s, self.pairs = 0.0, 0

    def block_forward(self, q_BHRD, k_BGCD, v_BGCD, causal: bool):
        B, H, R, _ = q_BHRD.shape
        self.pairs += B * H * block_pairs(R, k_BGCD.shape[2], causal)
        return self.timed(block_forward, q_BHRD, k_BGCD, v_BGCD, causal)

    def block_backward(self, *tensors_and_causal):
        return self.timed(block_backward, *tensors_and_causal)

    def timed(self, kernel, *args):
        start = time.perf_counter()
        result = kernel(*args)
        self.kernel_s += time.perf_counter() - start
        return result

    def figures(self, steps: int, head_dim: int, cpu: bool) -> dict[str, float | None]:
        """The record's attention_balance, max/min of the cp ranks' kernel seconds (None on
        CUDA: its kernels return before they finish), and attention_gflop, the busiest rank's
        pairs a step at 4 x head_dim FLOPs each."""
        ranks = [None] * self.group.size()
        dist.all_gather_object(ranks, (self.kernel_s if cpu else None, self.pairs / steps),
                               group=self.group)
        seconds = [s for s, _ in ranks]
        return {"attention_balance": None if None in seconds else max(seconds) / min(seconds),
                "attention_gflop": 4 * head_dim * max(p for _, p in ranks) / 1e9}


def block_pairs(rows: int, cols: int, causal: bool) -> int:
    """Query-key pairs a block computes (a causal block: its lower triangle and diagonal)."""
    return rows * (rows + 1) // 2 if causal else rows * cols


# --- Theory: what the run predicts from its shapes -----------------------------------------------
def ring_bytes(batch: int, seq_len: int, kv_heads: int, head_dim: int, cp: int, layers: int,
               value_bytes: int, grad_bytes: int = 4) -> float:
    """Bytes a rank sends round the ring a step: per layer, K and V (cp-1) times forward and
    again in backward, dK and dV cp times; a block is batch x kv_heads x T/cp x head_dim."""
    block = batch * kv_heads * seq_len // cp * head_dim
    per_layer = 2 * block * (2 * (cp - 1) * value_bytes + cp * grad_bytes) if cp > 1 else 0
    return layers * per_layer


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


# Copied from 03_fsdp/optimized_fsdp.py: fsdp_bytes
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


def planned_fsdp_cp(plan: "PlanInput") -> dict:
    """The planner's FSDP x CP row (this script's --fsdp): FSDP over every GPU, each cp group's
    sequences cut across its cp GPUs of one node (the ring stays on NVLink); a group computes a
    micro-batch, a GPU 1/cp of it; K and V of `plan.kv_width` a token. FSDP without a
    param_dtype: it gathers fp32 weights, and autocast casts them, keeping each layer's copy."""
    w, g, o = plan.state_bytes
    final_norm = plan.norms / (2 * plan.layers + 1)  # the root holds it: a layer holds two
    root = plan.embedding + plan.head + final_norm
    predicted = fsdp_bytes(plan.params - root, root, plan.gpus, 1, True, w, g, w + g + o,
                           largest_block=(plan.params - root) / plan.layers)
    ring = ring_bytes(plan.micro_batch, plan.seq, 1, plan.kv_width or plan.hidden, plan.cp,
                      plan.layers, plan.compute_bytes)
    return {"state": predicted["state"], "sent": predicted["sent"] + ring,
            "gathered": predicted["gathered"], "cp": plan.cp,
            "cast": plan.cast(plan.params - plan.embedding), "fp32_residual": True,
            "sequences": plan.gpus // plan.cp * plan.micro_batch,
            "by_dim": {"cp": ring, "dp": predicted["sent"]},
            "mesh": f"dp {plan.gpus // plan.cp} x cp {plan.cp}",
            "network": predicted["sent"] if plan.gpus > plan.per_node else 0.0}


def data_parallel_theory(model: torch.nn.Module, blocks: list[torch.nn.Module], world: int,
                         fsdp: bool) -> dict[str, float]:
    """Bytes the dp x cp ranks hand the weights' collectives a step, and the state a rank keeps:
    DDP's all-reduce of every gradient, or FSDP2's fsdp_bytes (blocks gathered twice, the root
    once, every gradient reduce-scattered) over all the ranks."""
    if not fsdp:
        values = sum(p.numel() for p in model.parameters())
        return {"comm": common.ring_allreduce_mb(4 * values, world) * 2**20,
                "state": 16.0 * values}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    counts = {"blocks": 0, "root": 0}
    for p in model.parameters():
        counts["blocks" if id(p) in in_blocks else "root"] += padded_numel(p, world)
    predicted = fsdp_bytes(counts["blocks"], counts["root"], world)
    return {"comm": predicted["sent"], "state": predicted["state"]}


def theory(settings, positions: list[torch.Tensor], data_parallel: dict[str, float]) -> dict:
    """What the run predicts from its shapes: a rank's activations, the busiest rank's attention
    FLOPs and the balance over the cp ranks (from their positions), the bytes a rank sends (the
    ring's, and the weights' collectives: `data_parallel_theory`) and its state."""
    size, cp = common.SIZES[settings.size], len(positions)
    tokens = settings.batch_size * settings.seq_len // cp
    flops = [settings.batch_size * size.n_layers * attention_flops(p, size.d_model)
             for p in positions]
    # the Llama's grouped-query attention, in the MoE Llama too
    kv_heads = size.n_kv_heads if settings.model in ("llama", "moe") else size.n_heads
    ring = ring_bytes(settings.batch_size, settings.seq_len, kv_heads, size.d_model //
                      size.n_heads, cp, size.n_layers, 2 if settings.dtype == "bf16" else 4) / 2**20
    return {"activations_mb": activation_mb(settings, tokens),
            "attention_gflop": max(flops) / 1e9, "attention_balance": max(flops) / min(flops),
            # what the step waits for: the busiest rank's attention over an even share
            "attention_busiest": max(flops) * cp / sum(flops),
            "ring_mb": ring, "comm_mb": data_parallel["comm"] / 2**20 + ring,
            "state_mb": data_parallel["state"] / 2**20}


def main():
    parser = common.parser(__doc__, long_context=True, skips={
        "resnet": "a ResNet has no sequence to split: context parallelism runs --model gpt or "
                  "llama"})
    parser.add_argument("--cp", type=common.int_at_least(1), default=None,
                        help="context-parallel ranks a sequence is split over (default: all; "
                             "the world is then dp = world/cp groups of them)")
    parser.add_argument("--balance", choices=["zigzag", "none"], default="zigzag",
                        help="zigzag: rank r holds chunks r and 2cp-1-r of 2cp (even causal "
                             "work); none: chunk r of cp (the late ranks do most)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="wait for each K/V exchange before computing the block")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the weights with FSDP2 over all dp x cp ranks instead of "
                             "replicating them with DDP")
    parser.set_defaults(steps=8, warmup=3)  # the folder's: `make context` launches 16 runs
    parser.set_defaults(batch_size=0)  # 0: the baseline's global batch (see settings)
    args = parser.parse_args()
    world = common.launch_world_size()
    cp, zigzag = args.cp or world, args.balance == "zigzag"
    if world % cp:  # the host's world, not the flag, is short or odd: the row says why
        raise common.Skip(f"--cp {cp} groups need a world of a multiple of {cp} ranks, this one "
                          f"has {world}: launch --nproc_per_node={cp * max(1, world // cp)}")
    try:
        common.sequence_positions(args.seq_len, 0, cp, zigzag)
    except ValueError as err:
        parser.error(f"{err} (--cp {cp})")
    # a dp group of cp ranks takes cp x the baseline's sequences a rank: the same global batch
    size = common.SIZES[args.size]
    settings = common.resolved(args, batch_size=args.batch_size or size.long_batch_size * cp)
    topo = common.setup(args)
    mesh = init_device_mesh(topo.device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    group = mesh.get_group("cp")
    attention = MeasuredRingAttention(group, zigzag=zigzag, overlap=not args.no_overlap)
    with common.real_tensors():  # the theory reads them on the host
        positions = [common.sequence_positions(args.seq_len, r, cp, zigzag) for r in range(cp)]
    mine = positions[group.rank()].to(topo.device)
    model, batches = common.workload(settings, topo, attention=attention,
                                     dp_rank=mesh.get_local_rank("dp"), dp_world=world // cp,
                                     positions=positions[group.rank()])
    blocks = common.transformer_blocks(model)
    if args.fsdp:
        shard_over_dp_and_cp(model, blocks, mesh)
    else:
        model = wrap_ddp(model, topo, block_gradient_mb(blocks[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = itertools.count()

    def train_step(inputs, targets):
        if next(steps) == args.warmup:  # count the block kernels over the timed steps
            attention.reset()
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets, mine)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(model, opt),
                               dp_world=world // cp)
    unwrapped = model if args.fsdp else model.module
    ring_mb = sum(mb for kind, mb in stats.comm_mb_by_kind.items() if kind.startswith("send"))
    with common.real_tensors():  # the positions' attention FLOPs, read on the host
        predicted = theory(settings, positions,
                           data_parallel_theory(unwrapped, blocks, world, args.fsdp))
    common.record(recorded_settings(settings, cp), topo, stats,
                  overlapped={**common.DDP_OVERLAP, **common.FSDP_OVERLAP},
                  baseline="baseline_context", model=unwrapped, optimizer=opt,
                  comm_mb=stats.comm_mb, loss_tolerance=LOSS_TOLERANCE[args.dtype], cp=cp,
                  balance=args.balance, overlap=not args.no_overlap,
                  strategy="FSDP x CP" if args.fsdp else "DDP x CP", ring_mb=ring_mb,
                  **attention.figures(args.steps, size.d_model // size.n_heads,
                                      cpu=topo.device.type == "cpu"),
                  theory=predicted)


# The planner's row (report/planner.py reads this; the script never does).
PLANNED = [{"strategy": "FSDP x CP", "place": 115, "figures": planned_fsdp_cp,
            "context_parallel": True}]


if __name__ == "__main__":
    common.run_main(main)
