"""FP8 linears and activation checkpointing on FSDP2: the two levers once the model fits.

What it does: optimized_fsdp.py's FSDP2 (a FULL_SHARD unit per block plus the root, the next
block's all-gather prefetched, a MixedPrecisionPolicy following --dtype), with two additions,
each one flag away so that the four rows of an ablation differ in one thing:
  FP8 (torchao, tensorwise scaling; --no-fp8 drops it): every nn.Linear whose in and out
    features are multiples of 16, except the output head (by identity, tied or not), becomes a
    Float8Linear: E4M3 operands in forward, E5M2 gradients in backward, each tensor scaled by
    its largest magnitude. Sharded weights are cast to float8 before FSDP gathers them, so
    they travel as 1 byte a value (in --dtype where rows do not split evenly over the ranks).
  Activation checkpointing per block (--no-checkpointing drops it): a block keeps only its
    input for backward and runs its forward again there.
  torch.compile of each block (--compile; on by default on CUDA), where float8 pays off.
Why it helps: on GPUs with FP8 tensor cores (sm89+) float8 matmuls run at twice the bf16 rate
and the gathers move half the bytes; checkpointing buys memory (a longer sequence, a bigger
batch) for about one more forward pass. On CPU float8 is slower than fp32: there this run
proves correctness and the loss tolerance, not speed.
Run:        torchrun --nproc_per_node=2 03_fsdp/optimized_fsdp_fp8.py --size small
            make fsdp-ablation     (the four rows: FSDP, +checkpointing, +FP8, both)
Look for:   the activations share of the peak (record `memory`) against theory.activation_mb,
            bytes gathered per dtype (`gathered_mb`), tokens/s, losses within the tolerance.
Theory:     a GPT block saves 17 x d_model values a token (input, LayerNorm outputs, q/k/v,
            the attention output and its copy, residual, MLP hidden and GELU output), a Llama
            layer 9 x d_model (k, v repeated to every head) and 4 x the SwiGLU width; both a
            log-sum-exp per head; checkpointed, its input plus, while it recomputes, one block's.
"""

import argparse
import importlib.util
import math
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Per step, absolute, against optimized_fsdp (uncompiled, in the same dtype):
# - FP8: float8's 3-bit mantissa moves each matmul by about 1e-2 relative and the trajectories
#   drift apart. How far is too far comes from fp32 itself, not from FP8's own result: the
#   spread of fp32's losses over seeds 0-4 at `small` (25 steps, the shared workload), whose
#   per-step standard deviation peaks at 0.158 (README): an FP8 run inside it is one fp32 could
#   have been with another seed. bf16's own drift (5e-2) is inside it.
# - Without FP8 the same arithmetic: fp32 rounding (1e-4) uncompiled; compiled, inductor's fused
#   kernels sum in other orders (1e-3); in bf16 either drifts by bf16's resolution (5e-2).
LOSS_TOLERANCE = {"fp8": 0.16, ("fp32", False): 1e-4, ("fp32", True): 1e-3,
                  ("bf16", False): 5e-2, ("bf16", True): 5e-2}
# No planner row: FSDP's state in FSDP's places, gathered in a dtype the planner does not offer.
PLANNED = []


def build_mesh(topo: common.Topology) -> DeviceMesh:
    """All ranks on one dim; the device type explicit (pytorch/pytorch#132471)."""
    return init_device_mesh(topo.device.type, (topo.world_size,), mesh_dim_names=("shard",))


def fp8_eligible(module: torch.nn.Module, kept_whole: set[int]) -> bool:
    """A Linear whose shapes float8 matmuls take (multiples of 16), unless its weight is one of
    `kept_whole` (ids of weights: compared by identity, whatever the module's name)."""
    return isinstance(module, torch.nn.Linear) and id(module.weight) not in kept_whole and \
        module.in_features % 16 == 0 and module.out_features % 16 == 0


