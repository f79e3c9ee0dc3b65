"""Tensor parallelism with sequence parallelism, by hand, each collective blocking: the baseline
for async TP through symmetric memory.

What it does (Megatron-LM's split): every rank holds 1/N of each block's heads and MLP units,
all N ranks train one model on one batch. In a block, attention's qkv and the MLP's fc are
column-parallel (my rows: my heads' q, k, v, my hidden units), proj and fc_proj row-parallel (my
columns); each rank's output is a partial sum. Between blocks the activations are split along
the sequence (sequence parallelism: rank r holds tokens r*T*B/N.. of the sequence-major
(T, B) grid), so the norms and residual adds are 1/N each. Before a column-parallel linear an
all-gather of the sequence shards, after a row-parallel one a reduce-scatter into them;
backward is the mirror image (the input's gradient reduce-scattered, the output's gathered).
Embeddings, final norm and the tied head are replicated, each rank running them on its own
tokens: with sequence parallelism a replicated head does no duplicate work, and at this vocab
(1K) a vocab-parallel loss would cost more collectives than the one all-reduce of the
replicated parts' gradients. Heads and units that do not divide by N split unevenly.
Why: a model whose layers do not fit one GPU's memory, or a batch too small to split, still
spreads over the GPUs of a node; the cost is 8 collectives of the activations per block.
Run:        torchrun --nproc_per_node=2 06_symmem/baseline_symmem_tp.py --size small
Look for:   `make symmem report`: the step time optimized_symmem_tp.py beats; losses equal to
            baseline_symmem_training's at the same global batch (N x 4 sequences).
Theory:     comm MB/step: per block 4 all-gathers and 4 reduce-scatters of T x B x d values
            (4 bytes, 2 in bf16), (N-1)/N each, plus an all-reduce of the replicated gradients.
            state: 16 bytes a parameter, of the blocks' 1/N (by heads and units) plus the
            replicated parts.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Per step, against the data-parallel baseline: row-parallel outputs are summed over ranks in
# another order than one matmul's, so fp32 rounding, compounded over the steps by AdamW. Under
# bf16 autocast each rank's partial sum is rounded to bf16 (8 bits) before the sum, where one
# matmul rounds once: the losses drift by bf16's resolution, as other exact techniques' do.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
SHARDED = ("qkv.weight", "qkv.bias", "proj.weight", "fc.weight", "fc.bias", "fc_proj.weight")


class ProcessGroupCollectives:
    """TP's two communicating matmuls, through the process group: the collective, whole, then
    the matmul. `b` is the weight as (in, out)."""

    def __init__(self, world: int):
        self.world = world

    def all_gather_matmul(self, shard: torch.Tensor, b: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = shard.new_empty(self.world * shard.shape[0], shard.shape[1])
        common.all_gather_single(gathered, shard)
        return gathered, gathered @ b

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        partial = a @ b
        out = partial.new_empty(partial.shape[0] // self.world, partial.shape[1])
        common.reduce_scatter(out, partial)
        return out


# Copied from 06_symmem/optimized_symmem_tp.py: compute_dtype
def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would multiply in: a custom Function's matmuls cast by hand, so that
    backward (outside autocast) sees the same dtypes."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


# Copied from 06_symmem/optimized_symmem_tp.py: ColumnParallel
class ColumnParallel(torch.autograd.Function):
    """y = gather(x) @ W^T + b on my output rows. Backward: dW = dy^T gather(x) (the gathered
    input is kept), and dx, a partial sum on each rank, reduce-scattered to the shards."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        dtype = compute_dtype(x)
        weight = weight.to(dtype)
        gathered, y = comm.all_gather_matmul(x.to(dtype), weight.t())
        ctx.save_for_backward(gathered, weight)
        ctx.comm = comm
        return y + bias.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dx = ctx.comm.matmul_reduce_scatter(dy, weight)
        return dx, dy.t() @ gathered, dy.sum(0), None


# Copied from 06_symmem/optimized_symmem_tp.py: RowParallel
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
        gathered, dx = ctx.comm.all_gather_matmul(dy.contiguous(), weight)
        return dx, gathered.t() @ x, None


