"""Shared plumbing for every recipe, so that their comparisons are fair: the same model and data
order, the same clock, the same memory count. Techniques never live here; one recipe plus this
file is enough to run it. What reads results back (report, charts, planner) is the report/ package.

Sections, in reading order:
    Sizes and the workload   presets, the GPT and Llama decoders (the Llama's MLPs a Mixture of
                             Experts with --model moe), a ResNet, the parts a technique
                             is given (blocks, embedding, head), synthetic data split by rank
                             and, for context parallelism, by sequence chunks (zigzag or not)
    CLI                      the shared flags, one-line errors, a run's variant, --check-flags,
                             `resolved`: values derived for the host beside the parsed flags
    Topology                 torchrun, srun or a world of one: device, backend, process group
    Collectives              the renamed tensor collectives, gloo's reduce-scatter done right
    Bytes sent               the bytes handed to collectives, counted or from the ring formula
    Step work                what a step did (FLOPs, parameters stepped, collectives, what
                             overlaps), recorded for the report's step-time model to price
    Timing                   warm-up then timed steps, step statistics
    Memory                   a step's peak (allocator or live tensors), state from the tensors
    Tracing                  step ranges, NVTX, profiler traces
    Records and outcomes     one JSON line per run, rank 0's log, skipped and failed runs
                             (RunState: what a failure's record knows), a closed stdout
What serves one folder lives in that folder's scripts: ZeRO's --summary in 04_zero/, a pipeline's
timeline and world check in 05_pipeline/, the collective sweep and GPU peer access in 06_symmem/.
The decoders' `pipeline_stages`/`pipeline_layers` (and `cut_into_stages`) stay with the workload:
they are the model's own description of where it may be cut, which 05 and 06 both read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import faulthandler
import functools
import gc
import importlib.metadata
import inspect
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "outputs" / "results.jsonl"
DRY_RESULTS = ROOT / "outputs" / "dryrun.jsonl"  # a dry run's records, apart from measured ones
_IMPORTED_AT = time.perf_counter()  # a record's startup_s counts from here


# ==== Sizes and the workload ======================================================================
# The same model and data, in the same order, in every script.
@dataclass(frozen=True)
class Size:
    """A preset: `tiny` for tests, `small` the CPU default, `medium`/`large` the GPU defaults.
    The long_* fields are the attention recipes' shape, where the T x T scores dominate;
    n_kv_heads is the Llama's (grouped-query attention: n_heads / n_kv_heads queries a head)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seq_len: int
    batch_size: int  # per rank
    long_seq_len: int
    long_batch_size: int
    resnet: str
    image_size: int
    # --model moe (the Llama with each MLP a Mixture of Experts): routed experts, the experts a
    # token is routed to, an expert's SwiGLU width, the shared expert's (0: none)
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_expert_ffn: int
    # A published model's shape (PUBLISHED_SIZES): its MLP's and its heads' widths where they
    # are not the rule's (0: llama_ffn_dim, d_model / n_heads), its family, where it was read
    ffn_dim: int = 0
    head_dim: int = 0
    family: str | None = None
    source: str | None = None

    @property
    def llama_ffn(self) -> int:
        """The Llama's SwiGLU width: the published one, or llama_ffn_dim's rule."""
        return self.ffn_dim or llama_ffn_dim(self.d_model)

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


def published(source: str, family: str, vocab: int, d_model: int, layers: int, heads: int,
              kv_heads: int, ffn: int, seq_len: int, head_dim: int = 0, experts: int = 0,
              top_k: int = 0, expert_ffn: int = 0) -> Size:
    """A published decoder's shape as a Size: one sequence of its training length a rank, four
    times that for the long-context recipes; no CNN."""
    return Size(vocab, d_model, layers, heads, kv_heads, seq_len, 1, 4 * seq_len, 1, "", 0,
                experts, top_k, expert_ffn, 0, ffn, head_dim, family, source)


SIZES = {
    "tiny": Size(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32,
                 batch_size=4, long_seq_len=128, long_batch_size=2, resnet="resnet18",
                 image_size=16, n_experts=4, top_k=2, expert_ffn=64, shared_expert_ffn=64),
    "small": Size(vocab_size=1024, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, seq_len=128,
                  batch_size=4, long_seq_len=768, long_batch_size=1, resnet="resnet18",
                  image_size=32, n_experts=16, top_k=2, expert_ffn=512, shared_expert_ffn=0),
    "medium": Size(vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                   seq_len=1024, batch_size=8, long_seq_len=4096, long_batch_size=2,
                   resnet="resnet50", image_size=128, n_experts=32, top_k=4, expert_ffn=512,
                   shared_expert_ffn=1024),
    "large": Size(vocab_size=32768, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8,
                  seq_len=1024, batch_size=4, long_seq_len=4096, long_batch_size=1,
                  resnet="resnet101", image_size=224, n_experts=8, top_k=2, expert_ffn=1408,
                  shared_expert_ffn=1408),
}
# Published shapes, from each model's config.json on Hugging Face (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, its training length):
# for dry runs at their real size, and on GPUs where they fit. Qwen3's q/k RMSNorms (2 x 128
# weights a layer) are left out.
PUBLISHED_SIZES = {
    "llama2-7b": published("meta-llama/Llama-2-7b-hf", "llama", 32000, 4096, 32, 32, 32,
                           11008, 4096),
    "llama2-70b": published("meta-llama/Llama-2-70b-hf", "llama", 32000, 8192, 80, 64, 8,
                            28672, 4096),
    "llama3-8b": published("meta-llama/Meta-Llama-3-8B", "llama", 128256, 4096, 32, 32, 8,
                           14336, 8192),
    "llama3-70b": published("meta-llama/Meta-Llama-3-70B", "llama", 128256, 8192, 80, 64, 8,
                            28672, 8192),
    "llama3-405b": published("meta-llama/Llama-3.1-405B", "llama", 128256, 16384, 126, 128, 8,
                             53248, 8192),
    "qwen3-30b-a3b": published("Qwen/Qwen3-30B-A3B", "moe", 151936, 2048, 48, 32, 4, 6144,
                               4096, head_dim=128, experts=128, top_k=8, expert_ffn=768),
}
SIZES.update(PUBLISHED_SIZES)
MODELS = ("gpt", "llama", "moe", "resnet")  # the decoders (moe: the Llama with MoE MLPs), the CNN


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default attention: PyTorch's fused kernel, O(T) memory. Shapes (batch, heads, seq,
    head_dim). k and v may have fewer heads than q (grouped-query attention): KV head h serves
    query heads h*g..h*g+g-1, g = q's heads / k's, as HuggingFace's repeat_kv lays them out.
    On CPU, and on CUDA in bf16 or fp16 (the flash kernel), SDPA reads each KV head for its g
    query heads itself (`enable_gqa`), with no copy of K and V. In fp32 on CUDA flash does not
    run and the memory-efficient kernel takes no grouped heads: SDPA would fall back to its math
    kernel, which builds the T x T scores. There each KV head is repeated for its query heads
    instead (K and V copied g times over, still O(T)), which the memory-efficient kernel takes."""
    grouped = k.shape[1] != q.shape[1]
    # the dtype SDPA will run in: autocast's where it is on (it casts fp32 q, k, v down)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if grouped and q.is_cuda and dtype not in (torch.float16, torch.bfloat16):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        grouped = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: Callable):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: Callable):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class Embeddings(nn.Module):
    """Token plus position embeddings: a pipeline's first layer (wraps the GPT's own modules)."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1],
                                                                device=tokens.device))


class LossHead(nn.Module):
    """Final norm, head and mean cross-entropy: a pipeline's last layer (the model's own modules:
    the GPT's LayerNorm and tied head, the Llama's RMSNorm and lm_head)."""

    def __init__(self, ln_f: nn.Module, head: nn.Linear):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def matmul_weights(layer: nn.Module) -> float:
    """The weights of a layer's matrix multiplies that a token meets: every Linear's, a MoE's
    experts at top_k / n_experts of theirs (a token runs k of them)."""
    total = sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, nn.Linear))
    for moe in (mod for mod in layer.modules() if isinstance(mod, MoE)):
        experts = sum(p.numel() for p in moe.experts.parameters())
        total -= experts * (1 - moe.gate.top_k / len(moe.experts))
    return total


class Decoder(nn.Module):
    """What the two decoder families share: `forward(tokens, targets)` returns the mean loss, and
    `pipeline_layers()` lists the model's own modules in order, for a pipeline to cut."""

    def pipeline_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def pipeline_stages(self, n: int) -> list[list[nn.Module]]:
        """`pipeline_layers` cut into n stages of about equal compute: a layer costs the weights of
        its matrix multiplies a token meets (`matmul_weights`; lookups, norms and the attention's
        own product are small)."""
        layers = self.pipeline_layers()
        costs = [matmul_weights(layer) for layer in layers]
        return [[layers[i] for i in stage] for stage in cut_into_stages(costs, n)]


class GPT(Decoder):
    """Pre-norm decoder with a tied head. `forward(tokens, targets)` returns the mean loss."""

    def __init__(self, size: Size, seq_len: int, attention: Callable = causal_sdpa,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.tok_emb = nn.Embedding(size.vocab_size, size.d_model)
        self.pos_emb = nn.Embedding(seq_len, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.n_heads, attention)
                                    for _ in range(size.n_layers))
        self.ln_f = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 init: residual projections scaled down by depth so the stream stays O(1).
                std = 0.02 / (2 * size.n_layers) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: the tokens' places in their sequence, when they are a shard of it (context
        parallelism; the attention then sees the rest); default 0..T-1."""
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None \
                else positions
            x = self.tok_emb(tokens) + self.pos_emb(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def pipeline_layers(self) -> list[nn.Module]:
        """This model's own modules as the ordered layers a pipeline cuts into stages (run in
        order under its autocast they compute `forward`): the embeddings, each block, then norm,
        head and loss (`layers[-1](x, targets)`). Cut apart, the first and last stages each hold
        the tied weight, and a pipeline sums its two gradients every step (as Megatron-LM does)."""
        return [Embeddings(self.tok_emb, self.pos_emb), *self.blocks,
                LossHead(self.ln_f, self.head)]


def llama_ffn_dim(d_model: int) -> int:
    """SwiGLU's hidden width: 8/3 of d_model (the same weights as a 4x GELU MLP, in three
    matrices), rounded up to a multiple of 64 as Llama rounds to its own multiple."""
    return -(-8 * d_model // 3 // 64) * 64


def rotary_table(seq: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                 base: float, positions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq, head_dim): computed in fp32, in `dtype`, at
    positions 0..seq-1 or at `positions` (a sequence shard's own: the same rows, to the bit)."""
    freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    at = torch.arange(seq, device=device) if positions is None else positions
    angle = torch.outer(at.to(torch.float32), freq)
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


