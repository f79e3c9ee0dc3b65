"""Async tensor parallelism through symmetric memory: each all-gather+matmul and matmul+reduce-
scatter of baseline_symmem_tp.py done chunk by chunk, the chunk already here multiplied while the
peers' arrive.

What it does: the baseline's model (GPT or --model llama), split (sequence parallelism too) and
process group (default: the world); only TP's two communicating matmuls change, as in
torchtitan's async TP on GPUs.
- all-gather+matmul: I write my sequence shard into my slot, raise my flag, multiply it, then
  each peer's as its flag comes up (the next rank's first), copied into the gathered input.
- matmul+reduce-scatter: I multiply the rows each peer owns first, straight into my slot, raise
  my flag, then my own rows, and add each peer's partial of my rows as its flag comes up.
CPU: optimized_symmem_allreduce.py's /dev/shm segment (x86-64, one node). Each slot ends with
the time it was written, one clock for the host: `overlap` in the record is the share of the
time from a call's start to its peers' last chunk spent multiplying and copying, not waiting.
CUDA: `torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, torchtitan's
async TP kernels (`overlap` not measured).
Why it helps: the baseline waits for each whole collective (gloo's sockets on CPU) before its
matmul starts; here the local chunk's matmul hides the peers' arrival, and the bytes move
through memory every rank maps (the speedup is both: transport and overlap).
Run:        torchrun --nproc_per_node=2 06_symmem/optimized_symmem_tp.py --size small
Look for:   `make symmem report`: speedup over baseline_symmem_tp and DTensor's TP
            (optimized_symmem_tp_pytorch), same losses, `overlap`.
Theory:     as the baseline's, read out of peers' slots: 8 x (N-1)/N of T x B x d values a block
            (4 bytes, 2 in bf16), plus the replicated gradients' all-reduce.
"""

import argparse
import itertools
import mmap
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
# No planner row of its own: TP's state and bytes are the baseline's (its PLANNED, tp_bytes);
# the transport differs, not what is kept or sent.
PLANNED = []


LINE = 8  # int64s per flag: one 64-byte cache line each
SPIN_POLLS = 300  # flag reads (tens of microseconds) before a waiting rank yields its core