# Copied from 06_symmem/optimized_symmem_tp.py: my_share
def my_share(total: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of `total` items: sizes differ by one at most."""
    return slice(total * rank // world, total * (rank + 1) // world)


# Copied from 06_symmem/optimized_symmem_tp.py: TensorParallelBlock
class TensorParallelBlock(nn.Module):
    """common.Block with my heads and hidden units only: the same weights, sliced."""

    def __init__(self, block: common.Block, n_heads: int, rank: int, world: int, comm):
        super().__init__()
        d, self.comm = block.ln1.normalized_shape[0], comm
        self.head_dim, heads = d // n_heads, my_share(n_heads, rank, world)
        cols = torch.arange(heads.start * self.head_dim, heads.stop * self.head_dim)
        rows = torch.cat([cols + k * d for k in range(3)])  # my heads' q, k and v
        units = my_share(4 * d, rank, world)
        self.ln1, self.ln2, self.attn, self.fc, self.fc_proj = (
            block.ln1, block.ln2, block.attn, block.fc, block.fc_proj)
        for linear, kept in ((block.attn.qkv, rows), (block.fc, units)):  # column-parallel
            linear.weight = nn.Parameter(linear.weight.detach()[kept].clone())
            linear.bias = nn.Parameter(linear.bias.detach()[kept].clone())
        for linear, kept in ((block.attn.proj, cols), (block.fc_proj, units)):  # row-parallel
            linear.weight = nn.Parameter(linear.weight.detach()[:, kept].clone())

    def forward(self, x: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
        qkv = ColumnParallel.apply(self.ln1(x), self.attn.qkv.weight, self.attn.qkv.bias,
                                   self.comm)
        q, k, v = qkv.view(seq_len, batch, 3, -1, self.head_dim).permute(2, 1, 3, 0, 4)
        y = self.attn.attention(q, k, v).permute(2, 0, 1, 3).reshape(seq_len * batch, -1)
        x = x + (RowParallel.apply(y, self.attn.proj.weight, self.comm) + self.attn.proj.bias)
        h = F.gelu(ColumnParallel.apply(self.ln2(x), self.fc.weight, self.fc.bias, self.comm))
        return x + (RowParallel.apply(h, self.fc_proj.weight, self.comm) + self.fc_proj.bias)


# Copied from 06_symmem/optimized_symmem_tp.py: TensorParallelGPT
class TensorParallelGPT(nn.Module):
    """common.GPT split over the ranks: TP blocks, replicated embeddings, norm and tied head,
    each rank running these on its sequence shard. `forward` returns its shard's share of the
    mean loss (the sum over ranks is the loss)."""

    def __init__(self, gpt: common.GPT, n_heads: int, rank: int, world: int, comm):
        super().__init__()
        self.rank, self.world, self.comm = rank, world, comm
        self.autocast_dtype = gpt.autocast_dtype
        self.tok_emb, self.pos_emb, self.ln_f, self.head = (gpt.tok_emb, gpt.pos_emb, gpt.ln_f,
                                                            gpt.head)
        self.blocks = nn.ModuleList(TensorParallelBlock(b, n_heads, rank, world, comm)
                                    for b in gpt.blocks)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch, seq_len = tokens.shape
        mine = my_share(seq_len * batch, self.rank, self.world)  # sequence-major: (T, B) rows
        positions = torch.arange(seq_len, device=tokens.device).repeat_interleave(batch)
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            x = self.tok_emb(tokens.t().reshape(-1)[mine]) + self.pos_emb(positions[mine])
            for block in self.blocks:
                x = block(x, seq_len, batch)
            logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float(), targets.t().reshape(-1)[mine],
                               reduction="sum") / (seq_len * batch)


# Copied from 06_symmem/optimized_symmem_tp.py: tensor_parallel_setup
def tensor_parallel_setup(parser, comm_of):
    """Flags, topology, the workload (one global batch, N x --batch-size sequences, on every
    rank) and the TP model with `comm_of(args, topo)` as its collectives (`model.comm`); the
    replicated parameters first, so that their gradients are one slice of one flat buffer."""
    parser.set_defaults(batch_size=0)
    args = parser.parse_args()
    world = common.launch_world_size()
    heads = common.SIZES[args.size].n_heads
    if world > heads:
        raise common.Skip(f"--size {args.size} has {heads} heads, fewer than the {world} "
                          f"processes to split them over: launch at most {heads}")
    args.batch_size = world * (args.batch_size or common.SIZES[args.size].batch_size)
    topo = common.setup(args)
    gpt, batches = common.workload(args, topo, dp_rank=0, dp_world=1)
    params = sum(p.numel() for p in gpt.parameters())
    model = TensorParallelGPT(gpt, heads, topo.rank, topo.world_size, comm_of(args, topo))
    named = list(model.named_parameters())
    replicated = [p for name, p in named if not name.endswith(SHARDED)]
    ordered = replicated + [p for name, p in named if name.endswith(SHARDED)]
    grads = torch.zeros(sum(p.numel() for p in ordered), device=topo.device)
    offset = 0
    for p in ordered:  # backward accumulates into views of one buffer
        p.grad = grads[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return args, topo, model, batches, grads, sum(p.numel() for p in replicated), params


# Copied from 06_symmem/optimized_symmem_tp.py: tp_theory
def tp_theory(args, topo, model, replicated: int) -> dict:
    """comm MB/step and the busiest rank's state MB from the shapes: 8 gathers or scatters of the
    activations (in the compute dtype) per block, (N-1)/N each, the replicated gradients' fp32
    all-reduce; 16 bytes a kept parameter, the blocks' sliced by heads and units (the most any
    rank gets)."""
    n, size = topo.world_size, common.SIZES[args.size]
    d, head_dim = size.d_model, size.d_model // size.n_heads
    activations = args.seq_len * args.batch_size * d * (2 if args.dtype == "bf16" else 4)
    collectives = 8 * len(model.blocks) * (n - 1) / n * activations / 2**20
    heads, units = -(-size.n_heads // n), -(-4 * d // n)
    per_block = 3 * heads * head_dim * (d + 1) + d * heads * head_dim + units * (2 * d + 1)
    kept = replicated + len(model.blocks) * per_block
    return {"comm_mb": collectives + common.ring_allreduce_mb(4 * replicated, n),
            "state_mb": 16 * kept / 2**20}


def main():
    args, topo, model, batches, grads, replicated, params = tensor_parallel_setup(
        common.parser(__doc__), lambda args, topo: ProcessGroupCollectives(topo.world_size))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)

    def train_step(inputs, targets):
        grads.zero_()
        loss = model(inputs, targets)
        loss.backward()
        dist.all_reduce(grads[:replicated])  # each rank's tokens' share of the replicated parts
        opt.step()
        return loss.detach() * topo.world_size  # averaged over ranks: the whole batch's loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt),
                               dp_world=1)
    common.record(args, topo, stats, baseline=None, model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=LOSS_TOLERANCE[args.dtype], overlap=0.0,
                  theory=tp_theory(args, topo, model, replicated))


if __name__ == "__main__":
    common.run_main(main)
