"""Context parallelism with PyTorch's own `context_parallel`: ring attention behind plain SDPA.

What it does: torch.distributed.tensor.experimental.context_parallel, as torchtitan uses it.
Within its context every `F.scaled_dot_product_attention` call is swapped for a ring attention
over the cp ranks, and the buffers handed to it (tokens, targets, positions) are cut along the
sequence in place: by default head-tail (T in 2 x cp chunks, rank r keeping chunks r and
2cp-1-r, common.sequence_positions' zigzag), so causal work is even. Each layer's forward
all-gathers K and V from the cp ranks (`--rotate alltoall`: passes them round the ring
instead, torch's set_rotate_method) and merges the partial outputs by their log-sum-exp;
backward gathers K and V again and passes their gradients round the ring. The model is
unchanged: its attention is one plain SDPA call (a Llama's K and V repeated to the query heads
first: context_parallel's GQA support is not relied on). DDP averages gradients over dp x cp.
CUDA only: on CPU no SDPA backend runs under it (flash: no sharding strategy registered for
_scaled_dot_product_flash_attention_for_cpu; math: a DTensor mixed with a Tensor), so CPU skips.
Why it helps: T/cp tokens of each sequence a rank, as optimized_context_ring.py, with no
attention code of one's own; any head count.
Run:        torchrun --nproc_per_node=2 07_context/optimized_context_pytorch.py --size medium
            [--cp 2] [--rotate alltoall] [--model llama]
Look for:   `make context report` on GPUs: losses within bf16's tolerance of baseline_context,
            peak MB against the hand-written ring's and Ulysses'.
Theory:     a rank sends per layer (cp-1) x its K and V in forward and again in backward
            (all-gathered, or passed on cp-1 times: the same bytes) and, backward, cp passes of
            its fp32 K and V gradients to the next rank; plus DDP's 2(N-1)/N x gradient bytes.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# fp32: the same attention, merged from cp partial softmaxes by their log-sum-exp: sums in another
# order. bf16 (the CUDA default): each partial output rounds to bf16's resolution, and the losses
# drift by it, as exact techniques do in bf16.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
# No planner row: the planner's context-parallel row is the hand-written ring's; this is the same
# technique in torch's code.
PLANNED = []

CPU_FAILURE = ("torch's context_parallel runs SDPA on CUDA only: on CPU its flash kernel has no "
               "sharding strategy and the math one mixes DTensor and Tensor: run on GPUs")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's attention: plain causal SDPA, looked up in torch.nn.functional at each call, so
    that inside `context_parallel` the ring attention it patched in runs. Equal head counts (no
    `takes_kv_heads`): a Llama repeats its K and V to the query heads first."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cp_problem(cp: int, world: int, seq_len: int) -> str | None:
    """Why cp ranks of a world cannot cut sequences of `seq_len` tokens head-tail (None: they
    can). Without 2 x cp equal chunks torch falls back to contiguous ones, unbalanced: refused."""
    if world % cp:
        return f"--cp {cp} does not divide the world size {world}: use a divisor of it"
    if seq_len % (2 * cp):
        return (f"--seq-len {seq_len} does not cut into {2 * cp} equal chunks (2 a rank of --cp "
                f"{cp}, head-tail): use a multiple of {2 * cp}")
    return None


def default_cp(world: int, seq_len: int) -> int:
    """The world, or where it cannot be cp, its largest divisor that can."""
    return max(cp for cp in range(1, world + 1) if cp_problem(cp, world, seq_len) is None)


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
def context_parallel_mb(layers: int, tokens: int, heads: int, head_dim: int, cp: int,
                        value_bytes: int) -> dict[str, float]:
    """MB a rank sends a step in torch's ring attention, `tokens` its own (batch x T/cp), K and V
    of `heads` heads each: K and V per layer in forward and again in backward, (cp-1) x this
    rank's (all-gathered, or passed cp-1 times round the ring: the same bytes), and cp passes of
    their fp32 gradients (torch accumulates them in fp32) to the next rank in backward."""
    kv = 2 * tokens * heads * head_dim
    return {"kv_allgather_mb": layers * 2 * (cp - 1) * kv * value_bytes / 2**20,
            "dkv_rotate_mb": layers * cp * kv * 4 / 2**20}


# Copied from 01_ddp/baseline_ddp_flash.py: block_gradient_mb
def block_gradient_mb(block: torch.nn.Module) -> float:
    """One transformer block's gradient bytes: the bucket size that aligns buckets with blocks."""
    return sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20


