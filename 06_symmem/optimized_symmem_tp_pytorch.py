"""PyTorch's own tensor parallelism on the same model: DTensor's `parallelize_module` with
ColwiseParallel, RowwiseParallel and SequenceParallel, and on CUDA async TP under torch.compile.

What it does: the split of baseline_symmem_tp.py, said as a plan over a 1-D DeviceMesh of all
ranks (gloo on CPU, NCCL on CUDA): the norms SequenceParallel (activations sharded along the
sequence, Shard(1)), attention's input gathered to Replicate (PrepareModuleInput), q, k, v and
fc ColwiseParallel, proj and fc_proj RowwiseParallel back to Shard(1) (a reduce-scatter).
Two changes to the model, none to its math: ColwiseParallel splits a Linear's rows evenly,
which on the fused qkv would hand rank 0 all of q, so q, k and v become three Linears (as in
torchtitan's models); heads or hidden units that do not divide by N are padded with zero
weights, which give zero outputs and gradients and so stay zero under AdamW. --model llama:
torchtitan's plan, KV groups padded (README, "How it works"). Embeddings, final norm and head
stay plain, run on each rank's own tokens; every parameter that is not a DTensor has its
gradient all-reduced by hand, the DTensors' by DTensor. On CUDA each block is compiled with
inductor's micro-pipeline TP (the mesh's group enabled for symmetric memory), which rewrites
each all-gather+matmul and matmul+reduce-scatter into the kernels optimized_symmem_tp.py calls
(torchtitan's async TP); across nodes or without GPU peer access it stays off (`async_tp_off`
in the record says why). Under bf16 autocast DTensor gathers the norms' fp32 outputs: twice
the hand-written gathers' bytes.
Why: it is what a user would reach for first; the hand-written scripts must beat it.
Run:        torchrun --nproc_per_node=2 06_symmem/optimized_symmem_tp_pytorch.py --size small
Look for:   `make symmem report`: beside optimized_symmem_tp, against the same baseline; losses
            equal to the hand-written TP's.
Theory:     the bytes of baseline_symmem_tp.py (padding and fp32 gathers aside), plus the
            norms' gradients, which DTensor all-reduces one by one.
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}  # as baseline_symmem_tp.py's, for its reason
# No planner row of its own: TP's state and bytes are the baseline's (its PLANNED, tp_bytes);
# the transport differs, not what is kept or sent.
PLANNED = []


# Copied from 06_symmem/baseline_symmem_tp.py: tp_degree_problem
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


def padded_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, cols: int
                  ) -> nn.Linear:
    """A Linear of `rows` x `cols` whose top-left corner is `weight`, zeros elsewhere."""
    linear = nn.Linear(cols, rows, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.zero_()[:weight.shape[0], :weight.shape[1]].copy_(weight)
        if bias is not None:
            linear.bias.zero_()[:bias.shape[0]].copy_(bias)
    return linear


def padded_like(linear: nn.Linear, rows: int, cols: int) -> nn.Linear:
    return padded_linear(linear.weight.detach(),
                         None if linear.bias is None else linear.bias.detach(), rows, cols)


class PaddedHeadsQKVAttention(nn.Module):
    """common's CausalSelfAttention with q, k, v as three Linears and the heads padded with zero
    ones to a multiple of `world`; its head count is whatever its q's local rows hold."""

    def __init__(self, attn: nn.Module, world: int):
        super().__init__()
        d, n_heads = attn.proj.in_features, attn.n_heads
        self.head_dim, self.attention = d // n_heads, attn.attention
        width = -(-n_heads // world) * world * self.head_dim
        w, b = attn.qkv.weight.detach(), attn.qkv.bias.detach()
        self.q, self.k, self.v = (padded_linear(w[i * d:(i + 1) * d], b[i * d:(i + 1) * d],
                                                width, d) for i in range(3))
        self.proj = padded_like(attn.proj, d, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (lin(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        return self.proj(self.attention(q, k, v).transpose(1, 2).flatten(2))


def parallelize_block(block: common.Block, mesh) -> None:
    """The TP + SP plan of one GPT block (torchtitan's, for this block's module names)."""
    world, d = mesh.size(), block.fc.in_features
    block.attn = PaddedHeadsQKVAttention(block.attn, world)
    units = -(-block.fc.out_features // world) * world
    block.fc, block.fc_proj = padded_like(block.fc, units, d), padded_like(block.fc_proj, d, units)
    parallelize_module(block, mesh, {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln2": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "fc_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})


def parallelize_llama_layer(layer: nn.Module, mesh) -> None:
    """torchtitan's plan of a Llama layer under HuggingFace's names: q, k, v, gate, up
    ColwiseParallel, o, down RowwiseParallel, the RMSNorms SequenceParallel. ColwiseParallel's
    even rows must hold whole KV groups: KV heads (with their query heads, appended in the same
    order) and SwiGLU units are padded with zeros to multiples of N."""
    world, attn, mlp = mesh.size(), layer.self_attn, layer.mlp
    d, head_dim = attn.q_proj.in_features, attn.head_dim
    group = attn.q_proj.out_features // attn.k_proj.out_features  # query heads a KV head
    kv_width = -(-attn.k_proj.out_features // head_dim // world) * world * head_dim
    attn.q_proj = padded_like(attn.q_proj, group * kv_width, d)
    attn.k_proj, attn.v_proj = (padded_like(p, kv_width, d) for p in (attn.k_proj, attn.v_proj))
    attn.o_proj = padded_like(attn.o_proj, d, group * kv_width)
    units = -(-mlp.gate_proj.out_features // world) * world
    mlp.gate_proj, mlp.up_proj = (padded_like(p, units, d) for p in (mlp.gate_proj, mlp.up_proj))
    mlp.down_proj = padded_like(mlp.down_proj, d, units)
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(layer, mesh, {
        "input_layernorm": SequenceParallel(), "self_attn": gathered,
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(), "mlp": gathered,
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})


def sequence_shard(seq_len: int, rank: int, world: int) -> slice:
    """Rank `rank`'s positions under Shard(1): torch.chunk's split, ceil(T/N) a rank."""
    per = -(-seq_len // world)
    return slice(min(rank * per, seq_len), min((rank + 1) * per, seq_len))


def tp_loss(parts: dict, mesh, tokens: torch.Tensor, targets: torch.Tensor,
            autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """A decoder's forward with its blocks on DTensors, from its parts (`blocks`, `embedding`,
    `positions`: a position table or None, `norm`, `head`): my positions embedded, the
    blocks, then norm, head and the sum of my tokens' losses over the whole batch's count."""
    batch, seq_len = tokens.shape
    mine = sequence_shard(seq_len, mesh.get_local_rank(), mesh.size())
    with torch.autocast(tokens.device.type, dtype=autocast_dtype,
                        enabled=autocast_dtype is not None):
        x = parts["embedding"](tokens[:, mine])
        if parts["positions"] is not None:
            x = x + parts["positions"](torch.arange(seq_len, device=tokens.device)[mine])
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False,
                               shape=(batch, seq_len, x.shape[-1]),
                               stride=(seq_len * x.shape[-1], x.shape[-1], 1))
        for block in parts["blocks"]:
            x = block(x)
        logits = parts["head"](parts["norm"](x.to_local()))
    return F.cross_entropy(logits.float().flatten(0, 1), targets[:, mine].flatten(),
                           reduction="sum") / (batch * seq_len)


def enable_async_tp(mesh) -> None:
    """torchtitan's async-TP switch: inductor's micro-pipeline pass rewrites a compiled block's
    gather+matmul and matmul+scatter into the symm_mem kernels, for groups that
    is_symm_mem_enabled_for_group says yes to, and only enable_symm_mem_for_group (deprecated
    since the kernels no longer need it) makes it say yes."""
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(mesh.get_group().group_name)


def start_async_tp(topo: common.Topology, mesh) -> str | None:
    """Turn async TP on where it can run, and return None; else return why it stays off. It is
    a CUDA pass whose kernels map every GPU of the group into each one's address space: one
    host, GPUs that reach each other's memory (peer_access_problem, which every rank calls,
    as optimized_symmem_tp.py does before its fused kernels). Where it cannot, the blocks still
    compile and DTensor's collectives run whole."""
    if topo.device.type != "cuda":
        return "inductor's micro-pipeline TP is a CUDA pass"
    if why := peer_access_problem(topo):
        return why
    enable_async_tp(mesh)
    return None


def decoder_parts(model: common.Decoder) -> dict:
    """What tp_loss runs, found in the project's decoders (main's adapter: a trainer of one's
    own names its own parts)."""
    loss_head = model.pipeline_layers()[-1]  # the final norm and the head, tied or not
    return {"blocks": common.transformer_blocks(model), "embedding": common.input_embedding(model),
            "positions": getattr(model, "pos_emb", None), "norm": loss_head.ln_f,
            "head": loss_head.head}


# Copied from 06_symmem/optimized_symmem_allreduce.py: peer_access_problem
def peer_access_problem(topo: common.Topology) -> str | None:
    """Why this host's GPUs cannot map each other's memory (symmetric memory), or None; all ranks
    agree on it, as one that went on alone would wait forever in the rendezvous."""
    if topo.nnodes > 1:
        return "symmetric memory maps the GPUs of one host: run on one node (NNODES=1)"
    visible = torch.cuda.device_count()
    # under `srun --gpus-per-task=1` each rank sees one GPU, index 0: the rendezvous would map
    # every rank's memory onto the same device ("allocations from overlapping devices")
    hidden = visible < topo.local_world_size
    me, used = topo.device.index, min(visible, topo.local_world_size)
    lacking = [k for k in range(used) if k != me and not torch.cuda.can_device_access_peer(me, k)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (hidden, lacking))
    if any(h for h, _ in everyone):
        return (f"a rank sees {visible} GPU(s) for the host's {topo.local_world_size} ranks "
                "(srun --gpus-per-task?): symmetric memory maps the host's GPUs, so every rank "
                "must see them all: srun --gpus-per-node, or torchrun")
    if any(lacks for _, lacks in everyone):
        return ("this host's GPUs cannot access each other's memory (no NVLink, no PCIe "
                "peer-to-peer), which symmetric memory maps: nothing to measure here")
    return None


# Copied from 03_fsdp/optimized_fsdp_tp.py: sequence_parallel_bytes
def sequence_parallel_bytes(tp: int, collectives: float, tokens: float, width: float,
                            value_bytes: float) -> float:
    """Bytes a rank of a TP group sends in `collectives` all-gathers or reduce-scatters of the
    group's `tokens` x `width` activations, `value_bytes` a value: (t-1)/t of each, a ring's
    share. Sequence parallelism runs 8 a layer: a gather before attention and before the MLP,
    a reduce-scatter after each, and their twins in backward."""
    return collectives * (tp - 1) / tp * tokens * width * value_bytes


# Copied from 06_symmem/baseline_symmem_tp.py: tp_bytes
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


def dtensor_theory(args, topo, blocks: int, replicated: int) -> dict:
    """comm MB/step and state MB from the shapes, as tp_theory in optimized_symmem_tp.py, with
    DTensor's padding: Shard(1) pads each rank's positions to ceil(T/N) in its collectives, and
    heads (the Llama's KV heads, with their query heads) and hidden units are padded to
    multiples of N. Under bf16 autocast the gathers (and their gradients' reduce-scatters) move
    the norms' fp32 outputs, 4 bytes a value; the row-parallel outputs and their gradients 2.
    The norms' parameters (the GPT's 4d a block, the Llama's 2d) are DTensors replicated over
    the mesh, their gradients all-reduced by DTensor: tp_bytes, a gather's and a scatter's
    bytes averaged."""
    n, size = topo.world_size, common.SIZES[args.size]
    d, head_dim = size.d_model, size.d_model // size.n_heads
    scattered_bytes = 2 if args.dtype == "bf16" else 4
    if args.model == "llama":
        kv_width = -(-size.n_kv_heads // n) * head_dim
        width, units = kv_width * size.n_heads // size.n_kv_heads, -(-common.llama_ffn_dim(d) // n)
        norms = 2 * d
        per_block = (2 * width + 2 * kv_width) * d + 3 * units * d + norms
    else:
        width, units, norms = -(-size.n_heads // n) * head_dim, -(-4 * d // n), 4 * d
        per_block = 3 * width * (d + 1) + d * width + units * (2 * d + 1) + 6 * d
    kept = replicated + blocks * per_block
    predicted = tp_bytes(kept, replicated + blocks * norms, blocks,
                         args.batch_size * -(-args.seq_len // n) * n, d, n,
                         (4 + scattered_bytes) / 2)
    return {"comm_mb": predicted["sent"] / 2**20, "state_mb": predicted["state"] / 2**20}


def main():
    parser = common.parser(__doc__, skips={
        "resnet": "a ResNet has no attention heads or MLP matrices for tensor parallelism to "
                  "split: TP runs --model gpt or llama",
        "moe": "a MoE's MLP is a router and experts, not the one SwiGLU this plan splits: TP runs "
               "--model gpt or llama (experts: 08_moe)"})
    parser.set_defaults(batch_size=0)
    args = parser.parse_args()
    world = common.launch_world_size()
    if why := tp_degree_problem(args, world):
        raise common.Skip(why)
    # one global batch on every rank: N x the per-rank batch
    settings = common.resolved(
        args, batch_size=world * (args.batch_size or common.SIZES[args.size].batch_size))
    topo = common.setup(settings, compiles=True)  # its blocks compile on CUDA
    model, batches = common.workload(settings, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(topo.device.type, (topo.world_size,))
    parts = decoder_parts(model)
    async_tp_off = start_async_tp(topo, mesh)  # None: on
    if async_tp_off and topo.device.type == "cuda":
        common.log(topo, f"async TP off: {async_tp_off}")
    for block in parts["blocks"]:
        (parallelize_block if isinstance(model, common.GPT) else parallelize_llama_layer)(
            block, mesh)
        if topo.device.type == "cuda":
            block.compile()
    # every parameter DTensor does not own is replicated, its gradient this rank's tokens'
    # share: all-reduced by hand (an untied head too); a fused step takes one kind of tensor
    distributed = [p for p in model.parameters() if isinstance(p, DTensor)]
    replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.AdamW([{"params": distributed}, {"params": replicated}], lr=settings.lr,
                            fused=True)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = tp_loss(parts, mesh, inputs, targets, model.autocast_dtype)
        loss.backward()
        for p in replicated:
            dist.all_reduce(p.grad)
        opt.step()
        return loss.detach() * topo.world_size  # averaged over ranks: the whole batch's loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(model, opt),
                               dp_world=1)
    common.record(settings, topo, stats, baseline="baseline_symmem_tp", model=model, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=LOSS_TOLERANCE[settings.dtype],
                  async_tp=async_tp_off is None, async_tp_off=async_tp_off,
                  comm_mb_by_kind=stats.comm_mb_by_kind,
                  theory=dtensor_theory(settings, topo, len(parts["blocks"]),
                                        sum(p.numel() for p in replicated)))


if __name__ == "__main__":
    common.run_main(main)