@functools.lru_cache(maxsize=32)
def cached_rotary_table(*key) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_table built once per key, for every layer and step (a Llama rotates q and k in
    each layer): outside inference_mode, whose tensors a later training forward could not save
    for backward; from no tensor that needs grad, so the constants carry no graph."""
    with torch.inference_mode(False):
        return rotary_table(*key)


def apply_rotary(x: torch.Tensor, base: float = 10_000.0,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of x (batch, heads, seq, head_dim), HuggingFace Llama's layout:
    the first and second halves of each head are the pairs rotated by position x frequency.
    From the shape alone (the table cached by length, head size, device, dtype and base), so a
    layer holds no table and a pipeline stage needs no positions; a sequence shard passes its
    tokens' global `positions` (context parallelism), and its table is built for them."""
    key = (x.shape[-2], x.shape[-1], x.device, x.dtype, float(base))
    # compiled code builds the table in its graph, where the compiler folds the constants (it
    # would trace past a cache, and warn)
    if positions is not None:
        cos, sin = rotary_table(*key, positions)
    else:
        cos, sin = (rotary_table if torch.compiler.is_compiling() else cached_rotary_table)(*key)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions and no biases. Head counts are read from the
    projections' widths, so a tensor-parallel shard (some of the heads) runs the same code."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, attention: Callable,
                 head_dim: int = 0):
        super().__init__()
        self.head_dim = head_dim or d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.attention = attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, positions=positions), apply_rotary(k, positions=positions)
        # SDPA groups the KV heads itself, uncopied, as does an attention that says it takes them
        # (context parallelism's, which sends only the KV heads to its peers)
        if self.attention is not causal_sdpa and not getattr(self.attention, "takes_kv_heads",
                                                             False):
            # each KV head serves n_heads / n_kv_heads query heads, next to each other (HF's
            # repeat_kv): an attention written for equal head counts gets each one repeated
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = self.attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


MOE_BALANCING = ("bias", "aux", "none")
AUX_LOSS_COEF = 0.01  # the classic auxiliary loss's weight (Switch Transformer's)


