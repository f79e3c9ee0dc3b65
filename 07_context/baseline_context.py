"""Data parallelism at long context: every rank trains whole sequences, the memory wall.

What it does: DDP on long sequences, as the context-parallel scripts train them (buckets of one
block's gradients, gradients as views into them), with PyTorch's fused causal attention. Each
rank holds whole sequences, so everything a layer saves for backward grows with the sequence
length T, and one sequence of T tokens is the least a rank can hold.
Why it is the baseline: it is what trains long sequences until they no longer fit. Raising T
raises every rank's activations with it (linearly with a fused attention, quadratically with a
written-out one), and adding ranks does not help: they only take more sequences.
Run:        torchrun --nproc_per_node=2 07_context/baseline_context.py --size small
Look for:   `make context report`: peak MB per rank against the ring and Ulysses at the same
            tokens per rank; the memory table (sequence length against peak) in the README.
Theory:     activations a rank saves for backward: tokens x (17 x d_model + heads) values a GPT
            block (a Llama's: 9 x d_model + 4 x ffn + heads + 2), plus the loss's logits; the
            attention's forward FLOPs 2 x 2 x T^2/2 x d_model a layer and sequence (causal), all
            on the rank that holds the sequence. DDP sends 2(N-1)/N x gradient bytes a step.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


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


# --- Theory: what the run predicts from its shapes -----------------------------------------------
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


def attention_flops(positions: torch.Tensor, d_model: int) -> float:
    """Forward FLOPs of causal attention for the queries at `positions` of one sequence: query p
    takes the dot products with, and the weighted sum of, the p + 1 keys at or before it, 2 x 2
    x d_model FLOPs a key. Where the queries sit decides the work: the late ones cost most."""
    return 4.0 * d_model * float((positions.double() + 1).sum())


# Copied from 01_ddp/baseline_ddp_flash.py: block_gradient_mb
def block_gradient_mb(block: torch.nn.Module) -> float:
    """One transformer block's gradient bytes: the bucket size that aligns buckets with blocks."""
    return sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20


def theory(args, world: int, grad_bytes: int) -> dict[str, float]:
    """What the run predicts from its shapes: a rank's activations and attention GFLOP over its
    whole sequences, and DDP's bytes."""
    size = common.SIZES[args.size]
    attention_gflop = args.batch_size * size.n_layers * attention_flops(
        torch.arange(args.seq_len), size.d_model) / 1e9
    return {"activations_mb": activation_mb(args, args.batch_size * args.seq_len),
            "attention_gflop": attention_gflop,
            "comm_mb": common.ring_allreduce_mb(grad_bytes, world)}


def main():
    parser = common.parser(__doc__, long_context=True, skips={
        "resnet": "a ResNet has no sequence to split: context parallelism runs --model gpt or "
                  "llama"})
    parser.set_defaults(steps=8, warmup=3)  # the folder's: `make context` launches 16 runs
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    model = wrap_ddp(model, topo, block_gradient_mb(common.transformer_blocks(model)[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP, comm_mb=stats.comm_mb,
                  theory=theory(args, topo.world_size, grad_bytes))


if __name__ == "__main__":
    common.run_main(main)