def theory(settings, world: int, cp: int, grad_bytes: int) -> dict[str, float]:
    """The bytes a rank sends a step: DDP's all-reduce and torch's ring (context_parallel_mb)."""
    size = common.SIZES[settings.size]
    predicted = context_parallel_mb(size.n_layers, settings.batch_size * settings.seq_len // cp,
                                    size.n_heads, size.d_model // size.n_heads, cp,
                                    2 if settings.dtype == "bf16" else 4)
    return {"comm_mb": common.ring_allreduce_mb(grad_bytes, world) + sum(predicted.values()),
            **predicted}


def main():
    parser = common.parser(__doc__, long_context=True, skips={
        "resnet": "a ResNet has no sequence to split: context parallelism runs --model gpt or "
                  "llama"})
    parser.add_argument("--cp", type=common.int_at_least(1), default=None,
                        help="ranks that share each sequence: divides the world, and 2 x cp "
                             "divides --seq-len (default: the world, or its largest divisor "
                             "that does)")
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                        help="how K and V reach the other cp ranks: all-gathered once a layer "
                             "(torch's default) or passed round the ring")
    parser.set_defaults(steps=8, warmup=3)  # the folder's: `make context` launches 16 runs
    parser.set_defaults(batch_size=0)  # default: the baseline's global batch (below)
    args = parser.parse_args()
    world = common.launch_world_size()
    cp = args.cp or default_cp(world, args.seq_len)
    if why := cp_problem(cp, world, args.seq_len):
        parser.error(why)
    if not torch.cuda.is_available():
        raise common.Skip(CPU_FAILURE)
    if cp == 1 and world > 1:
        raise common.Skip(f"no cp > 1 divides the world size {world} with 2 x cp dividing "
                          f"--seq-len {args.seq_len}: launch another world")
    size = common.SIZES[args.size]
    # a dp rank's cp ranks share its sequences: the baseline's global batch and tokens per rank
    settings = common.resolved(args, batch_size=args.batch_size or size.long_batch_size * cp)
    topo = common.setup(settings)
    set_rotate_method(args.rotate)
    mesh = init_device_mesh(topo.device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    model, batches = common.workload(settings, topo, attention=sdpa,
                                     dp_rank=mesh.get_local_rank("dp"), dp_world=world // cp)
    model = wrap_ddp(model, topo, block_gradient_mb(common.transformer_blocks(model)[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        # the dp rank's whole sequences, cut in place to this rank's share (copies: the step's
        # batch stays whole), positions with them
        inputs, targets = inputs.clone(), targets.clone()
        positions = torch.arange(settings.seq_len, device=topo.device)
        shared = [inputs, targets, positions]
        with context_parallel(mesh["cp"], buffers=shared, buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers=set(shared)):
            loss = model(inputs, targets, positions)
            loss.backward()  # inside: the backward's SDPA is the ring's too
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(model, opt),
                               dp_world=world // cp)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # counted: the all-gathers; not: the ring passes (a functional all_to_all_single, which
    # common.CollectiveBytes does not count)
    kv_allgather_mb = sum(mb for kind, mb in stats.comm_mb_by_kind.items()
                          if kind.startswith("all_gather_into_tensor"))
    common.record(recorded_settings(settings, cp), topo, stats, baseline="baseline_context",
                  overlapped=common.DDP_OVERLAP,
                  model=model.module, optimizer=opt, comm_mb=stats.comm_mb, cp=cp,
                  rotate=args.rotate, loss_tolerance=LOSS_TOLERANCE[args.dtype],
                  **({"kv_allgather_mb": round(kv_allgather_mb, 3)}
                     if args.rotate == "allgather" else {}),
                  note="comm MB counts no ring pass (torch's dK/dV: theory dkv_rotate_mb"
                       + (", and K/V" if args.rotate == "alltoall" else "") + ")",
                  theory=theory(settings, world, cp, grad_bytes))


if __name__ == "__main__":
    common.run_main(main)