def expert_counts(top_k_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The routed slots each of `n_experts` experts got, counted where the index lives: no host
    sync on a GPU, where torch.bincount reads the largest index back to size its output."""
    flat = top_k_index.flatten()
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.long))


class TopKRouter(nn.Module):
    """A MoE layer's `gate`: each token's top_k experts and their weights. The top_k are chosen on
    logit + `expert_bias` (DeepSeek-V3's aux-loss-free balancing: the bias, no parameter, only
    chooses, and a trainer nudges it after each step toward equal load; on the logits a nudge is
    the same relative change of an expert's odds whatever the number of experts) and weighted by
    their softmax scores, renormalised to 1 (Qwen-MoE's norm_topk_prob). `tokens_per_expert`
    counts the tokens routed to each expert since a trainer last read it."""

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts, dtype=torch.long),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, d_model) -> weights (tokens, top_k) in x's dtype, experts (tokens, top_k),
        and the scores (tokens, n_experts, fp32) the auxiliary loss is computed from."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(dim=-1)
        experts = (logits.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        # counted in training, once a forward: not when activation checkpointing recomputes it
        # inside backward (torch names no public test for that; a graph task is running)
        if self.training and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(experts, self.weight.shape[0])
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts, scores


def auxiliary_balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The classic load-balancing loss (Switch Transformer, GShard): n_experts x the sum over
    experts of (share of routed slots) x (mean score); 1 when the load is even."""
    n = scores.shape[-1]
    share = expert_counts(experts, n).to(scores.dtype) / experts.numel()
    return n * (share * scores.mean(dim=0)).sum()


class _WithAuxiliaryLoss(torch.autograd.Function):
    """x unchanged forward; backward, also the gradient of `loss` (weight 1): the auxiliary loss
    trains the router through the layer's own output, in any schedule that runs backward from
    the model's loss (pipelines, checkpointing), without a second value to return. Its weight is
    1 whatever the loss was scaled by: a trainer that divides the loss (gradient accumulation, a
    pipeline's micro-batches, an fp16 loss scaler) scales AUX_LOSS_COEF alike."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


class Experts(nn.ModuleList):
    """A MoE layer's routed experts, `experts[i]` a SwiGLU MLP, called as HuggingFace calls its
    experts: (tokens, top_k_index, top_k_weights) -> each token's weighted sum of its experts'
    outputs. The routed slots (token, choice) are sorted by expert, so that each expert runs
    once on a contiguous block of rows; an expert with no rows still runs, on none, so its
    weights always get a gradient (zero), as data parallelism's hooks expect."""

    def forward(self, tokens: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        order = top_k_index.flatten().argsort(stable=True)
        token_of = order // top_k_index.shape[1]
        # the split sizes, read on the host: the layer's one sync on a GPU (a dry run has none)
        counts = even_routing(top_k_index.numel(), 1, len(self))[0] if dry_run() else \
            expert_counts(top_k_index, len(self)).tolist()
        rows = tokens[token_of].split(counts)
        routed = torch.cat([expert(part) for expert, part in zip(self, rows, strict=True)])
        weighted = routed * top_k_weights.flatten()[order, None]
        return torch.zeros_like(tokens).index_add_(0, token_of, weighted)


class MoE(nn.Module):
    """A Mixture-of-Experts MLP with HuggingFace's names (Qwen2-MoE, DeepSeek-V3): `gate` (the
    TopKRouter), `experts` (Experts: `experts[i]` SwiGLU MLPs), `shared_expert` (seen by every
    token, or None).
    Dropless: every token reaches its top_k experts, whatever their load. `balance`: "bias"
    (the router's bias, nudged by the trainer), "aux" (the auxiliary loss, weight
    AUX_LOSS_COEF) or "none"."""

    def __init__(self, size: Size, balance: str):
        super().__init__()
        if balance not in MOE_BALANCING:
            raise ValueError(f"balance {balance!r}: use one of {', '.join(MOE_BALANCING)}")
        self.balance = balance
        self.gate = TopKRouter(size.d_model, size.n_experts, size.top_k)
        self.experts = Experts(LlamaMLP(size.d_model, size.expert_ffn)
                               for _ in range(size.n_experts))
        self.shared_expert = (LlamaMLP(size.d_model, size.shared_expert_ffn)
                              if size.shared_expert_ffn else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts, scores = self.gate(tokens)
        out = self.experts(tokens, experts, weights)  # expert parallelism swaps this module
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.balance == "aux" and self.training:
            out = _WithAuxiliaryLoss.apply(
                out, AUX_LOSS_COEF * auxiliary_balance_loss(scores, experts))
        return out.view_as(x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, size: Size, attention: Callable, moe_balance: str | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(size.d_model, eps=1e-6)
        self.self_attn = LlamaAttention(size.d_model, size.n_heads, size.n_kv_heads, attention,
                                        size.attention_head_dim)
        self.post_attention_layernorm = nn.RMSNorm(size.d_model, eps=1e-6)
        self.mlp = (LlamaMLP(size.d_model, size.llama_ffn) if moe_balance is None
                    else MoE(size, moe_balance))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions passed only when given: a tensor-parallel plan's PrepareModuleInput, or a
        # module put in self_attn's place, takes the one input it was written for
        attn_args = () if positions is None else (positions,)
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder without its head, as HuggingFace's `LlamaModel`: tokens in, normed states out."""

    def __init__(self, size: Size, attention: Callable, moe_balance: str | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(size.vocab_size, size.d_model)
        self.layers = nn.ModuleList(LlamaDecoderLayer(size, attention, moe_balance)
                                    for _ in range(size.n_layers))
        self.norm = nn.RMSNorm(size.d_model, eps=1e-6)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x) if positions is None else layer(x, positions)  # as the layer's own call
        return self.norm(x)


class Llama(Decoder):
    """The shape users bring: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no
    biases, an untied `lm_head`, with HuggingFace's module names (`model.layers[i].self_attn
    .q_proj`, `mlp.gate_proj`, `model.embed_tokens`, `model.norm`, `lm_head`). The same
    `forward(tokens, targets)` contract as the GPT; any sequence length (no position table).
    `moe_balance` given ("bias", "aux" or "none"), each MLP is a `MoE` balanced that way."""

    def __init__(self, size: Size, attention: Callable = causal_sdpa,
                 autocast_dtype: torch.dtype | None = None, moe_balance: str | None = None):
        super().__init__()
        if (size.d_model % size.n_heads and not size.head_dim) or size.n_heads % size.n_kv_heads:
            raise ValueError(f"{size.n_heads} heads of d_model {size.d_model} in "
                             f"{size.n_kv_heads} KV groups do not divide evenly")
        self.autocast_dtype = autocast_dtype
        self.model = LlamaModel(size, attention, moe_balance)
        self.lm_head = nn.Linear(size.d_model, size.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:  # HuggingFace's initializer_range; RMSNorm weights stay 1
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` as `GPT.forward`'s: the rotary angles of a sequence shard's own tokens."""
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            logits = self.lm_head(self.model(tokens, positions))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def pipeline_layers(self) -> list[nn.Module]:
        """The embedding, each decoder layer, then norm, head and loss (`layers[-1](x, targets)`),
        as `GPT.pipeline_layers`; the head is untied, so no weight lives on two stages."""
        return [self.model.embed_tokens, *self.model.layers,
                LossHead(self.model.norm, self.lm_head)]


def cut_into_stages(costs: list[int], stages: int) -> list[range]:
    """Contiguous stages of at least one layer: stage s ends where the running cost comes nearest
    to s/stages of the total (equal layer counts would not balance: the embeddings cost nothing)."""
    running, bounds = list(itertools.accumulate(costs)), [0]
    for s in range(1, stages):
        ends = range(bounds[-1] + 1, len(costs) - (stages - s) + 1)
        bounds.append(min(ends, key=lambda end: abs(running[end - 1] - s * running[-1] / stages)))
    return [range(a, b) for a, b in zip(bounds, [*bounds[1:], len(costs)], strict=True)]


class Classifier(nn.Module):
    """A torchvision ResNet whose `forward(images, labels)` returns the mean loss."""

    def __init__(self, name: str, num_classes: int, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        import torchvision  # imported here: only the ResNet workload needs it

        self.net = getattr(torchvision.models, name)(num_classes=num_classes)
        self.autocast_dtype = autocast_dtype

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(images.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            logits = self.net(images)
        return F.cross_entropy(logits.float(), labels)


NUM_CLASSES = 10
_NOISE = 0.1  # fraction of tokens replaced by uniform noise: the loss floor stays above zero
# The fine-tuning task (--init-from): the pretraining task's pattern with this share of its next
# tokens redrawn. A model trained on the first already knows most of the second; the entries
# that moved are what fine-tuning must learn (16 at `small`: few enough for rank-8 adapters).
FINETUNE_REDRAWN = 1 / 64


def token_pattern(vocab: int, seed: int, finetune: bool = False) -> torch.Tensor:
    """The task's permutation P of the vocabulary (next = P[prev]): drawn from `seed`; the
    fine-tuning task's, the same with FINETUNE_REDRAWN of its entries shuffled among themselves
    by seed + 1 (still a permutation)."""
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    if finetune:
        gen = torch.Generator().manual_seed(seed + 1)
        moved = torch.randperm(vocab, generator=gen)[:max(2, int(vocab * FINETUNE_REDRAWN))]
        table[moved] = table[moved[torch.randperm(len(moved), generator=gen)]]
    return table


def global_token_batch(size: Size, seq_len: int, global_batch: int, step: int, seed: int,
                       finetune: bool = False) -> torch.Tensor:
    """Step `step`'s global batch, (global_batch, seq_len + 1) tokens, whatever the world size:
    next = P[prev] for the task's permutation P (`token_pattern`), unless noise replaced it, a
    pattern a small model learns in tens of steps (loss floor near 0.1 x ln(10 x vocab)). The
    fine-tuning task's sequences are drawn from seed + 1, not the pretraining run's."""
    table = token_pattern(size.vocab_size, seed, finetune)
    gen = torch.Generator().manual_seed((seed + finetune) * 1_000_003 + step + 1)
    noise = torch.randint(size.vocab_size, (global_batch, seq_len + 1), generator=gen)
    keep = torch.rand(global_batch, seq_len + 1, generator=gen) >= _NOISE
    tokens = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = noise[:, 0]
    for t in range(1, seq_len + 1):
        tokens[:, t] = torch.where(keep[:, t], table[tokens[:, t - 1]], noise[:, t])
    return tokens


@functools.cache
def _class_templates(image_size: int, seed: int) -> torch.Tensor:
    return torch.randn(NUM_CLASSES, 3, image_size, image_size,
                       generator=torch.Generator().manual_seed(seed))


def global_image_batch(size: Size, global_batch: int, step: int, seed: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images = a fixed per-class template plus noise; labels = the class. Same rule as tokens."""
    templates = _class_templates(size.image_size, seed)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    labels = torch.randint(NUM_CLASSES, (global_batch,), generator=gen)
    images = templates[labels] + torch.randn(global_batch, *templates.shape[1:], generator=gen)
    return images, labels


def rank_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank r's rows of a global batch: the r-th contiguous slice, no overlap between ranks."""
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank:(rank + 1) * per_rank]


def sequence_positions(seq_len: int, rank: int, world: int, zigzag: bool = True) -> torch.Tensor:
    """The global positions rank `rank` of a context-parallel group of `world` holds of each
    sequence. Zigzag (head-tail): the sequence cut into 2 x world equal chunks, rank r holding
    chunks r and 2 x world - 1 - r, so every rank has as many early tokens (little causal
    attention) as late ones (much); else chunk r of `world`. A length that does not cut refuses."""
    chunks = 2 * world if zigzag else world
    if seq_len % chunks:
        raise ValueError(f"--seq-len {seq_len} does not cut into {chunks} equal chunks "
                         f"({'2 a rank, zigzag, ' if zigzag else ''}{world} ranks): use a "
                         f"multiple of {chunks}")
    size = seq_len // chunks
    mine = [rank, chunks - 1 - rank] if zigzag else [rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in mine])


def workload(args: argparse.Namespace, topo: Topology, attention: Callable = causal_sdpa,
             dp_rank: int | None = None, dp_world: int | None = None,
             positions: torch.Tensor | None = None
             ) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (same init on every rank) and this rank's (inputs, targets) for every step,
    made up front. Data-parallel rank `dp_rank` of `dp_world` (default: all ranks) takes its
    slice of each global batch, so N ranks with batch b see the samples of one with batch N*b.
    `positions` (`sequence_positions`): the columns of each sequence this rank holds, a context-
    parallel shard; the model is then called with them, `model(inputs, targets, positions)`.
    A script with --init-from (`add_init_from`) gets the fine-tuning task's batches under it;
    the script loads the weights it names (`init_weights_from`)."""
    dp_rank = topo.rank if dp_rank is None else dp_rank
    dp_world = topo.world_size if dp_world is None else dp_world
    finetune = vars(args).get("init_from") is not None  # --init-from: the fine-tuning task
    size = SIZES[args.size]
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    torch.manual_seed(args.seed)
    global_batch = dp_world * args.batch_size
    batches = []
    for step in range(args.warmup + args.steps):
        if args.model != "resnet":
            # a dry run's tokens have no values: the pattern's token-by-token steps, for nothing
            tokens = torch.zeros(global_batch, args.seq_len + 1, dtype=torch.long) \
                if dry_run() else global_token_batch(size, args.seq_len, global_batch, step,
                                                     args.seed, finetune)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        else:
            inputs, targets = global_image_batch(size, global_batch, step, args.seed)
        if positions is not None:
            inputs, targets = inputs[:, positions], targets[:, positions]
        batches.append((rank_slice(inputs, dp_rank, dp_world).to(topo.device),
                        rank_slice(targets, dp_rank, dp_world).to(topo.device)))
    if args.model == "gpt":
        model = GPT(size, args.seq_len, attention, autocast_dtype)
    elif args.model == "llama":
        model = Llama(size, attention, autocast_dtype)
    elif args.model == "moe":  # balanced as 08's --moe-balance says; elsewhere, plain top-k
        model = Llama(size, attention, autocast_dtype, vars(args).get("moe_balance", "none"))
    else:
        model = Classifier(size.resnet, NUM_CLASSES, autocast_dtype)
    return model.to(topo.device), batches


def init_weights_from(model: nn.Module, init_from: str | None) -> str | None:
    """Load `model`'s weights (not yet sharded or wrapped) from --init-from: a checkpoint
    03_fsdp/optimized_fsdp_checkpoint.py saved (DCP, its "model" part: every rank reads all of
    it) or the folder of its `step-N` checkpoints (the newest); "scratch" or None loads nothing.
    Returns the checkpoint read. A checkpoint of another --model or --size is one line."""
    if init_from in (None, "scratch"):
        return None
    import torch.distributed.checkpoint as dcp

    path = Path(init_from)
    steps = sorted(path.glob("step-*")) if path.is_dir() else []
    path = steps[-1] if steps and not (path / ".metadata").exists() else path
    if not (path / ".metadata").exists():
        raise SetupError(f"--init-from {init_from}: no checkpoint there: run "
                         "03_fsdp/optimized_fsdp_checkpoint.py first (it saves into "
                         "checkpoints/ beside its --results), or pass --init-from scratch")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": model.state_dict()}
    for name, t in state["model"].items():
        shape = getattr(saved.get(f"model.{name}"), "size", None)
        if shape != t.shape:
            raise SetupError(f"--init-from {path}: its {name} is "
                             f"{'missing' if shape is None else tuple(shape)}, this model's "
                             f"{tuple(t.shape)}: pass the --model and --size it was saved at")
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())  # in place
    return str(path)


# The parts a technique is given. A technique takes the model's parts, never its attribute names:
# these find them in the project's models (and HuggingFace-style ones); a user's own model passes
# its own list instead.
_BLOCK_PATHS = ("blocks", "model.layers", "layers", "transformer.h")
_EMBEDDING_PATHS = ("tok_emb", "model.embed_tokens", "embed_tokens", "transformer.wte")
_HEAD_PATHS = ("head", "lm_head", "net.fc", "fc")


def _find(model: nn.Module, paths: Sequence[str]) -> nn.Module | None:
    for path in paths:
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    return None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units a technique shards, checkpoints, buckets or cuts, in forward order: the
    GPT's `blocks`, the Llama's `model.layers` (HuggingFace's names), GPT-2's `transformer.h`, a
    torchvision ResNet's four stages (`layer1`..`layer4`, wrapped in the Classifier or not). A
    model with none of these gets one line naming what to pass; a trainer with its own model
    passes its own list to the technique."""
    net = model.net if isinstance(model, Classifier) else model
    if all(hasattr(net, f"layer{i}") for i in range(1, 5)):
        return [getattr(net, f"layer{i}") for i in range(1, 5)]
    for path in _BLOCK_PATHS:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, nn.ModuleList | nn.Sequential):
            return list(found)
    raise ValueError(f"no transformer blocks found in {type(model).__name__} (looked for "
                     f"{', '.join(_BLOCK_PATHS)}): pass the list of its repeated blocks "
                     f"yourself, e.g. blocks=list(model.my_layers)")


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding (the GPT's `tok_emb`, the Llama's `model.embed_tokens`); None for a
    model without one (the ResNet)."""
    found = _find(model, _EMBEDDING_PATHS)
    return found if isinstance(found, nn.Embedding) else None


def output_head(model: nn.Module) -> nn.Linear | None:
    """The last linear layer, which low-precision and compression recipes leave whole: the GPT's
    tied `head`, the Llama's `lm_head`, the ResNet's `fc`. Compare its weight by identity with
    `input_embedding(model).weight` to know whether the two are tied."""
    found = _find(model, _HEAD_PATHS)
    return found if isinstance(found, nn.Linear) else None


def items_per_step(args: argparse.Namespace, dp_world: int) -> int:
    """Global tokens (a decoder) or images (ResNet) consumed by one optimizer step."""
    per_sample = 1 if args.model == "resnet" else args.seq_len
    return dp_world * args.batch_size * per_sample


# ==== CLI =========================================================================================
# The flags every script shares. A bad value ends with one line naming the flag to change.
def parser(doc: str | None, long_context: bool = False,
           skips: Mapping[str, str] | None = None) -> RecipeParser:
    """The shared flags; a script adds its own. `long_context` picks the long-sequence shape;
    `skips` maps a --model the technique does not apply to onto why (the run is `skipped`)."""
    p = RecipeParser(doc, long_context, skips)
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="model/data preset (default: small); a published model's shape "
                        f"({', '.join(PUBLISHED_SIZES)}) picks its family's --model")
    p.add_argument("--model", default="gpt", choices=list(MODELS),
                   help="workload: the GPT decoder, a Llama-style decoder (RMSNorm, rotary, "
                        "SwiGLU, grouped-query attention, untied head) or a torchvision ResNet")
    p.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps")
    p.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--batch-size", type=int_at_least(1), default=None,
                   help="sequences (or images) per rank per step (default: from --size)")
    p.add_argument("--seq-len", type=int_at_least(2), default=None,
                   help="tokens per sequence (default: from --size)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="compute dtype: bf16 autocast or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--log-every", type=int_at_least(0), default=0,
                   help="progress line every N steps (default: about ten lines)")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON-lines file to append to")
    p.add_argument("--timeout", type=int_at_least(1), default=300,
                   help="seconds a collective may wait for a peer before the run fails")
    p.add_argument("--trace", action="store_true",
                   help="profile two warm-up steps (untimed; the two before the last) into a "
                        "Chrome/Perfetto trace per rank, in the results file's traces/ folder")
    p.add_argument("--dry-run", type=int_at_least(1), default=None, metavar="WORLD",
                   help="play one rank of a world of WORLD on this CPU: a fake process group "
                        "and fake tensors (shapes, no data), the script's own path for three "
                        "steps; records memory by kind, bytes by mesh dim and FLOPs, no losses "
                        f"(default results file: {DRY_RESULTS.relative_to(ROOT)})")
    p.add_argument("--dry-rank", type=int_at_least(0), default=0,
                   help="with --dry-run: the rank played (default: 0)")
    p.add_argument("--check-flags", action="store_true",
                   help="parse the flags and exit 0, running nothing (a bad flag exits 2 with "
                        "its one line): what `make` does with ARGS before it launches a folder")
    p.own_flags = []  # from here on, the script's own flags: they name the run's variant
    return p


class RecipeParser(argparse.ArgumentParser):
    """argparse with one-line errors, the size's shape filled in after parsing, and the run's
    variant: its flags that differ from their defaults, which name its row in the report."""

    def __init__(self, doc: str | None, long_context: bool = False,
                 skips: Mapping[str, str] | None = None):
        self.own_flags: list[argparse.Action] | None = None  # `parser` starts the list
        # --help prints the module docstring as written: the script's card.
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.long_context = long_context
        self.skips = dict(skips or {})  # --model value -> why the technique does not apply
        self.output_only: set[str] = set()  # flags that change what is printed, not what runs

    def add_argument(self, *names, **options) -> argparse.Action:
        flag = super().add_argument(*names, **options)
        if self.own_flags is not None:
            self.own_flags.append(flag)
        return flag

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None) -> argparse.Namespace:
        ns = super().parse_args(args, namespace)
        own = [_flag(a.dest, value) for a in self.own_flags if a.dest not in self.output_only
               and (value := getattr(ns, a.dest)) != _parsed_default(a)]
        family = SIZES[ns.size].family
        if family and ns.model != family:  # a published shape is its family's model
            if ns.model != _parsed_default(self._option_string_actions["--model"]):
                self.error(f"--size {ns.size} is a {family} model: use --model {family}, or "
                           f"leave --model out")
            ns.model = family
        if not ns.check_flags:  # a check records nothing, a skip included
            run_state.args = ns  # a run that skips before `setup` is recorded too
            if ns.model in self.skips:  # before the checks of a shape the run will never use
                ns.variant = " ".join(own) or None  # its record is its variant's (make smoke)
                raise Skip(self.skips[ns.model])
        shape = self.fill_shape(ns)
        if ns.model == "resnet" and ns.batch_size < 2:
            self.error("--model resnet needs --batch-size >= 2 (BatchNorm normalises over the "
                       "batch)")
        if ns.dry_run is not None:
            if ns.dry_rank >= ns.dry_run:
                self.error(f"--dry-rank {ns.dry_rank} is not a rank of --dry-run {ns.dry_run}: "
                           f"use 0 to {ns.dry_run - 1}")
            # two warm-up steps, so that the measured one (the last, where a dry run ends) has
            # optimizer state; the GPU's dtype, the world the dry run stands for
            ns.warmup, ns.steps = 2, 1
            ns.dtype = ns.dtype or "bf16"
            # what the launcher would have set, read by the checks a script makes before setup
            per_node = min(ns.dry_run, DRY_RUN_GPUS_PER_NODE)
            os.environ.update(RANK=str(ns.dry_rank), WORLD_SIZE=str(ns.dry_run),
                              LOCAL_RANK=str(ns.dry_rank % per_node),
                              LOCAL_WORLD_SIZE=str(per_node))
            if ns.results == RESULTS:
                ns.results = DRY_RESULTS
        elif ns.dry_rank:
            self.error("--dry-rank picks the rank a dry run plays: use it with --dry-run")
        if ns.dtype is None:
            ns.dtype = "bf16" if torch.cuda.is_available() else "fp32"
        if ns.trace and ns.warmup < 3:
            self.error("--trace profiles the two warm-up steps before the last (which measures "
                       "memory): use --warmup 3 or more")
        if ns.check_flags:  # the Makefile's check of ARGS: every flag parsed, and they agree
            sys.exit(0)
        ns.variant = " ".join(shape + own) or None
        return ns

    def fill_shape(self, ns: argparse.Namespace) -> list[str]:
        """Fill in the size's batch and sequence length where no flag gave them; return the flags
        that chose others, which name the variant too (`--batch-size 1 --seq-len 32`)."""
        size = SIZES[ns.size]
        preset = {"batch_size": size.long_batch_size if self.long_context else size.batch_size,
                  "seq_len": size.long_seq_len if self.long_context else size.seq_len}
        chosen = []
        for dest, value in preset.items():
            default = value if self.get_default(dest) is None else self.get_default(dest)
            if getattr(ns, dest) is None:
                setattr(ns, dest, value)
            elif getattr(ns, dest) != default:
                chosen.append(_flag(dest, getattr(ns, dest)))
        return chosen


def add_init_from(parser: RecipeParser, default: str | None = None) -> None:
    """--init-from, a fine-tuning script's flag: the weights to start from and, with them, the
    fine-tuning task (`token_pattern`). `common.workload` reads it; `init_weights_from` loads."""
    parser.add_argument("--init-from", default=default, metavar="CHECKPOINT",
                        help="fine-tune: start from the weights of a checkpoint "
                             "03_fsdp/optimized_fsdp_checkpoint.py saved (a step-N folder, or "
                             "the folder of them: the newest), saved at the same --model, "
                             "--size and --seed, and train on the fine-tuning task (the "
                             "pretraining pattern with 1/64 of it redrawn); `scratch`: that "
                             "task from random weights" + (f" (default: {default})" if default
                                                          else " (default: pretraining)"))


def _flag(dest: str, value) -> str:
    """A flag as a command line reads: `--wrap root`, `--no-overlap` (a switch), `--ops a,b`."""
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return f"--{dest.replace('_', '-')}" + ("" if value is True else f" {text}")


def _parsed_default(action: argparse.Action):
    """A flag's default as parsing leaves it (argparse converts a string default by its type)."""
    if isinstance(action.default, str) and action.type is not None:
        return action.type(action.default)
    return action.default


def _number(text: str, kind: type, what: str, ok: Callable, rule: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type for counts: an integer >= `minimum`."""
    return lambda text: _number(text, int, "an integer", lambda v: v >= minimum, f">= {minimum}")


def positive_float(text: str) -> float:
    """argparse type for sizes and rates: a float > 0."""
    return _number(text, float, "a number", lambda v: v > 0, "> 0")


def resolved(args: argparse.Namespace, **derived) -> argparse.Namespace:
    """The run's settings: the parsed flags plus the values the script derived for this host (a
    default that depends on the world, a batch that spans a group), under a name of their own so
    that `args` stays what the command line said: `settings = common.resolved(args,
    batch_size=...)`, then `settings` wherever the derived value counts (`workload`, `record`).
    A derived value that nothing here reads from the flags is a plain local instead."""
    return argparse.Namespace(**{**vars(args), **derived})


# ==== Topology ====================================================================================
# From torchrun's environment, SLURM's (`srun python script.py`), or a world of one for a plain
# `python script.py`. NCCL and one GPU per local rank with CUDA, else gloo on CPU.
@dataclass
class Topology:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nnodes: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_rank() -> int:
    """This process's rank as its launcher (torchrun or srun) set it, before `setup`."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def launch_world_size() -> int:
    """The world size the launcher set, before `setup`: for checks that need no group."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def _ephemeral_ports() -> range:
    """The ports the kernel hands to sockets that bind port 0 (gloo's pairs, every client)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):  # not Linux: IANA's dynamic range
        low, high = 49152, 65535
    return range(low, high + 1)


def free_port(block: int = 1) -> int:
    """A TCP port p on 127.0.0.1 where p .. p + block - 1 are all free right now, drawn outside
    the kernel's ephemeral range: there a later connection or a gloo pair would never take it
    between this check and the store's bind, so a test may use p + k for its k-th group."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(10000, 65536 - block)
                  if p + block <= ephemeral.start or p >= ephemeral.stop]
    for port in random.Random().sample(candidates, k=min(200, len(candidates))):
        try:
            with contextlib.ExitStack() as sockets:
                for k in range(block):
                    s = sockets.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue
    raise SetupError(f"no {block} free TCP port(s) in a row on 127.0.0.1 outside the ephemeral "
                     f"range {ephemeral.start}-{ephemeral.stop - 1}: set MASTER_PORT")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[07-09,12],cpu1` -> `gpu07`."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]  # commas inside brackets separate ranges
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def slurm_tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node `node` from SLURM_TASKS_PER_NODE, e.g. `2(x3),1`: 2, 2, 2, then 1."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[node]


def torchrun_env_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun would set, from those `srun` sets for each task. The address and
    port come from the job (first host, job id), so its tasks agree and two jobs do not clash."""
    node = int(env.get("SLURM_NODEID", "0"))
    local_world = env.get("SLURM_NTASKS_PER_NODE") or str(
        slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], node))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": local_world,
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"]),
            "MASTER_PORT": env.get("MASTER_PORT")
            or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)}


def cuda_device_index(local_rank: int, local_world: int, visible: int, per_task: bool) -> int:
    """The GPU this process drives: under torchrun every process sees the host's GPUs, and local
    rank i takes the i-th; `srun --gpus-per-task` (`per_task`) shows each task its own, and it
    takes the first. Two ranks on one GPU, which NCCL refuses, are a SetupError."""
    if visible >= local_world:
        return local_rank
    if per_task and visible >= 1:
        return 0
    raise SetupError(f"{local_world} processes on this host but {visible} GPU(s) visible to "
                     f"each: run one process per GPU (NPROC={visible})")


def _restarted_group_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun restart (--max-restarts), the agent's store under a key prefix of its own:
    it still holds the dead group's keys, such as a dead peer's address, which the new group
    could read before its peer rewrote it ("Connection refused"). None otherwise (env://)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                is_master=False, timeout=timeout)
    return dist.PrefixStore(f"restart-{restart}", agent_store)


# A compiled run's first steps keep each rank in inductor for minutes on 8 GPUs, while the ranks
# done first wait in a collective: its timeout is at least this.
COMPILE_TIMEOUT_S = 1800


def setup(args: argparse.Namespace | None = None, timeout_s: float = 300,
          compiles: bool = False) -> Topology:
    """Join the process group from the launcher's environment (torchrun, srun, or none: a world
    of one) and pick the device. A recipe passes its parsed flags, whose `--timeout` bounds every
    collective; a trainer of one's own calls `setup()` alone (`timeout_s`). A dead peer is an
    error, never a hang. `compiles`: the run compiles on CUDA (COMPILE_TIMEOUT_S at least)."""
    run_state.args = args
    if getattr(args, "dry_run", None):
        return dry_run_setup(args)
    from_srun = "RANK" not in os.environ and "SLURM_PROCID" in os.environ
    per_task = from_srun and "SLURM_GPUS_PER_TASK" in os.environ  # each task its own GPUs
    if from_srun:
        os.environ.update(torchrun_env_from_slurm(os.environ))
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        index = cuda_device_index(local_rank, local_world, torch.cuda.device_count(), per_task)
        device, backend = torch.device("cuda", index), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # Processes sharing a host split its cores; oversubscription would distort every timing.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    seconds = args.timeout if args is not None else timeout_s
    if compiles and device.type == "cuda":
        seconds = max(seconds, COMPILE_TIMEOUT_S)
    timeout = datetime.timedelta(seconds=seconds)
    dist.init_process_group(backend, timeout=timeout, store=_restarted_group_store(timeout),
                            rank=rank, world_size=world,
                            device_id=device if backend == "nccl" else None)
    topo = Topology(rank, local_rank, world, local_world, max(1, world // local_world),
                    backend, device)
    run_state.topo = topo
    return topo


# ==== Dry runs ====================================================================================
# `--dry-run N`: a script's own path as one rank of N on this CPU. The fake process group returns
# every collective at once (CollectiveBytes still counts what each is handed), and fake tensors
# have shapes, dtypes and devices but no data: a 70B model's step costs the bookkeeping of its
# ops, not their FLOPs or bytes. What a real GPU would do differently is stood in for, by name.
DRY_RUN_GPUS_PER_NODE = 8
# Fake CUDA tensors run a forward on this driverless host, but autograd's engine asks the driver
# for the device it runs backward on, and FSDP2 makes CUDA streams: a step needs CPU devices.
DRY_RUN_DEVICE = {"device": "cpu", "why": "fake CUDA tensors cannot run backward without a "
                  "driver (autograd asks it for the device), nor FSDP2 make its streams"}


def dry_run_setup(args: argparse.Namespace) -> Topology:
    """`setup` for a dry run: the fake process group as rank --dry-rank of --dry-run, eight ranks a
    node; from here on every tensor made is fake (FakeTensorMode, on until `run_main` ends).
    AdamW takes the path it takes on a GPU, foreach over a parameter group, which it never takes
    on CPU devices (a stand-in the record names)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, world = args.dry_rank, args.dry_run
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    per_node = min(world, DRY_RUN_GPUS_PER_NODE)
    topo = Topology(rank, rank % per_node, world, per_node, -(-world // per_node), "fake",
                    torch.device(DRY_RUN_DEVICE["device"]))
    run_state.topo = topo
    # torch.optim's own test of a parameter list (_default_to_fused_or_foreach) reads these
    optimizers = importlib.import_module("torch.optim.optimizer")
    foreach_devices = optimizers._get_foreach_kernels_supported_devices()
    optimizers._get_foreach_kernels_supported_devices = lambda: [*foreach_devices, "cpu"]
    optimizers._foreach_supported_types.append(FakeTensor)  # a fake plain tensor
    stand_in("optimizer", "foreach over each parameter group, AdamW's default on a GPU")
    nn.Module.to = _fake_module_to(nn.Module.to)
    # A DeviceMesh reads its ranks back from a tensor, which a fake one cannot give: a rank map
    # made fake is init_device_mesh's (ranks 0 .. N-1 in order), made real again
    mesh_init = DeviceMesh.__init__

    def real(value):
        return torch.arange(value.numel(), dtype=value.dtype).view(value.shape) \
            if isinstance(value, FakeTensor) else value

    def mesh_of_real_ranks(self, *args, **kwargs) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *map(real, args), **{key: real(v) for key, v in kwargs.items()})
    DeviceMesh.__init__ = mesh_of_real_ranks
    nn.parallel.DistributedDataParallel.__init__ = _no_dry_ddp
    F.rms_norm = _rms_norm_as_on_cuda
    # The fake group's collectives return done, yet its work says it is not: code that frees a
    # buffer once its collective completes (ZeRO's gradient buckets) would keep them all
    torch._C._distributed_c10d.FakeWork.is_completed = _completed
    stand_in("collectives", "an asynchronous one is complete when asked, as on a GPU soon after "
             "it starts")
    # Python objects travel pickled in real byte tensors; the fake group's gathers and broadcasts
    # hand every rank this rank's bytes: each other rank answers as this one (a stand-in)
    for name in ("all_gather_object", "broadcast_object_list"):
        setattr(dist, name, _as_this_rank(getattr(dist, name), unset_fake_temporarily))
    run_state.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    run_state.fake_mode.__enter__()
    return topo


def _fake_module_to(module_to: Callable) -> Callable:
    """`Module.to` for fake tensors: a module already where it is sent stays as it is. Torch moves
    a fake parameter by swapping it for its copy, and refuses the swap of one the fake mode holds
    a weak reference to: every one, even where the copy is itself (`model.to(device)`)."""
    def to(self: nn.Module, *args, **kwargs) -> nn.Module:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or t.device == device) and (dtype is None or t.dtype == dtype)
               for t in itertools.chain(self.parameters(), self.buffers())):
            return self
        return module_to(self, *args, **kwargs)
    return to


def _as_this_rank(collective: Callable, real_tensors: Callable) -> Callable:
    """An object collective run on real tensors, its answer named a stand-in in the record."""
    @functools.wraps(collective)
    def as_this_rank(*args, **kwargs):
        stand_in(f"dist.{collective.__name__}", "every other rank answers as this one")
        with real_tensors():
            return collective(*args, **kwargs)
    return as_this_rank


_composite_rms_norm = F.rms_norm


class _RMSNormSavingItsInput(torch.autograd.Function):
    """RMSNorm keeping for backward what CUDA's fused kernel keeps, its input, and recomputing
    the rest there: on a CPU device torch runs it as a composite of ops whose autograd saves
    fp32 copies of the input and of its normalized form (a bf16 model's norms: 5 x their input's
    bytes, some 20% of a Llama layer's activations)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        ctx.save_for_backward(x, weight)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return _composite_rms_norm(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = (t if t is None else t.detach().requires_grad_(needs)
                         for t, needs in zip((x, weight), ctx.needs_input_grad[:2], strict=True))
            out = _composite_rms_norm(x, ctx.normalized_shape, weight, ctx.eps)
            asked = [t for t in (x, weight) if t is not None and t.requires_grad]
            grads = dict(zip(map(id, asked), torch.autograd.grad(out, asked, grad), strict=True))
        return grads.get(id(x)), grads.get(id(weight)), None, None


def _rms_norm_as_on_cuda(x: torch.Tensor, normalized_shape, weight=None, eps=None
                         ) -> torch.Tensor:
    stand_in("RMSNorm", "keeps its input for backward, as CUDA's fused kernel, not the CPU "
             "composite's fp32 copies")
    return _RMSNormSavingItsInput.apply(x, weight, normalized_shape, eps)


def _completed(_work) -> bool:
    return True


def _no_dry_ddp(*_, **__) -> None:
    raise Skip("DDP cannot dry-run: its C++ reducer reads its buckets' data and takes each "
               "all-reduce's result from a future, and the fake group's carries none")


def stand_in(what: str, how: str) -> None:
    """Name, in a dry run's record, what stands in for what the fake world cannot give: a value
    read from data that does not exist (MoE routing: even), a GPU path on a CPU device."""
    run_state.stand_ins[what] = how


def even_routing(slots: int, ranks: int, experts_per_rank: int) -> list[list[int]]:
    """A dry run's stand-in for a MoE's routed rows, which fake tokens do not choose: `slots`
    (tokens x top_k) spread evenly over `ranks` x `experts_per_rank` experts (the first ones one
    more where they do not divide), by rank then expert, as the split sizes read from them."""
    stand_in("routing", "even: every expert gets an equal share of the routed slots")
    experts = ranks * experts_per_rank
    counts = [slots // experts + (e < slots % experts) for e in range(experts)]
    return [counts[r * experts_per_rank:(r + 1) * experts_per_rank] for r in range(ranks)]


class InlineExecutor(concurrent.futures.Executor):
    """A dry run's stand-in for a worker thread: each call runs where it is submitted, in order.
    A fake tensor's mode keeps one state for all threads (whether it is inside an op), so fake
    ops on two threads at once trip its checks."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> concurrent.futures.Future:
        stand_in("threads", "the work handed to a thread runs on the main one, in order")
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # as a thread's would: raised by result()
            future.set_exception(error)
        return future


def dry_run() -> bool:
    """Whether this process runs a dry run (fake group, fake tensors): no losses, no times."""
    return run_state.fake_mode is not None


def real_tensors() -> contextlib.AbstractContextManager:
    """A block whose tensors are real in a dry run too: values that are the run's configuration,
    not its data (a mesh's ranks, a sequence shard's positions), read on the host."""
    if not dry_run():
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


# ==== Collectives =================================================================================
# The collectives recipes call that torch names or runs differently across releases and backends.
# `reduce_scatter` is plumbing, not a technique: FSDP (03), ZeRO (04), the 3-D pipeline (05) and
# 06's TP baseline call it, and on gloo each would otherwise send twice the bytes it needs.

# PyTorch 2.14's names for the tensor-to-tensor all-gather and reduce-scatter (the old ones now
# warn); older releases, such as a GPU image's preinstalled torch, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# DDP without its broadcast of the buffers before each forward (a recipe keeps them equal
# itself): `forward_sync_buffers` in 2.14, where the old `broadcast_buffers` warns; only the
# old name before.
DDP_NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                      inspect.signature(nn.parallel.DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})


class _SummedOnArrival:
    """reduce_scatter's pending call on gloo, with a Work's wait() and is_completed(): done once
    the all_to_all is and the copies that arrived are summed (on gloo's thread, as they land)."""

    def __init__(self, summed: torch.futures.Future):
        self.summed = summed

    def wait(self) -> bool:
        self.summed.wait()
        return True

    def is_completed(self) -> bool:
        return self.summed.done()


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False
                   ) -> dist.Work | _SummedOnArrival | None:
    """`out` = the reduction over the group's ranks of chunk r of `inp` (N equal chunks, callers
    pad), on rank r; `out` may be that chunk itself. gloo's reduce_scatter_tensor all-reduces a
    copy of the whole input and keeps a slice: twice the bytes and the time of a reduce-scatter.
    On gloo this is an all_to_all_single instead, each rank receiving every peer's copy of its
    own chunk, (N-1)/N of the input sent as a ring would, and a local sum. Other backends (NCCL)
    have a true reduce-scatter: theirs is used."""
    if dist.get_backend(group) != "gloo":
        return reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"reduce_scatter on gloo sums or averages, not {op}")
    n = dist.get_world_size(group)
    copies = torch.empty_like(inp)  # row k: rank k's copy of this rank's chunk
    with CollectiveBytes.counted_as("reduce_scatter"):  # the step-time model prices one
        work = dist.all_to_all_single(copies, inp, group=group, async_op=True)

    def sum_copies(_: torch.futures.Future) -> None:
        torch.sum(copies.view(n, -1), dim=0, out=out.view(-1))
        if op == dist.ReduceOp.AVG:
            out.div_(n)

    summed = work.get_future().then(sum_copies)
    if not async_op:
        summed.wait()
        return None
    return _SummedOnArrival(summed)


# ==== Bytes sent ==================================================================================
# What this rank hands to collectives, counted as ring algorithms move it.
# c10d op: (argument with the tensor(s) sent, argument with the group, bytes a rank of a group of
# n sends per byte of them)
_SENT_PER_BYTE = {
    "allreduce_": (0, 1, lambda n: 2 * (n - 1) / n),
    "_allgather_base_": (1, 2, lambda n: n - 1),
    "_reduce_scatter_base_": (1, 2, lambda n: (n - 1) / n),
    "alltoall_base_": (1, 2, lambda n: (n - 1) / n),
    "broadcast_": (0, 1, lambda n: (n - 1) / n),  # pipelined: the mean over ranks (n-1 of n send)
    "send": (0, 1, lambda n: 1),
}
# The functional collectives DTensor issues (the tensor sent is their first argument, the group's
# name their last): bytes a rank of a group of n sends per byte of it.
_FUNCTIONAL_SENT_PER_BYTE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: n - 1,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
}