def shared_weights(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters more than one module holds, such as a head tied to the embedding."""
    held = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {weight for weight, holders in held.items() if holders > 1}


def float8_gather_note(rows: dict[str, int], shard_ranks: int, dtype: str = "--dtype"
                       ) -> str | None:
    """Why FSDP gathers no weight in float8 on `shard_ranks` ranks, given each float8 linear's
    rows by name (None: it does): torchao does not pad a float8 shard (pytorch/ao#3982), so one
    weight whose rows do not split evenly sends every weight in `dtype`, cast after."""
    uneven = [name for name, n in rows.items() if n % shard_ranks]
    if not uneven:
        return None
    return (f"no weight gathered in float8: {len(uneven)} of {len(rows)} float8 weights (e.g. "
            f"{uneven[0]}, {rows[uneven[0]]} rows) do not split evenly over {shard_ranks} ranks "
            f"(torchao pads no float8 shard), so all travel in {dtype}; a world that divides "
            f"{math.gcd(*rows.values())} gathers float8")


def flatten_float8_weights_as_on_a_gpu() -> None:
    """A dry run's stand-in: torchao's float8 weight, flattened (as the memory tracker does),
    asks whether its precomputed scale is nonzero, a value a GPU reads and a fake tensor lacks;
    here it asks whether the weight has one."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def flatten(self):
        scale = ["_precomputed_scale"] if self._precomputed_scale is not None else []
        return ["_tensor", *scale], {"mm_config": self._linear_mm_config, "dtype": self._dtype}
    WeightWithDynamicFloat8CastTensor.__tensor_flatten__ = flatten
    common.stand_in("float8 weights", "flattened with their precomputed scale, whose value a "
                    "fake tensor cannot give")


def convert_to_fp8(model: torch.nn.Module, keep: list[torch.nn.Module], shard_ranks: int
                   ) -> tuple[list[str], bool]:
    """Swap the eligible linears for torchao's Float8Linear, except the modules in `keep` (the
    output head) and any linear whose weight another module also holds (torchao's new Parameter
    would untie a tied head); return their names, and whether FSDP gathers their weights in
    float8. It does when every weight's rows split evenly over the `shard_ranks`: torchao does
    not pad a float8 shard (pytorch/ao#3982), so an uneven split would gather mismatched
    sizes; then the weights are gathered in --dtype and cast after."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    kept_whole = {id(m.weight) for m in keep} | shared_weights(model)
    converted = [name for name, m in model.named_modules() if fp8_eligible(m, kept_whole)]
    gather_fp8 = float8_gather_note(rows_of(model, converted), shard_ranks) is None
    convert_to_float8_training(
        model, module_filter_fn=lambda module, _: fp8_eligible(module, kept_whole),
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather_fp8))
    return converted, gather_fp8


def rows_of(model: torch.nn.Module, linears: list[str]) -> dict[str, int]:
    """Each named linear's rows (out_features): how FSDP splits its weight over the ranks."""
    return {name: model.get_submodule(name).out_features for name in linears}


def checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]
                      ) -> list[torch.nn.Module]:
    """Each block keeps only its input for backward and recomputes the rest there: wrapped, the
    wrapper put in the block's place in `model` (its parent found by identity). Returns the
    wrappers, the units to shard."""
    parent_of = {id(child): (parent, name) for parent in model.modules()
                 for name, child in parent.named_children()}
    wrappers = []
    for block in blocks:
        parent, name = parent_of[id(block)]
        wrappers.append(checkpoint_wrapper(block))
        parent.register_module(name, wrappers[-1])
    return wrappers


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