# Copied from 06_symmem/optimized_symmem_allreduce.py: SharedSegment
class SharedSegment:
    """Flags and one slot per rank of `group` (default: the world; ranks and collectives are the
    group's) in a /dev/shm file its ranks, all on this host, map. The flags are read and written
    as Python ints through a memoryview (a poll costs well under a microsecond); the slots are a
    tensor over the same mapping. Each flag has a cache line of its own. The group's first rank
    creates the file and unlinks it once every rank has mapped it, so the memory lives exactly
    as long as the mappings: nothing is left in /dev/shm when the run ends, or when a rank is
    killed.
    Ordering: a rank writes its data, then its flag; a peer reads the flag, then the data.
    x86-64 makes stores visible in program order and does not reorder loads with older loads
    (total store order), and torch's copy, add and sum kernels store normally, so a peer that sees
    the flag sees the data. ARM (e.g. GB200's Grace CPUs) promises no such order and Python has
    no fence to call, hence the check below."""

    def __init__(self, topo: common.Topology, slot_bytes: int, timeout: float,
                 group: dist.ProcessGroup | None = None):
        group = group or dist.group.WORLD
        if common.dry_run():  # its fake peers never write: it would wait for them
            raise common.Skip("a /dev/shm segment waits for its peers' writes, which a dry "
                              "run's fake peers never make")
        members = dist.get_process_group_ranks(group)  # global ranks, in the group's order
        if len({g // topo.local_world_size for g in members}) > 1:  # launchers number by node
            raise common.Skip("a /dev/shm segment is one host's: run on one node (NNODES=1)")
        if platform.machine() not in ("x86_64", "AMD64"):
            raise common.Skip(f"the flags rely on x86-64's store order, not {platform.machine()}'s")
        n, self.rank, self.timeout = len(members), dist.get_rank(group), timeout
        # the group's name keeps two groups' segments apart; its first rank's pid and clock, runs
        path = [f"/dev/shm/playbook-symmem-{group.group_name}-{os.getpid()}-{time.time_ns()}"]
        dist.broadcast_object_list(path, src=members[0], group=group)  # the group's first rank's
        flag_bytes = 3 * n * LINE * 8
        if self.rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(flag_bytes + n * slot_bytes)  # zeros: every flag starts at call 0
            # torchrun ends the other ranks with SIGTERM when one dies: exit through the
            # `finally` below, which unlinks the file, not around it
            sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            dist.barrier(group=group)
            with open(path[0], "r+b") as f:
                self.mapping = mmap.mmap(f.fileno(), flag_bytes + n * slot_bytes)
            dist.barrier(group=group)  # every rank has mapped it: the name is no longer needed
        finally:  # unlinked then, or at once if a peer never mapped it
            if self.rank == 0:
                os.unlink(path[0])
                signal.signal(signal.SIGTERM, sigterm)
        self.flags = memoryview(self.mapping)[:flag_bytes].cast("q")
        self.ready, self.reduced, self.done = (range(k * n * LINE, (k + 1) * n * LINE, LINE)
                                               for k in range(3))
        self.slots = torch.frombuffer(self.mapping, dtype=torch.float32, offset=flag_bytes,
                                      count=n * slot_bytes // 4).view(n, slot_bytes // 4)
        self.call = 0

    def begin(self) -> None:
        """A new call: wait until every peer is done reading the slots of the last one."""
        self.call += 1
        self.wait(self.done, self.call - 1)

    def signal(self, flags: range) -> None:
        self.flags[flags[self.rank]] = self.call

    def wait(self, flags: range, value: int | None = None) -> None:
        """Until every rank's flag reaches `value` (default: this call): a tight poll first (a
        peer a few microseconds behind costs no system call), then yielding the core between
        polls: ranks may outnumber cores, and a spin would starve the rank it waits for."""
        value, polls, deadline = self.call if value is None else value, 0, None
        for i in flags:
            while self.flags[i] < value:
                polls += 1
                if polls < SPIN_POLLS:
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"a peer did not reach call {value} within {self.timeout} s")
                os.sched_yield()


class SegmentCollectives:
    """CPU: TP's two communicating matmuls, chunk by chunk through a SharedSegment whose slots
    hold N pieces of (T*B/N) x width values each (fp32 or narrower), then the time the slot was
    written. `waited` and `arriving` (ns) add up, per call, the time spent waiting for peers'
    chunks and the time from the call's start to the last chunk's arrival."""

    def __init__(self, topo: common.Topology, tokens: int, width: int, timeout: float,
                 group: dist.ProcessGroup | None = None):
        self.seg = SharedSegment(topo, tokens * width * 4 + 8, timeout, group)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        self.written = [self.seg.slots[k, -2:].view(torch.int64) for k in range(self.world)]
        self.loaded_bytes = 0  # read out of peers' slots
        self.waited = self.arriving = 0

    def pieces(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot k, piece p: rows p*rows.. of rank k's message."""
        slots = self.seg.slots.view(dtype)[:, :self.world * rows * width]
        return slots.view(self.world, self.world, rows, width)

    def begin(self) -> int:
        """A new call once peers are done with the last one's slots: the time it starts."""
        self.seg.begin()
        return time.perf_counter_ns()  # CLOCK_MONOTONIC: one clock for the host

    def publish(self) -> None:
        self.written[self.rank].fill_(time.perf_counter_ns())
        self.seg.signal(self.seg.ready)

    def await_peer(self, k: int) -> None:
        """Wait for peer k's chunk; count the wait up to when it was written (noticing it later,
        after a yield, is the poll's latency, not the chunk's)."""
        waiting = time.perf_counter_ns()
        self.seg.wait(self.seg.ready[k:k + 1])
        self.waited += max(0, min(time.perf_counter_ns(), int(self.written[k])) - waiting)

    def end(self, start: int) -> None:
        """Count the last chunk's arrival, then let peers overwrite their slots (and times)."""
        self.arriving += max(0, max((int(self.written[k]) - start for k in self.peers),
                                    default=0))
        self.seg.signal(self.seg.done)

    def all_gather_matmul(self, shard: torch.Tensor, b: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, r = shard.shape[0], self.rank
        gathered = shard.new_empty(self.world * rows, shard.shape[1])
        out = shard.new_empty(self.world * rows, b.shape[1])
        slots = self.pieces(rows, shard.shape[1], shard.dtype)[:, 0]
        start = self.begin()
        slots[r].copy_(shard)
        self.publish()
        gathered[r * rows:(r + 1) * rows].copy_(shard)
        torch.mm(shard, b, out=out[r * rows:(r + 1) * rows])  # while the peers' shards arrive
        for k in self.peers:
            self.await_peer(k)
            gathered[k * rows:(k + 1) * rows].copy_(slots[k])
            torch.mm(gathered[k * rows:(k + 1) * rows], b, out=out[k * rows:(k + 1) * rows])
        self.end(start)
        self.loaded_bytes += len(self.peers) * shard.nbytes
        return gathered, out

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows, r = a.shape[0] // self.world, self.rank
        pieces = self.pieces(rows, b.shape[1], a.dtype)
        start = self.begin()
        for p in self.peers:  # the rows peers own first, into my slot: they sum while I work
            torch.mm(a[p * rows:(p + 1) * rows], b, out=pieces[r, p])
        self.publish()
        out = a[r * rows:(r + 1) * rows] @ b
        for k in self.peers:
            self.await_peer(k)
            out.add_(pieces[k, r])
        self.end(start)
        self.loaded_bytes += len(self.peers) * out.nbytes
        return out


class SymmetricMemoryCollectives:
    """CUDA: PyTorch's fused kernels, which split the same way over symmetric-memory buffers
    every GPU of the node maps (NVLink). They hand the bytes to no process group: counted here,
    from the shapes, as the CPU segment counts what it reads."""

    def __init__(self, topo: common.Topology, group: dist.ProcessGroup | None = None):
        import torch.distributed._symmetric_memory  # noqa: F401 (registers torch.ops.symm_mem)

        if why := peer_access_problem(topo):
            raise common.Skip(why)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group = (group or dist.group.WORLD).group_name
        self.loaded_bytes = 0
        self.waited = self.arriving = 0  # the kernels' waits are out of sight: they stay 0

    def all_gather_matmul(self, shard: torch.Tensor, b: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(
            shard.contiguous(), [b], 0, self.group)
        self.loaded_bytes += (self.world - 1) * shard.nbytes
        return gathered, out

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, self.group)
        self.loaded_bytes += (self.world - 1) * out.nbytes
        return out


# Copied from 06_symmem/baseline_symmem_tp.py: compute_dtype
def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would multiply in: a custom Function's matmuls cast by hand, so that
    backward (outside autocast) sees the same dtypes. Its backward casts the incoming gradient
    to it too (the saved weight's dtype): under bf16 autocast that gradient can come in fp32,
    and the matmuls, the fused CUDA kernels too, take one dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


# Copied from 06_symmem/baseline_symmem_tp.py: ColumnParallel
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


# Copied from 06_symmem/baseline_symmem_tp.py: RowParallel
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


# Copied from 06_symmem/baseline_symmem_tp.py: my_share
def my_share(total: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of `total` items: sizes differ by one at most."""
    return slice(total * rank // world, total * (rank + 1) // world)


# Copied from 06_symmem/baseline_symmem_tp.py: keep_rows
def keep_rows(linear: nn.Linear, rows) -> None:
    """Column-parallel: the linear keeps its output rows `rows` (weight and bias), as new leaves."""
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone())


# Copied from 06_symmem/baseline_symmem_tp.py: keep_columns
def keep_columns(linear: nn.Linear, cols) -> None:
    """Row-parallel: the linear keeps its input columns `cols`; a bias stays whole (replicated),
    added once to the reduced shard."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())


# Copied from 06_symmem/baseline_symmem_tp.py: TensorParallelBlock
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


# Copied from 06_symmem/baseline_symmem_tp.py: rotate
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x (batch, heads, seq, head_dim) by the model's angles (cos and sin,
    broadcast to x), in HuggingFace's layout (`rotate_half`): the first and second halves of
    each head are the pairs turned."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


# Copied from 06_symmem/baseline_symmem_tp.py: joint_bias
def joint_bias(linears: tuple[nn.Linear, ...]) -> torch.Tensor | None:
    """The biases of linears multiplied as one (their rows side by side): None if none has one,
    zeros for one that has none."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.weight.new_zeros(linear.weight.shape[0]) if linear.bias is None
                      else linear.bias for linear in linears])  # rows kept: not out_features


# Copied from 06_symmem/baseline_symmem_tp.py: plus_bias
def plus_bias(y: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A row-parallel output with its linear's bias, if any: added once, to the reduced shard."""
    return y if linear.bias is None else y + linear.bias


# Copied from 06_symmem/baseline_symmem_tp.py: unsupported_feature
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


# Copied from 06_symmem/baseline_symmem_tp.py: TensorParallelLlamaLayer
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


# Copied from 06_symmem/baseline_symmem_tp.py: TensorParallelDecoder
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


# Copied from 06_symmem/baseline_symmem_tp.py: same_weights_as_first_rank
def same_weights_as_first_rank(model: nn.Module, group=None) -> None:
    """Every rank of the group starts from its first rank's weights (as DDP does), before the
    blocks are sliced: ranks seeded differently still split one model."""
    src = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)


# Copied from 06_symmem/baseline_symmem_tp.py: tensor_parallel
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


# Copied from 06_symmem/baseline_symmem_tp.py: TensorParallelRun
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


# Copied from 06_symmem/baseline_symmem_tp.py: tensor_parallel_setup
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


def measured_overlap(comm, device: torch.device) -> float | None:
    """Over all ranks, the share of the peers' chunks' time to arrive not spent waiting for them
    (spent multiplying and copying): None where nothing was timed (CUDA, or no peers)."""
    totals = torch.tensor([comm.waited, comm.arriving], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return None if totals[1] == 0 else 1 - (totals[0] / totals[1]).item()


def collectives(args, topo: common.Topology):
    if topo.device.type == "cuda":
        return SymmetricMemoryCollectives(topo)
    d = common.SIZES[args.size].d_model  # every message TP moves is d wide
    return SegmentCollectives(topo, args.seq_len * args.batch_size, d, args.timeout)


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


# Copied from 06_symmem/baseline_symmem_tp.py: tp_theory
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
    run = tensor_parallel_setup(common.parser(__doc__), collectives)
    settings, topo, model = run.settings, run.topo, run.model
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, fused=True)
    comm = model.comm
    steps = itertools.count()

    def train_step(inputs, targets):
        if next(steps) == settings.warmup:  # overlap counts the timed steps only
            comm.waited = comm.arriving = 0
        run.grads.zero_()
        comm.loaded_bytes = 0
        loss = model(inputs, targets)
        loss.backward()
        dist.all_reduce(run.grads[:run.replicated])  # the replicated parts, each rank's share
        opt.step()
        return loss.detach() * topo.world_size  # averaged over ranks: the whole batch's loss

    stats = common.timed_steps(train_step, run.batches, settings, topo, memory_of=(model, opt),
                               dp_world=1)
    overlap = measured_overlap(comm, topo.device)
    common.record(settings, topo, stats, baseline="baseline_symmem_tp", model=model, optimizer=opt,
                  comm_mb=comm.loaded_bytes / 2**20 + stats.comm_mb, dp_world=1,
                  params=run.params, loss_tolerance=LOSS_TOLERANCE[settings.dtype], overlap=overlap,
                  transport="cuda symmetric memory" if topo.device.type == "cuda"
                  else "/dev/shm segment", process_group_mb=stats.comm_mb,
                  theory=tp_theory(settings, topo, model, run.replicated))


if __name__ == "__main__":
    common.run_main(main)