# The functional collectives under the c10d kind that runs the same exchange
_C10D_NAME = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather",
              "reduce_scatter_tensor": "reduce_scatter"}


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends in the collectives issued in its context (on this
    thread), from the tensors handed to them."""

    def __init__(self):
        super().__init__()
        self.bytes = 0.0
        self.by_kind: dict[str, float] = {}  # "<collective> <dtype>" -> bytes
        self.by_group: dict[str, float] = {}  # process group name -> bytes (a mesh dim's group)
        # "<collective>/<group size>" -> [bytes, calls]: what the step-time model prices
        self.by_op: dict[str, list[float]] = {}

    _op_named: str | None = None  # set by counted_as

    @classmethod
    @contextlib.contextmanager
    def counted_as(cls, op: str):
        """The collectives issued inside count in `by_op` as `op`: gloo's reduce-scatter here
        is an all-to-all, which calibration measures as a reduce-scatter too."""
        cls._op_named = op
        try:
            yield
        finally:
            cls._op_named = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d" and name == "alltoall_base_" and args[4]:
            # uneven splits (expert parallelism's tokens): all but the rows this rank keeps
            group, rows = dist.ProcessGroup.unbox(args[2]), args[1].shape[0]
            kept = args[4][group.rank()] / rows if rows else 1.0
            self.count(name, [args[1]], group, lambda n: 1.0 - kept)
        elif func.namespace == "c10d" and name in _SENT_PER_BYTE:
            sent, group, per_byte = _SENT_PER_BYTE[name]
            tensors = args[sent] if isinstance(args[sent], list) else [args[sent]]
            self.count(name, tensors, dist.ProcessGroup.unbox(args[group]), per_byte)
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL_SENT_PER_BYTE:
            group = dist.distributed_c10d._resolve_process_group(args[-1])  # by its name
            self.count(name, [args[0]], group, _FUNCTIONAL_SENT_PER_BYTE[name])
        return func(*args, **(kwargs or {}))

    def count(self, name: str, tensors: list[torch.Tensor], group: dist.ProcessGroup,
              per_byte: Callable[[int], float]) -> None:
        priced = self._op_named or _C10D_NAME.get(name, name.strip("_").removesuffix("_base"))
        op = f"{priced}/{group.size()}"
        sent_by_op = self.by_op.setdefault(op, [0.0, 0])
        sent_by_op[1] += 1  # one call, whatever the tensors it hands over
        for t in tensors:
            sent_bytes = per_byte(group.size()) * t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            kind = f"{name.strip('_').removesuffix('_base')} {dtype}"  # "allgather uint8"
            self.bytes += sent_bytes
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + sent_bytes
            self.by_group[group.group_name] = self.by_group.get(group.group_name, 0.0) + sent_bytes
            sent_by_op[0] += sent_bytes


def ring_allreduce_mb(nbytes: float, world: int) -> float:
    """MB each rank sends in a ring all-reduce of `nbytes`: 2(N-1)/N x nbytes."""
    return 2 * (world - 1) / world * nbytes / 2**20


def ddp_bucket_bytes(model: nn.Module) -> list[int]:
    """Byte sizes of the gradient buckets a DDP model all-reduces each step: those DDP rebuilt,
    after its first steps, in the order gradients became ready (from its logging data)."""
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]


# ==== Step work ===================================================================================
# What a record says its step did, for the step-time model the report prices it with
# (report/costmodel.py): this rank's FLOPs, the ops that are no matmul by token and layer, the
# parameters its optimizer steps, the collectives handed over, which of them the technique runs
# under compute, recompute and a pipeline's bubble. The scripts describe; the report predicts.
# What a record's `overlapped=` says of the common wrappers: DDP's bucketed all-reduce under
# backward; FSDP's gathers (prefetched) under the step, its reduce-scatters under backward.
DDP_OVERLAP = {"allreduce": "backward"}
FSDP_OVERLAP = {"allgather": "step", "reduce_scatter": "backward"}




def matmul_weights_per_token(size: Size, model: str) -> float:
    """The weights a token multiplies through (2 FLOPs each, forward): every Linear of the
    blocks and the head; of a MoE layer, its router, its top_k routed experts and the shared
    expert. Lookups (embeddings, positions) are no matmuls."""
    d, layers = size.d_model, size.n_layers
    if model == "gpt":
        return 12 * d * d * layers + d * size.vocab_size
    head_dim = size.attention_head_dim
    attention = 2 * d * size.n_heads * head_dim + 2 * d * size.n_kv_heads * head_dim
    mlp = 3 * d * size.llama_ffn if model == "llama" else \
        d * size.n_experts + 3 * d * (size.top_k * size.expert_ffn + size.shared_expert_ffn)
    return (attention + mlp) * layers + d * size.vocab_size


def train_flops_per_token(matmul_weights: float, layers: int, d_model: int, seq_len: int
                          ) -> tuple[float, float]:
    """A token's training FLOPs (backward: twice the forward), as torchtitan counts them for
    MFU: (all, attention's). The matmuls', 6 x the weights it multiplies through; attention's,
    its scores and weighted sum (2 x 2 x seq x d_model a layer forward, the causal mask's
    skipped half counted as done), 12 x layers x seq x d_model."""
    attention = 12 * layers * seq_len * d_model
    return 6 * matmul_weights + attention, attention


def train_flops(size: Size, model: str, tokens: float, seq_len: int) -> tuple[float, float]:
    """A training step's (matmul, attention) FLOPs over `tokens` in sequences of `seq_len`:
    train_flops_per_token of the model's shape, times the tokens."""
    every, attention = train_flops_per_token(matmul_weights_per_token(size, model),
                                             size.n_layers, size.d_model, seq_len)
    return (every - attention) * tokens, attention * tokens

def stepped_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> list[torch.Tensor]:
    """The plain tensors this rank's optimizer steps (a DTensor's shard), else the model's."""
    return [t for p in (model.parameters() if optimizer is None else
                        (p for group in optimizer.param_groups for p in group["params"]))
            for t in _plain(p)]

def step_work(args: argparse.Namespace, topo: Topology, stats: Stats, model: nn.Module,
              optimizer: torch.optim.Optimizer | None, dp_world: int,
              overlapped: Mapping[str, str], recompute: bool, bubble: float,
              layer_passes: float, cp: int = 1, attention_busiest: float = 1.0) -> dict | None:
    """This rank's work in the measured step, as report/costmodel.py's StepWork prices it: its
    share of the step's FLOPs (the step's tokens over the world: data, tensor, pipeline and
    context parallelism each give a rank 1/N of the work), the parameters its optimizer steps,
    the collectives it handed over (CollectiveBytes: bytes and calls by op and group),
    `overlapped` (which of them hide under compute), activation checkpointing's recompute, a
    pipeline's bubble and the layer passes a rank runs (a stage's layers once a micro-batch);
    context parallelism's attention in blocks of 1/cp of the sequence, as the busiest rank's
    (`attention_busiest` times an even share: every rank waits for it). None for the ResNet,
    whose convolutions the model does not price."""
    if args.model not in ("gpt", "llama", "moe"):
        return None
    size = SIZES[args.size]
    tokens = items_per_step(args, dp_world) / topo.world_size
    matmul, attention = train_flops(size, args.model, tokens, args.seq_len)
    # torchao's Float8Linear (03's FP8 run), by name: a run without torchao never imports it
    float8 = sum(m.in_features * m.out_features for m in model.modules()
                 if type(m).__name__ == "Float8Linear")
    return {"matmul_flops": matmul, "attention_flops": attention * attention_busiest,
            "token_layers": tokens * size.n_layers,
            "stepped_params": sum(t.numel() for t in stepped_tensors(model, optimizer)),
            "collectives": {op: [mb * 2**20, calls] for op, (mb, calls) in
                            (stats.comm_by_op or {}).items()},
            "overlapped": dict(overlapped), "recompute": recompute, "bubble": bubble,
            "seq_len": args.seq_len // cp, "layer_passes": size.n_layers * layer_passes,
            "float8_share": float8 / matmul_weights_per_token(size, args.model)}


# ==== Timing ======================================================================================
# Warm-up steps, then timed ones, each bracketed by device synchronisation.
@dataclass
class Stats:
    step_ms: float
    step_ms_p90: float
    step_ms_iqr: tuple[float, float]  # first and third quartiles: the spread of the timed steps
    startup_s: float  # `import common` (torch already imported) to the first timed step
    warmup_s: float
    load_avg: tuple[float, float]  # the host's 1-minute load as timing starts and ends: shared?
    losses: list[float]
    memory: dict[str, float] | None = None  # the last warm-up step's peak MB (its split: CPU)
    comm_mb: float | None = None  # sent by this rank in the last warm-up step, counted
    comm_mb_by_kind: dict[str, float] | None = None  # the same, by collective and dtype
    comm_mb_by_group: dict[str, float] | None = None  # the same, by process group name
    comm_by_op: dict[str, list[float]] | None = None  # "allreduce/2" -> [MB, calls]
    flops: float | None = None  # a dry run's: this rank's in the measured step (FlopCounterMode)


def summarize_times(seconds: Sequence[float]) -> tuple[float, float, tuple[float, float]]:
    """Median, p90 (nearest rank) and quartiles (interpolated, as numpy's default), in ms."""
    if not seconds:
        raise ValueError("no timed steps")
    ordered = sorted(seconds)
    p90 = ordered[-(-9 * len(ordered) // 10) - 1]  # the ceil(0.9 n)-th smallest
    # Python 3.11's quantiles() refuses a single value, whose quartiles are itself
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") \
        if len(ordered) > 1 else ordered * 3
    return 1e3 * statistics.median(ordered), 1e3 * p90, (1e3 * q1, 1e3 * q3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                batches: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
                topo: Topology, memory_of: Sequence = (), loss_rank: int | None = None,
                dp_world: int | None = None) -> Stats:
    """Run every batch through `train_step` and time the steps after the warm-up, whole. A
    `train_step` zeroes the gradients first, not last: `record` counts them. The last warm-up
    step is measured (`_measured_step`); a dry run ends there (it has no times to take). Losses
    are averaged over ranks after the clock, or are
    `loss_rank`'s (a pipeline's last stage, the only one with a loss: it prints progress too).
    `dp_world`: the ranks that take their own share of the batch (default: all; a pipeline: 1).
    """
    n = args.warmup if dry_run() else len(batches)
    every = args.log_every or max(1, n // 10)
    times, losses, measured = [], [], {}
    traced = range(max(0, args.warmup - 3), args.warmup - 1) if args.trace else range(0)
    phase_hooks = nvtx_phase_ranges(memory_of) if topo.device.type == "cuda" else []
    # a dry run's, which times no step: its load from the start
    load_start, startup_s = (os.getloadavg()[0], 0.0) if dry_run() else (None, None)
    for i, (inputs, targets) in enumerate(batches[:n]):
        if i == args.warmup:
            load_start = os.getloadavg()[0]
        if traced and i == traced.start:
            profiler = _start_profiler(topo.device)
        with step_range(i, topo.device, named=i in traced):
            _sync(topo.device)
            start = time.perf_counter()
            if i == args.warmup - 1:
                loss, measured = _measured_step(functools.partial(train_step, inputs, targets),
                                                memory_of, topo.device, dry_run())
            else:
                loss = train_step(inputs, targets)
            _sync(topo.device)
            elapsed = time.perf_counter() - start
        if traced and i == traced[-1]:
            _stop_profiler(profiler, args, topo)
        if i == args.warmup:
            startup_s = start - _IMPORTED_AT
        times.append(elapsed)
        losses.append(loss.detach().float().reshape(()))
        if dry_run():  # a fake loss has no value to print
            print(f"dry run: step {i + 1}/{n} as rank {topo.rank} of {topo.world_size} | "
                  f"{elapsed:.1f} s on this host" + (" (memory, bytes and FLOPs counted)"
                                                      if i == args.warmup - 1 else ""),
                  flush=True)
        elif ((i + 1) % every == 0 or i == n - 1) and topo.rank == (loss_rank or 0):
            print(f"step {i + 1:4d}/{n} | rank-{topo.rank} loss {loss.item():.4f} | "
                  f"{1e3 * elapsed:8.1f} ms | "
                  f"{items_per_step(args, dp_world or topo.world_size) / elapsed:10,.0f} "
                  f"{'img' if args.model == 'resnet' else 'tok'}/s | "
                  f"{'peak alloc' if topo.device.type == 'cuda' else 'rss'} "
                  f"{peak_memory_mb(topo.device):,.0f} MB", flush=True)
    load_end = os.getloadavg()[0]
    for hook in phase_hooks:
        hook.remove()
    mean_losses = torch.stack(losses)
    if loss_rank is None:
        dist.all_reduce(mean_losses)
        mean_losses /= topo.world_size
    else:
        dist.broadcast(mean_losses, src=loss_rank)
    mean_losses = [] if dry_run() else mean_losses.tolist()  # a fake loss has no value
    diverged = [step for step, loss in enumerate(mean_losses, 1) if not math.isfinite(loss)]
    if diverged:  # a run that diverged is not a result, however fast it was
        raise FloatingPointError(f"the loss is not finite from step {diverged[0]} on: "
                                 f"lower --lr or use --dtype fp32")
    step_ms, p90, iqr = summarize_times(times[args.warmup:]) if not dry_run() else \
        (math.nan, math.nan, (math.nan, math.nan))  # none: its record nulls them
    return Stats(step_ms, p90, iqr, startup_s, sum(times[:args.warmup]), (load_start, load_end),
                 mean_losses, **measured)


def of_timed_steps(per_step: Sequence, args: argparse.Namespace) -> Sequence:
    """What a run kept a step (a pipeline's timelines), of its timed steps, those after the warm-
    up; a dry run's, its measured step's, the last it runs."""
    return per_step[args.warmup - 1:args.warmup] if dry_run() else per_step[args.warmup:]


def _measured_step(step: Callable[[], torch.Tensor], memory_of: Sequence, device: torch.device,
                   count_flops: bool = False) -> tuple[torch.Tensor, dict]:
    """Run the last warm-up step (optimizer state exists, nothing timed or traced); return its
    loss and the Stats fields it measures: its own peak memory and the MB this rank sent (in all
    and by kind). On CUDA the peak is the allocator's, reset just before (not the process's: the
    model before FSDP sharded it, compile workspaces); on CPU the live tensors' by kind
    (`peak_tensor_memory` of `memory_of`)."""
    memory = None
    flops = FlopCounterMode(display=False) if count_flops else \
        contextlib.nullcontext()
    with flops, CollectiveBytes() as sent:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            loss = step()
            _sync(device)
            memory = {"total": torch.cuda.max_memory_allocated(device) / 2**20}
        elif memory_of:
            loss, memory = peak_tensor_memory(step, memory_of, device)
        else:
            loss = step()
    return loss, {"memory": memory, "comm_mb": sent.bytes / 2**20,
                  "comm_mb_by_kind": {k: v / 2**20 for k, v in sent.by_kind.items()},
                  "comm_mb_by_group": {k: v / 2**20 for k, v in sent.by_group.items()},
                  "comm_by_op": {k: [sent / 2**20, calls] for k, (sent, calls) in
                                 sent.by_op.items()},
                  "flops": flops.get_total_flops() if count_flops else None}


# ==== Memory ======================================================================================
# A step's peak, and the state (parameters, gradients, optimizer) from the tensors.
def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak (max active) on GPU; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


MEMORY_KINDS = {"params": ("Parameter", "Buffer"), "grads": ("Gradient",),
                "optim": ("Optstate",), "activations": ("Activation",),
                "other": ("Temp", "Other")}


def peak_tensor_memory(step: Callable[[], object], tracked: Sequence, device: torch.device
                       ) -> tuple[object, dict[str, float]]:
    """Run `step` once; return its result and the peak of live tensor bytes during it, in MB,
    with its split at the peak by MEMORY_KINDS. Counted by PyTorch's MemTracker (a dispatch mode:
    every op's outputs, storages as FSDP resizes them), so neither PyTorch's own memory nor the
    allocator's cache is in it. What lives before counts from the start: `tracked` modules and
    optimizers by kind, other tensors (DDP's buckets) as `other`. Other threads' ops are unseen.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.nn.modules.module import register_module_forward_pre_hook

    # Two private methods are overridden where torch's public API (2.14) offers no way:
    # - ModTracker hooks the gradients of every module input that requires grad, and PyTorch
    #   refuses that hook for a leaf under `autograd.grad` (a stage's received activations in
    #   torch.distributed.pipelining's split backward); nothing public leaves such inputs out,
    #   nor gives a MemTracker another ModTracker than through its `_mod_tracker`.
    # - MemTracker relabels a storage labelled after it was made (a backward hook allocates a
    #   gradient bucket, then makes parameters' .grad views into it) in its current snapshot
    #   only, not in the peak snapshot taken while it was made; no public hook sees a relabel.
    #   It also updates every module's own peak at every op, a loop over the modules that
    #   `_update_peak_stats` runs and nothing here reads (a 70B model's step: minutes).
    # - MemTracker hooks the gradient of every parameter, and PyTorch refuses that hook on one
    #   that takes none (LoRA's frozen base): a placeholder where it looks for the hook skips it.
    class LeafSafeModTracker(ModTracker):
        def _fw_pre_hook(self, mod: nn.Module, inputs) -> None:
            super()._fw_pre_hook(mod, tuple(a for a in inputs if not (
                isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)))

    class PeakRelabellingTracker(MemTracker):
        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            current = self._curr_mem_snap.get(winfo.device, {})
            if old_reftype is not None and current.get("Total") == \
                    self._peak_mem.get(winfo.device):
                self._peak_mem_snap[winfo.device] = dict(current)

        def _update_peak_stats(self, peak_state) -> None:
            for device, current in self._curr_mem_snap.items():  # the peak alone: see below
                if self._peak_mem.get(device, 0) < current["Total"]:
                    self._peak_mem[device] = current["Total"]
                    self._peak_mem_snap[device] = dict(current)

        def _track_module_params_and_buffers(self, module: nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook, _NoHook))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    modules, tracker = LeafSafeModTracker(), PeakRelabellingTracker()
    tracker._mod_tracker = modules

    def forget_rerun_root(module: nn.Module, inputs) -> None:
        """MemTracker refuses a root module run twice (a pipeline stage, once per micro-batch)
        for its per-module stats, unused here: forget that module's before it starts again, and
        only its own (another stage of this rank may be between its forward and backward).
        Registered before the tracker's own hooks, so it runs first."""
        if module in tracker.memory_tracking and not modules.is_bw and \
                modules.parents - {modules.get_known_fqn(module)} == {"Global"}:
            del tracker.memory_tracking[module]

    # Every live tensor as `other` first (type(), not isinstance(): that reads __class__, which
    # some deprecated torch objects answer with a warning); tracking `tracked` after relabels
    # theirs by kind, and an optimizer's parameters and gradients count as params and grads even
    # when they are no module's (ZeRO's shards).
    gc.collect()  # garbage not yet collected (a reference cycle's tensors) is not live
    tracker.track_external(*[o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)])
    tracker.track_external(*tracked)
    tracker.track_external(*[nn.ParameterList(g["params"]) for opt in tracked
                             if isinstance(opt, torch.optim.Optimizer) for g in opt.param_groups])
    with register_module_forward_pre_hook(forget_rerun_root), tracker, \
            warnings.catch_warnings():
        # A hook that frees a gradient as soon as it is reduced (ZeRO-2) leaves MemTracker's own
        # post-accumulate hook, which runs after it, nothing to label; it warns and goes on.
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        result = step()
    peak = {str(getattr(k, "value", k)): v
            for k, v in tracker.get_tracker_snapshot("peak").get(device, {}).items()}
    split = {kind: sum(peak.get(name, 0) for name in names) / 2**20
             for kind, names in MEMORY_KINDS.items()}
    return result, {"total": peak.get("Total", 0) / 2**20, **split}


class _NoHook:
    """What `peak_tensor_memory` files as a frozen parameter's gradient hooks: none to remove."""

    @staticmethod
    def remove() -> None:
        pass


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data here: a DTensor's shard, a wrapper's inner tensors."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _plain(getattr(t, name))]
    return [t]


def tensor_mb(tensors: Iterable[torch.Tensor]) -> float:
    """MB of the distinct storages holding `tensors`: a buffer reached twice (a tied weight, views
    into ZeRO's flat parameters) counts once, padding included; a freed (resized) one, nothing."""
    seen, total = set(), 0
    for t in (p for tensor in tensors for p in _plain(tensor)):
        storage = t.untyped_storage()
        # the storage's own identity, which a fake one (a dry run's) has too; it has no address
        if storage.nbytes() and storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total / 2**20


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None
                   ) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    if optimizer is not None:  # ZeRO's shards are the optimizer's parameters, not the model's
        params += [p for group in optimizer.param_groups for p in group["params"]]
    optim = [] if optimizer is None else [v for state in optimizer.state.values()
                                          for v in state.values() if torch.is_tensor(v)]
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
            "optim": optim}


def state_mb(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> float:
    """Per-rank parameters + gradients + optimizer state, counted from the tensors themselves."""
    return tensor_mb(t for kind in _state_tensors(model, optimizer).values() for t in kind)


def state_split_mb(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> dict[str, float]:
    """`state_mb` split: {"params_mb", "grads_mb", "optim_mb"}."""
    return {f"{kind}_mb": tensor_mb(tensors)
            for kind, tensors in _state_tensors(model, optimizer).items()}


# ==== Tracing =====================================================================================
# Steps and phases as ranges (torch.profiler, NVTX), profiler traces, a pipeline's timeline.
@contextlib.contextmanager
def step_range(i: int, device: torch.device, named: bool):
    """Step `i` as a range: `ProfilerStep#i` in a trace (`named`: the name torch.profiler, HTA and
    report/traces.py split iterations by) and, on CUDA, NVTX `step i` for `nsys profile`."""
    with contextlib.ExitStack() as stack:
        if named:
            stack.enter_context(torch.profiler.record_function(f"ProfilerStep#{i}"))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.nvtx.range(f"step {i}"))
        yield


def nvtx_phase_ranges(memory_of: Sequence) -> list:
    """NVTX ranges `forward` and `optimizer` from hooks on the modules and optimizers given (the
    backward lies between them; a pipeline's stages, never called whole, get no `forward`).
    Returns the handles. The hooks return None, not range_push's depth: a hook's return value
    would replace the module's inputs or output, or the optimizer's arguments."""
    def push(name: str) -> Callable:
        def hook(*_) -> None:
            torch.cuda.nvtx.range_push(name)
        return hook

    def pop(*_) -> None:
        torch.cuda.nvtx.range_pop()

    handles = []
    for thing in memory_of:
        if isinstance(thing, nn.Module):
            handles += [thing.register_forward_pre_hook(push("forward")),
                        thing.register_forward_hook(pop)]
        elif isinstance(thing, torch.optim.Optimizer):
            handles += [thing.register_step_pre_hook(push("optimizer")),
                        thing.register_step_post_hook(pop)]
    return handles


def _start_profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True)  # bytes moved
    profiler.start()
    return profiler


def _stop_profiler(profiler: torch.profiler.profile, args: argparse.Namespace,
                   topo: Topology) -> None:
    # A collective the step left in flight (ZeRO's all-gathers, waited for in the next forward)
    # keeps the profiler's thread-local state until it runs; if that is after stop(), dropping
    # its handle crashed (torch 2.14, gloo). gloo's barrier waits for every earlier collective.
    dist.barrier()
    profiler.stop()
    _export_trace(profiler, args, topo)


def _export_trace(profiler: torch.profiler.profile, args: argparse.Namespace,
                  topo: Topology) -> None:
    folder, script = _script_identity()
    # a variant's flags in the name, as its log's: `optimized_zero_pytorch--stage3`
    variant = re.sub(r"[^\w.-]", "", getattr(args, "variant", None) or "")
    path = args.results.parent / "traces" / f"{folder}_{script}{variant}_rank{topo.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    log(topo, f"trace of warm-up steps {args.warmup - 2}-{args.warmup - 1} written to {path} "
              f"(one file per rank; open in https://ui.perfetto.dev)")