# Copied from 03_fsdp/optimized_fsdp.py: shard_mesh
def shard_mesh(mesh: DeviceMesh | dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over: a DeviceMesh as given, or a process group (None: the world) as
    a 1-D mesh of its ranks."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    return DeviceMesh.from_group(mesh or dist.group.WORLD, device_type)


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


# Copied from 03_fsdp/optimized_fsdp.py: shard, changed: blocks compiled and prefetched, no offload
def shard(model: torch.nn.Module, blocks: list[torch.nn.Module],
          mesh: DeviceMesh | dist.ProcessGroup | None, mp_policy: MixedPrecisionPolicy,
          compile_blocks: bool) -> None:
    """optimized_fsdp.py's layout over `mesh` (or a process group; None: the world): a
    FULL_SHARD unit per block, the root, prefetching."""
    mesh = shard_mesh(mesh, next(model.parameters()).device.type)
    same_weights_on_every_rank(model, mesh)
    for block in blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    reduce_scatter_by_all_to_all_on_gloo(model, mesh)
    for earlier, later in zip(blocks, blocks[1:], strict=False):
        earlier.set_modules_to_forward_prefetch([later])
        later.set_modules_to_backward_prefetch([earlier])


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


def activation_theory(args, checkpointing: bool) -> float:
    """MB of activations the blocks save for backward on one rank: activation_bytes of the
    model's shape and this rank's batch."""
    size = common.SIZES[args.size]
    ffn = size.llama_ffn if args.model == "llama" else None
    return activation_bytes(size.n_layers, args.batch_size * args.seq_len, size.d_model,
                            size.n_heads, 2 if args.dtype == "bf16" else 4, checkpointing,
                            ffn) / 2**20


def main():
    parser = common.parser(__doc__, skips={
        "resnet": "a ResNet has no float8 linears to speak of (its convolutions stay as they "
                  "are): FP8 runs --model gpt or llama",
        "moe": "torchao's float8 scales a linear's input by its largest value, and a routed "
               "expert given no tokens in a step has none (max() of an empty tensor): --model "
               "gpt or llama"})
    parser.add_argument("--no-fp8", action="store_true", help="keep every linear in --dtype")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep every block's activations for backward")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each block (default: on with CUDA, off on CPU)")
    parser.add_argument("--clip-grad-norm", type=common.positive_float, default=None,
                        metavar="MAX", help="clip the gradient to this global 2-norm before "
                        "each step, as optimized_fsdp.py does (default: no clipping)")
    args = parser.parse_args()
    compile_blocks = torch.cuda.is_available() if args.compile is None else args.compile
    fp8, checkpointing = not args.no_fp8, not args.no_checkpointing
    topo = common.setup(args, compiles=compile_blocks)
    if fp8 and importlib.util.find_spec("torchao") is None:
        raise common.Skip("FP8 needs torchao (pip install torchao): or run with --no-fp8")
    if fp8 and topo.device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise common.Skip("float8 matmuls need a GPU of compute capability 8.9 or more: "
                          "run with --no-fp8 for checkpointing alone")
    if fp8 and common.dry_run():
        flatten_float8_weights_as_on_a_gpu()
    model, batches = common.workload(args, topo)
    blocks = common.transformer_blocks(model)
    converted, gather_fp8 = convert_to_fp8(model, [common.output_head(model)], topo.world_size) \
        if fp8 else ([], False)
    if checkpointing:
        blocks = checkpoint_blocks(model, blocks)
    bf16 = args.dtype == "bf16"
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    shard(model, blocks, build_mesh(topo), mp_policy, compile_blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        opt.step()
        if gather_fp8:  # the float8 scales of every sharded weight, for the next all-gathers
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    gathered = {kind.split()[1]: round(mb, 3) for kind, mb in
                (stats.comm_mb_by_kind or {}).items() if kind.startswith("allgather")}
    # the host's world decides what FSDP gathers in float8: said in the summary and the report
    note = float8_gather_note(rows_of(model, converted), topo.world_size, args.dtype)
    common.record(args, topo, stats, baseline="optimized_fsdp", model=model, optimizer=opt,
                  overlapped=common.FSDP_OVERLAP,
                  comm_mb=stats.comm_mb, gathered_mb=gathered, checkpointing=checkpointing,
                  note=note,
                  activation_mb=(stats.memory or {}).get("activations"),  # CPU's split
                  compile=compile_blocks, clip_grad_norm=args.clip_grad_norm,
                  loss_tolerance=LOSS_TOLERANCE["fp8" if fp8 else (args.dtype, compile_blocks)],
                  fp8={"layers": converted, "scaling": "tensorwise",
                       "all_gather": "float8_e4m3fn" if gather_fp8 else args.dtype}
                  if fp8 else None,
                  theory={"activation_mb": activation_theory(args, checkpointing),
                          "activation_mb_without_checkpointing":
                              activation_theory(args, False)})


if __name__ == "__main__":
    common.run_main(main)
