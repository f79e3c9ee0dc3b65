"""DDP at long context, attention written out: the T x T score matrix is materialised.

What it does: data-parallel training on long sequences, with DDP wrapped exactly as in
optimized_ddp_flash.py (buckets of one block's gradients, gradients as views into them) and
attention computed the textbook way: softmax(mask(Q K^T / sqrt(d))) V. Every layer builds the
full (batch, heads, T, T) score matrix, keeps the softmax output for backward, and makes
several T x T temporaries on the way.
Why it is the baseline: it is the attention most people write first and it is exact; at long
context its memory grows with T^2 and its time is spent streaming those matrices through memory.
Run:        torchrun --nproc_per_node=2 01_ddp/baseline_ddp_flash.py --size small [--model llama]
Look for:   peak MB and step ms against optimized_ddp_flash in `make ddp report`; the record's
            `theory.attn_saved_mb` is the score memory this script holds for backward.
Theory:     attention keeps n_layers x batch x heads x T^2 x 4 bytes of fp32 softmax output for
            backward (6 under bf16 autocast, plus transient copies); FLOPs are the same as the
            fused kernel's forward.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


def materialized_attention(q, k, v):
    """Causal attention with the (B, H, T, T) scores in memory. Shapes (B, H, T, head_dim)."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# Copied from 01_ddp/optimized_ddp.py: wrap_ddp, changed: no --accum, and no static graph
def wrap_ddp(model: torch.nn.Module, topo: common.Topology, bucket_mb: float,
             group: dist.ProcessGroup | None = None) -> DDP:
    """DDP for long context. With O(T) attention activations the gradients are a large share of
    the peak, so each .grad is a view into its bucket (one gradient-sized copy less); buckets of
    one block's gradients let a block's all-reduce start as soon as its backward ends and run
    under the next block's. Over the ranks of `group` (None: the world), from its first rank's
    weights."""
    return DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
               process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)


def attention_saved_mb(args) -> float:
    """Score memory every layer keeps for backward, per rank: the fp32 softmax output, plus
    under bf16 autocast the bf16 copy of it that the second matmul saves (6 bytes a score)."""
    size = common.SIZES[args.size]
    scores = size.n_layers * args.batch_size * size.n_heads * args.seq_len**2
    return scores * (4 if args.dtype == "fp32" else 6) / 2**20


def block_gradient_mb(block: torch.nn.Module) -> float:
    """One transformer block's gradient bytes: the bucket size that aligns buckets with blocks."""
    return sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20


def main():
    parser = common.parser(__doc__, long_context=True, skips={
        "resnet": "a ResNet has no attention: the attention recipes run --model gpt or llama"})
    parser.add_argument("--bucket-mb", type=common.positive_float, default=None,
                        help="gradient bucket size in MiB (default: one block's gradients)")
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo, attention=materialized_attention)
    bucket_mb = args.bucket_mb or block_gradient_mb(common.transformer_blocks(model)[0])
    model = wrap_ddp(model, topo, bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    buckets = common.ddp_bucket_bytes(model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    common.record(args, topo, stats, baseline=None, model=model.module,
                  overlapped=common.DDP_OVERLAP,
                  optimizer=opt, comm_mb=common.ring_allreduce_mb(sum(buckets), topo.world_size),
                  collectives_per_step=len(buckets), bucket_mb=round(bucket_mb, 2),
                  theory={"attn_saved_mb": attention_saved_mb(args),
                          "comm_mb": common.ring_allreduce_mb(grad_bytes, topo.world_size)})


if __name__ == "__main__":
    common.run_main(main)