# ==== Records and outcomes ========================================================================
# One JSON line per run, appended by rank 0; a run that skips or fails leaves one too.
@dataclass
class RunState:
    """How far this process's run got, for `run_main` to record a run that ends without a
    result: the flags, set by the shared parser's `parse_args` (a run that skips before `setup`
    is recorded too), and the topology, set by `setup`. Those two write it, `run_main` reads it;
    a trainer that calls neither leaves it empty, and a failure is then not recorded."""

    args: argparse.Namespace | None = None
    topo: Topology | None = None
    fake_mode: TorchDispatchMode | None = None  # a dry run's FakeTensorMode, on while it runs
    stand_ins: dict[str, str] = field(default_factory=dict)  # a dry run's, by what they replace


run_state = RunState()  # this process's: a process runs one recipe


def _script_identity() -> tuple[str, str]:
    path = Path(sys.argv[0]).resolve()
    return path.parent.name, path.stem


def _installed_version(package: str) -> str | None:
    """From the package's metadata, without importing it; None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def base_record(args: argparse.Namespace | None, topo: Topology | None, baseline: str | None,
                status: str, reason: str | None) -> dict:
    folder, script = _script_identity()
    # before `setup` (a run that skipped or failed first), what setup would have picked
    cuda = topo.device.type == "cuda" if topo else torch.cuda.is_available()
    nccl = topo.backend == "nccl" if topo else cuda
    return {
        "folder": folder, "script": script, "baseline": baseline, "status": status,
        "reason": reason,
        "world_size": topo.world_size if topo else launch_world_size(),
        "nnodes": topo.nnodes if topo else None,
        "backend": topo.backend if topo else "nccl" if nccl else "gloo",
        "device": torch.cuda.get_device_name(topo.device if topo else None) if cuda else "cpu",
        "size": getattr(args, "size", None), "model": getattr(args, "model", None),
        "variant": getattr(args, "variant", None),
        "link": os.environ.get("PLAYBOOK_LINK") or None,  # set by `make ... LINK=1gbit`
        "torch": torch.__version__,
        # the other packages whose release changes what a recipe computes (float8, ResNet)
        "torchao": _installed_version("torchao"),
        "torchvision": _installed_version("torchvision"),
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if nccl else None,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def load_results(path: Path) -> list[dict]:
    """Every record of a results file: for 04_zero's `--summary`, and for report/."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial line; skip it, keep the rest
    return records


def run_key(rec: dict) -> tuple:
    """What two records must share to be compared: folder, size, model, world, device, link."""
    return (rec.get("folder"), rec.get("size"), rec.get("model"), rec.get("world_size"),
            rec.get("device"), rec.get("link"))


def record(args: argparse.Namespace, topo: Topology, stats: Stats, *, baseline: str | None,
           model: nn.Module, optimizer: torch.optim.Optimizer | None, comm_mb: float | None,
           theory: dict, loss_tolerance: float | None = None, dp_world: int | None = None,
           overlapped: Mapping[str, str] | None = None, **extra) -> dict:
    """Append this run's result (rank 0) and print its summary; `dp_world` as `timed_steps`'.
    `note=`: what the host changed of the run's settings (a mesh without dp, weights not
    gathered in float8), in one line: the summary line ends with it, the report shows it.
    `overlapped`: the collectives the technique runs under compute, as the step-time model
    reads them ({"allreduce": "backward"}: DDP's buckets; report/costmodel.py's
    OVERLAP_WINDOWS)."""
    items = items_per_step(args, dp_world or topo.world_size)
    # The report shows the busiest rank: on CPU the one with the most live tensor bytes, and the
    # most state (a pipeline's ranks hold stages of different sizes).
    ranks = [None] * topo.world_size
    mine = (peak_memory_mb(topo.device), stats.memory, state_mb(model, optimizer))
    if dry_run():  # the rank played is the only one there is
        ranks = [mine]
    else:
        dist.all_gather_object(ranks, mine)
    allocator_peak = max(peak for peak, _, _ in ranks)
    memory = max((m for _, m, _ in ranks if m), key=lambda m: m["total"], default=None)
    # a pipeline stage's layers run once a micro-batch: its share of the layers, m times
    mesh = extra.get("mesh") if isinstance(extra.get("mesh"), dict) else {}
    stages = mesh.get("pp") or (topo.world_size if "microbatches" in extra else 1)
    work = step_work(args, topo, stats, model, optimizer, dp_world or topo.world_size,
                     overlapped or {}, bool(extra.get("checkpointing")),
                     theory.get("bubble", theory.get("bubble_uniform", 0.0)),
                     extra.get("microbatches", 1) / stages, extra.get("cp", 1),
                     theory.get("attention_busiest", 1.0))
    rec = base_record(args, topo, baseline, "ok", None)
    rec.update({
        "params": sum(p.numel() for p in model.parameters()),  # a tied weight counts once
        "step_ms": round(stats.step_ms, 3), "step_ms_p90": round(stats.step_ms_p90, 3),
        "step_ms_iqr": [round(q, 3) for q in stats.step_ms_iqr],
        # the host's: the load average counts every runnable task on it, as cpu_count counts
        # every core (a container's affinity may list fewer)
        "load_avg": [round(load, 2) for load in stats.load_avg], "cpus": os.cpu_count(),
        ("samples_per_s" if args.model == "resnet" else "tokens_per_s"):
            round(items / (stats.step_ms / 1e3), 1),
        "peak_mem_mb": round(memory["total"] if memory else allocator_peak, 1),
        "state_mb": round(max(state for _, _, state in ranks), 2),
        "comm_mb": None if comm_mb is None else round(comm_mb, 3),
        "losses": [round(x, 6) for x in stats.losses],
        "loss_tolerance": loss_tolerance,
        "theory": {k: round(v, 3) if isinstance(v, float) else v for k, v in theory.items()},
        "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size,
        "seed": args.seed, "lr": args.lr,
        "seq_len": None if args.model == "resnet" else args.seq_len, "dtype": args.dtype,
        "startup_s": round(stats.startup_s, 2), "warmup_s": round(stats.warmup_s, 2),
        # what the step did, for the report to price (report/costmodel.py: predicted_step_ms)
        "work": work,
        "comm_by_op": {op: [round(mb, 3), calls] for op, (mb, calls) in
                       (stats.comm_by_op or {}).items()},
    })
    if topo.device.type == "cuda":
        rec["reserved_mb"] = round(torch.cuda.max_memory_reserved(topo.device) / 2**20, 1)
    else:
        rec["peak_rss_mb"] = round(allocator_peak, 1)
    if memory and len(memory) > 1:  # the split by kind, counted from the tensors (CPU)
        rec["memory"] = {k: round(v, 2) for k, v in memory.items() if k != "total"}
    rec.update(extra)
    if dry_run():
        _as_dry_run(rec, topo, stats, sum(t.numel() for t in stepped_tensors(model, optimizer)),
                    state_split_mb(model, optimizer))
        append_record(args.results, rec)
        return rec
    if topo.is_main:
        append_record(args.results, rec)
        unit = "img/s" if args.model == "resnet" else "tok/s"
        comm = "" if comm_mb is None else f", comm {comm_mb:.2f} MB/step"
        variant = f"{rec['variant']}, " if rec["variant"] else ""  # which of a script's runs
        print(f"{rec['script']}: {variant}{stats.step_ms:.1f} ms/step "
              f"(p90 {stats.step_ms_p90:.1f}), {items / (stats.step_ms / 1e3):,.0f} {unit}, "
              f"peak {'alloc' if topo.device.type == 'cuda' else 'tensors'} "
              f"{rec['peak_mem_mb']:,.0f} MB, "
              f"state {rec['state_mb']:.1f} MB{comm}, final mean loss {stats.losses[-1]:.4f}"
              + (f"; {rec['note']}" if rec.get("note") else ""), flush=True)
    return rec


def _as_dry_run(rec: dict, topo: Topology, stats: Stats, stepped_params: int,
                state: dict[str, float]) -> None:
    """A dry run's record: no times, losses or throughput (fake tensors have none), and what it
    played (`dry_run`: world, rank, device, stand-ins; the step's work a GPU's would be priced
    by: FLOPs, the parameters stepped, the MB sent within a node of DRY_RUN_GPUS_PER_NODE and
    across nodes; the host's time and memory; `beyond_state_mb`, the peak less the state alive
    at it: the weights and optimizer state, and of the gradients (`state`'s, state_split_mb)
    those made by then; `gathered_mb`, the parameters at the peak beyond the state's: weights
    held gathered as parameters, FSDP2's unsharded ones); its summary line. The rank played
    writes it. The peak is the GPU's: what a run keeps in host memory (offload's
    `host_state_mb`), on the CPU device the dry run computes on, is left out of it."""
    for key in ("step_ms", "step_ms_p90", "step_ms_iqr", "tokens_per_s", "samples_per_s"):
        if key in rec:
            rec[key] = None
    rec["peak_mem_mb"] = round(rec["peak_mem_mb"] - rec.get("host_state_mb", 0.0), 1)
    rec["steps"] = 0  # it ends at its measured step, the last of its warm-up
    grads_mb = state["grads_mb"]
    grads_at_peak = rec.get("memory", {}).get("grads", grads_mb)
    sent = {"node": 0.0, "network": 0.0}
    for name, mb in (stats.comm_mb_by_group or {}).items():
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
        nodes = {rank // DRY_RUN_GPUS_PER_NODE for rank in ranks}
        sent["node" if len(nodes) == 1 else "network"] += mb
    rec["dry_run"] = {"world": topo.world_size, "rank": topo.rank, **DRY_RUN_DEVICE,
                      "stand_ins": dict(run_state.stand_ins), "flops": stats.flops,
                      "stepped_params": stepped_params,
                      "beyond_state_mb": round(rec["peak_mem_mb"] - rec["state_mb"] + grads_mb
                                               - min(grads_at_peak, grads_mb), 1),
                      "gathered_mb": round(max(0.0, rec.get("memory", {}).get("params", 0.0)
                                               - state["params_mb"]), 1),
                      "sent_mb": {where: round(mb, 3) for where, mb in sent.items()},
                      "host_s": round(time.perf_counter() - _IMPORTED_AT, 2),
                      "host_rss_mb": rec.pop("peak_rss_mb")}
    split = ", ".join(f"{kind} {mb:,.0f}" for kind, mb in rec.get("memory", {}).items())
    print(f"{rec['script']}: dry run as rank {topo.rank} of {topo.world_size}"
          + (f" ({rec['variant']})" if rec["variant"] else "")
          + f": peak {rec['peak_mem_mb']:,.0f} MB ({split}), state {rec['state_mb']:,.1f} MB, "
          f"comm {rec['comm_mb'] or 0:,.2f} MB/step, {(stats.flops or 0) / 1e12:,.2f} TFLOP/step, "
          f"{rec['dry_run']['host_s']:.1f} s on this host", flush=True)


def log(topo: Topology, message: str) -> None:
    if topo.is_main:
        print(message, flush=True)


class Skip(Exception):
    """The machine lacks what the recipe needs: recorded `skipped`, exit 0."""


class SetupError(Exception):
    """The run cannot start as launched (more processes than GPUs, say): recorded `failed`, one
    line that says what to change, exit 2, as a bad flag."""


def run_main(main: Callable[[], None]) -> None:
    """Run a recipe: skipped and failed runs leave a record too; the group is torn down. As the
    script itself, a run then skips the interpreter's teardown, where ranks have aborted in C++
    after a good run ("terminate called without an active exception", gloo). A closed stdout
    (`... | head -5`) drops the prints that follow, not the run."""
    faulthandler.enable()
    stdout, sys.stdout = sys.stdout, _StdoutThatDropsWhenClosed(sys.stdout)
    try:
        main()
    except Skip as why:
        _record_outcome("skipped", str(why))
        if launch_rank() == 0:
            print(f"skipped: {why}", file=sys.stderr)
    except SetupError as why:
        _record_outcome("failed", str(why))
        if launch_rank() == 0:
            print(f"{Path(sys.argv[0]).name}: error: {why}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        _record_outcome("failed", reason)
        # the one line the Makefile shows on the terminal (the traceback stays in the log)
        print(f"rank {launch_rank()} failed: {reason}", file=sys.stderr, flush=True)
        raise
    finally:
        if run_state.fake_mode is not None:
            run_state.fake_mode.__exit__(None, None, None)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()  # what is left, through the wrapper: to a closed stdout, dropped
        sys.stdout = stdout
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file and Path(main_file).resolve() == Path(sys.argv[0]).resolve():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _record_outcome(status: str, reason: str) -> None:
    """Rank 0 records a run that ends without a result, also before `setup`."""
    args, topo = run_state.args, run_state.topo
    if args is not None and launch_rank() == 0:
        append_record(args.results, base_record(args, topo, None, status, reason))


class _StdoutThatDropsWhenClosed:
    """sys.stdout while `run_main` runs a recipe. Once its reader has gone (`| head`), a print
    would raise BrokenPipeError and fail a run that trains well; instead the stream's descriptor
    is pointed at /dev/null, where what it buffered and every later print go."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop_the_rest()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop_the_rest()
            self.stream.flush()  # what it still buffered, now into /dev/null

    def _drop_the_rest(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)
