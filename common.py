"""Shared plumbing for every recipe: topology, the reference workload, timing, memory, results.

Techniques never live here. This file only holds what every script needs so that their
comparisons are fair: the same model, the same data in the same order, the same clock and the
same way of counting memory. Copying one recipe plus this file is enough to run it.

    python common.py mark-failed SCRIPT ... # used by the Makefile when a run died without a record

Everything that reads results rather than training (the report, traces, charts, the planner)
is in report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import functools
import gc
import importlib.metadata
import itertools
import json
import math
import os
import platform
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "outputs" / "results.jsonl"
_IMPORTED_AT = time.perf_counter()


# ---------------------------------------------------------------------------------------------
# Size presets. `tiny` is for tests, `small` the CPU default, `medium`/`large` the GPU defaults.
# The long_* fields are the shape the attention recipes use, where the T x T scores dominate.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int  # per rank
    long_seq_len: int
    long_batch_size: int
    resnet: str
    image_size: int


SIZES = {  # vocab, d_model, layers, heads, seq, batch, long seq, long batch, resnet, image px
    "tiny": Size(128, 64, 2, 4, 32, 4, 128, 2, "resnet18", 16),
    "small": Size(1024, 256, 6, 8, 128, 4, 768, 1, "resnet18", 32),
    "medium": Size(32768, 768, 12, 12, 1024, 8, 4096, 2, "resnet50", 128),
    "large": Size(32768, 2048, 18, 16, 1024, 4, 4096, 1, "resnet101", 224),
}


def gpt_param_count(size: Size, seq_len: int) -> int:
    """Parameters of `GPT(size, seq_len)` without building it (the head is tied)."""
    d = size.d_model
    per_block = 12 * d * d + 13 * d  # qkv, proj, fc, fc_proj weights and biases, two LayerNorms
    return size.vocab_size * d + seq_len * d + size.n_layers * per_block + 2 * d


# ---------------------------------------------------------------------------------------------
# Flags shared by every script. Bad values end with one line that names the flag to change.
# ---------------------------------------------------------------------------------------------
class RecipeParser(argparse.ArgumentParser):
    """argparse with one-line errors and size-dependent defaults filled in after parsing."""

    def __init__(self, doc: str | None, long_context: bool = False):
        # --help shows the whole module docstring: what the technique is, how to run it, theory.
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.long_context = long_context
        self.output_only: set[str] = set()  # flags that change what is printed, not what runs

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None) -> argparse.Namespace:
        ns = super().parse_args(args, namespace)
        _RUN["args"] = ns  # a run that skips before `setup` is recorded too
        shape = self.fill_shape(ns)
        if ns.model == "resnet" and ns.batch_size < 2:
            self.error("--model resnet needs --batch-size >= 2 (BatchNorm normalises over the "
                       "batch)")
        if ns.dtype is None:
            ns.dtype = "bf16" if torch.cuda.is_available() else "fp32"
        if ns.trace and ns.warmup < 3:
            self.error("--trace profiles the two warm-up steps before the last (which measures "
                       "memory): use --warmup 3 or more")
        # With them, the script's own flags that differ from their defaults name the run's
        # variant: the report shows `optimized_fsdp --wrap root` as a row of its own.
        ns.variant = " ".join(shape + [
            f"--{a.dest.replace('_', '-')}" + ("" if v is True else f" {_flag_text(v)}")
            for a in self._actions[self.shared_flags:] if a.dest not in {"help", *self.output_only}
            for v in [getattr(ns, a.dest)] if v != _parsed_default(a)]) or None
        return ns

    def fill_shape(self, ns: argparse.Namespace) -> list[str]:
        """Fill in the size's batch and sequence length where no flag gave them. Returns the
        flags that chose others: another workload, which names the run's variant too (06's
        `--batch-size 1 --seq-len 32` row beside its default one)."""
        size = SIZES[ns.size]
        sized = {"seq_len": size.long_seq_len if self.long_context else size.seq_len,
                 "batch_size": size.long_batch_size if self.long_context else size.batch_size}
        shape = [f"--{dest.replace('_', '-')} {value}" for dest in ("batch_size", "seq_len")
                 if (value := getattr(ns, dest)) not in
                 (None, self.get_default(dest) if self.get_default(dest) is not None
                  else sized[dest])]
        for dest, value in sized.items():
            if getattr(ns, dest) is None:
                setattr(ns, dest, value)
        return shape

    def add_summary_flag(self) -> None:
        """`--summary` (see `print_summary`); it prints more, so the run is no variant."""
        self.add_argument("--summary", action="store_true",
                          help="print each rank's parameter, gradient and optimizer MB beside "
                               "the formula, its peak memory and the MB it sent per step")
        self.output_only.add("summary")


def _parsed_default(action: argparse.Action):
    """A flag's default as parsing leaves it (argparse converts a string default by its type)."""
    if isinstance(action.default, str) and action.type is not None:
        return action.type(action.default)
    return action.default


def _flag_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type for counts: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """argparse type for sizes and rates: a float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def message_sizes(text: str) -> list[int]:
    """argparse type for a sweep's message sizes: comma-separated bytes with an optional K, M or G
    (powers of 1024), e.g. `4K,64K,16M`; each > 0 and whole fp32 values."""
    sizes = []
    for item in text.split(","):
        number, unit = item.strip().upper(), 1
        if number[-1:] in ("K", "M", "G"):
            number, unit = number[:-1], 1024 ** ("KMG".index(number[-1]) + 1)
        try:
            value = int(float(number) * unit)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 4K,64K,16M, got {item!r}") \
                from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"a message size must be > 0 bytes, got {item!r}")
        if value % 4:
            raise argparse.ArgumentTypeError(f"a message is fp32 values: {item!r} is {value} "
                                             "bytes, use a multiple of 4")
        sizes.append(value)
    return sizes


def parser(doc: str | None, long_context: bool = False) -> RecipeParser:
    """The shared flags; a script adds its own. `long_context` picks the long-sequence shape."""
    p = RecipeParser(doc, long_context)
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="model/data preset (default: small)")
    p.add_argument("--model", default="gpt", choices=["gpt", "resnet"],
                   help="workload: the GPT decoder or a torchvision ResNet classifier")
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
    p.shared_flags = len(p._actions)
    return p


# ---------------------------------------------------------------------------------------------
# Topology: torchrun's environment, SLURM's (`srun python script.py`), or a world of one for a
# plain `python script.py`.
# ---------------------------------------------------------------------------------------------
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


_RUN: dict = {}  # args and topology of this process, so run_main can record a failure


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """The variables torchrun would set, from those `srun` sets for each task.

    MASTER_ADDR is the job's first host and MASTER_PORT (unless set) is derived from the job
    id, so every task of a job agrees without talking, and two jobs on one node do not clash.
    """
    node = int(env.get("SLURM_NODEID", "0"))
    local_world = env.get("SLURM_NTASKS_PER_NODE") or str(
        slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], node))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": local_world,
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"]),
            "MASTER_PORT": env.get("MASTER_PORT")
            or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)}


def _restarted_group_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun restart (--max-restarts), the agent's store still holds the keys of the
    group that died, such as a dead peer's address, which the new group could read before its
    own peer overwrites it ("Connection refused"): give each restart a key prefix of its own.
    None (the usual env:// store) otherwise."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                is_master=False, timeout=timeout)
    return dist.PrefixStore(f"restart-{restart}", agent_store)


def launch_rank() -> int:
    """This process's rank as its launcher set it (torchrun or srun), before `setup`."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def launch_world_size() -> int:
    """The world size the launcher set, before `setup`: for checks that need no group."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def skip_unless_pipelined(world: int, stages: int, size: str) -> None:
    """The world size is the host's (the Makefile's NPROC: its GPUs), not a flag: where a
    pipeline of `stages` stages cannot use it, the run is skipped with why, not refused."""
    layers = SIZES[size].n_layers + 2  # embeddings, blocks, norm + head + loss
    if world == 1:
        raise Skip("a pipeline runs its stages on two or more processes: launch two or more")
    if stages > layers:
        raise Skip(f"--size {size} has {layers} layers, fewer than the {stages} stages on "
                   f"{world} processes: use fewer processes or a larger --size")


def cuda_device_index(local_rank: int, local_world: int, visible: int, per_task: bool) -> int:
    """The GPU this process drives, of the `visible` ones. torchrun starts a host's processes
    with the same GPUs visible, so local rank i takes the i-th; `srun --gpus-per-task`
    (`per_task`) shows each task only its own, so it takes the first. Fewer GPUs than
    processes otherwise would put two ranks on one GPU, which NCCL refuses."""
    if visible >= local_world:
        return local_rank
    if per_task and visible >= 1:
        return 0
    raise SetupError(f"{local_world} processes on this host but {visible} GPU(s) visible to "
                     f"each: run one process per GPU (NPROC={visible})")


def setup(args: argparse.Namespace) -> Topology:
    """Join the process group: NCCL and one GPU per local rank with CUDA, else gloo on CPU."""
    _RUN["args"] = args
    from_srun = "RANK" not in os.environ and "SLURM_PROCID" in os.environ
    per_task = from_srun and "SLURM_GPUS_PER_TASK" in os.environ  # each task its own GPUs
    if from_srun:  # `srun python script.py`
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
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout, store=_restarted_group_store(timeout),
                            rank=rank, world_size=world,
                            device_id=device if backend == "nccl" else None)
    topo = Topology(rank, local_rank, world, local_world, max(1, world // local_world),
                    backend, device)
    _RUN["topo"] = topo
    return topo


def peer_access_problem(topo: Topology) -> str | None:
    """Why this host's GPUs cannot map each other's memory, which symmetric memory needs, or
    None. Every rank checks its GPU against the others its host's ranks use, and all ranks
    agree on the answer: one that went on alone would wait forever in the rendezvous."""
    if topo.nnodes > 1:
        return "symmetric memory maps the GPUs of one host: run on one node (NNODES=1)"
    me, used = topo.device.index, min(torch.cuda.device_count(), topo.local_world_size)
    lacking = [k for k in range(used) if k != me and not torch.cuda.can_device_access_peer(me, k)]
    everyone = [None] * topo.world_size
    dist.all_gather_object(everyone, lacking)
    if any(everyone):
        return ("this host's GPUs cannot access each other's memory (no NVLink, no PCIe "
                "peer-to-peer), which symmetric memory maps: nothing to measure here")
    return None


def log(topo: Topology, message: str) -> None:
    if topo.is_main:
        print(message, flush=True)


# PyTorch 2.14 names the tensor-to-tensor all-gather and reduce-scatter `all_gather_single` and
# `reduce_scatter_single` (the old names now warn); older releases, such as a GPU image's
# preinstalled torch, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# c10d op: (argument holding the tensor(s) sent, argument holding the group, bytes a rank of a
# group of N sends per byte of that tensor, as ring algorithms move them)
_SENT_PER_BYTE = {
    "allreduce_": (0, 1, lambda n: 2 * (n - 1) / n),
    "_allgather_base_": (1, 2, lambda n: n - 1),
    "_reduce_scatter_base_": (1, 2, lambda n: (n - 1) / n),
    "alltoall_base_": (1, 2, lambda n: (n - 1) / n),
    "broadcast_": (0, 1, lambda n: (n - 1) / n),  # pipelined: all ranks but one forward it once
    "send": (0, 1, lambda n: 1),
}


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends in the collectives issued in its context (on this
    thread), from the tensors handed to them: all-reduce 2(N-1)/N x the tensor, all-gather
    (N-1) x the input, reduce-scatter, all-to-all and broadcast (N-1)/N x the tensor (for a
    broadcast, the average over ranks), send the tensor."""

    def __init__(self):
        super().__init__()
        self.bytes = 0.0
        self.by_kind: dict[str, float] = {}  # "<collective> <dtype>" -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("c10d::")
        if func.namespace == "c10d" and name in _SENT_PER_BYTE:
            sent, group, per_byte = _SENT_PER_BYTE[name]
            tensors = args[sent] if isinstance(args[sent], list) else [args[sent]]
            n = dist.ProcessGroup.unbox(args[group]).size()
            for t in tensors:
                sent_bytes = per_byte(n) * t.numel() * t.element_size()
                dtype = str(t.dtype).removeprefix("torch.")
                kind = f"{name.strip('_').removesuffix('_base')} {dtype}"  # "allgather uint8"
                self.bytes += sent_bytes
                self.by_kind[kind] = self.by_kind.get(kind, 0.0) + sent_bytes
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# The reference workload: a GPT-style decoder and learnable synthetic tokens.
# ---------------------------------------------------------------------------------------------
def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default attention: PyTorch's fused kernel. Shapes (batch, heads, seq, head_dim)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


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
    """Final norm, head and mean cross-entropy: a pipeline's last layer (the GPT's own modules)."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPT(nn.Module):
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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tok_emb(tokens) + self.pos_emb(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as the ordered layers a pipeline cuts into stages: the embeddings, each
        block, then the final norm, head and loss (`layers[-1](x, targets)`). They are this
        model's own modules, so cutting changes neither the parameters nor their initialisation;
        run in order under the model's autocast they compute `forward` (a unit test checks it).
        The head's weight is the embedding's: cut apart, the first and last stages each hold it,
        and a pipeline sums its two gradients every step (as Megatron-LM does)."""
        return [Embeddings(self.tok_emb, self.pos_emb), *self.blocks,
                LossHead(self.ln_f, self.head)]

    def pipeline_stages(self, n: int) -> list[list[nn.Module]]:
        """`pipeline_layers` cut into n contiguous stages of about equal compute, a layer's
        counted as the weights of its matrix multiplies (2 FLOPs each a token; the embedding
        lookups, norms and the attention's own product are small beside them)."""
        layers = self.pipeline_layers()
        costs = [sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, nn.Linear))
                 for layer in layers]
        return [[layers[i] for i in stage] for stage in cut_into_stages(costs, n)]


def cut_into_stages(costs: list[int], stages: int) -> list[range]:
    """Contiguous stages of about equal cost, each of at least one layer: stage s ends where the
    running cost comes nearest to s/stages of the total (the embeddings cost nearly nothing and
    the head a third of a block at `small`, so equal numbers of layers would not balance)."""
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


def global_token_batch(size: Size, seq_len: int, global_batch: int, step: int, seed: int
                       ) -> torch.Tensor:
    """Step `step`'s whole global batch, (global_batch, seq_len + 1) tokens.

    Tokens follow a fixed random permutation of the vocabulary (next = P[prev]) except for 10%
    uniform noise: a pattern a small model learns within tens of steps, with a loss floor near
    0.1 x ln(10 x vocab). The batch depends only on (seed, step, global_batch), never on the
    world size.
    """
    table = torch.randperm(size.vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
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


def workload(args: argparse.Namespace, topo: Topology, attention: Callable = causal_sdpa,
             dp_rank: int | None = None, dp_world: int | None = None
             ) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (same init on every rank) and this rank's (inputs, targets) for every step.

    Data-parallel rank `dp_rank` of `dp_world` takes the dp_rank-th slice of each global batch
    of `dp_world * batch_size` samples, so N ranks with batch b see exactly the samples that one
    rank with batch N*b sees. Batches are made up front: data loading is not what is measured.
    """
    dp_rank = topo.rank if dp_rank is None else dp_rank
    dp_world = topo.world_size if dp_world is None else dp_world
    size = SIZES[args.size]
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    torch.manual_seed(args.seed)
    global_batch = dp_world * args.batch_size
    batches = []
    for step in range(args.warmup + args.steps):
        if args.model == "gpt":
            tokens = global_token_batch(size, args.seq_len, global_batch, step, args.seed)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        else:
            inputs, targets = global_image_batch(size, global_batch, step, args.seed)
        batches.append((rank_slice(inputs, dp_rank, dp_world).to(topo.device),
                        rank_slice(targets, dp_rank, dp_world).to(topo.device)))
    if args.model == "gpt":
        model = GPT(size, args.seq_len, attention, autocast_dtype)
    else:
        model = Classifier(size.resnet, NUM_CLASSES, autocast_dtype)
    return model.to(topo.device), batches


def items_per_step(args: argparse.Namespace, dp_world: int) -> int:
    """Global tokens (GPT) or images (ResNet) consumed by one optimizer step."""
    per_sample = args.seq_len if args.model == "gpt" else 1
    return dp_world * args.batch_size * per_sample


# ---------------------------------------------------------------------------------------------
# Timing and memory.
# ---------------------------------------------------------------------------------------------
@dataclass
class Stats:
    step_ms: float
    step_ms_p90: float
    step_ms_iqr: tuple[float, float]  # first and third quartiles: the spread of the timed steps
    startup_s: float  # `import common` (torch already imported) to the first timed step
    warmup_s: float
    # the host's 1-minute load average at the first timed step and after the last: whether other
    # work shared the cores while the steps were timed (report.py reads it)
    load_avg: tuple[float, float]
    losses: list[float]
    memory: dict[str, float] | None = None  # the last warm-up step's peak MB (its split: CPU)
    comm_mb: float | None = None  # sent by this rank in the last warm-up step, counted
    comm_mb_by_kind: dict[str, float] | None = None  # the same, by collective and dtype


def summarize_times(seconds: Sequence[float]) -> tuple[float, float, tuple[float, float]]:
    """Median, 90th percentile (nearest rank) and the first and third quartiles (interpolated
    between ranks, as numpy's default) of step times, in milliseconds."""
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


def time_calls(call: Callable[[], object], prepare: Callable[[], object],
               check: Callable[[], bool], what: str, iters: int, warmup: int,
               device: torch.device) -> float:
    """Median milliseconds of `call` over `iters` timed runs after `warmup` untimed ones; before
    each, `prepare` (untimed: refill the input) and a barrier, and the device is synchronised
    before the clock is read. After each, untimed, `check` must hold (every result is checked,
    so a stale read in any run fails it). A run's time is the shortest any rank measured: ranks
    leave a barrier tens of microseconds apart, and the last to leave waits for nobody, so its
    time is the call's and not the barrier's skew (which would otherwise swamp a small message).
    """
    times = []
    for i in range(warmup + iters):
        prepare()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        call()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if not check():
            raise RuntimeError(f"{what} returned a wrong result (call {i + 1})")
    shortest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
    return 1e3 * statistics.median(shortest.tolist())


# busbw = algbw x this: the share of the message each rank's link carries (nccl-tests' convention)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0}


def sweep_entry(op: str, nbytes: int, ms: float, world: int) -> dict:
    """One row of a collectives sweep: algbw = bytes / time, busbw = algbw x BUS_FACTOR."""
    algbw = nbytes / (ms / 1e3) / 1e9
    def digits(x: float) -> float:
        return float(f"{x:.4g}")
    return {"op": op, "bytes": nbytes, "ms": digits(ms), "algbw_gbps": digits(algbw),
            "busbw_gbps": digits(algbw * BUS_FACTOR[op](world))}


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
    """Run `step` once; return its result and the peak of live tensor bytes during it, in MB.

    Counted from the tensors by PyTorch's MemTracker (a dispatch mode: every op's outputs, and
    storages as FSDP resizes them), so neither PyTorch's own memory nor the allocator's caching
    is in it. What lives before the step counts from its start: the modules and optimizers in
    `tracked` by kind, every other live tensor (hook state, DDP's buckets) as `other`. Ops run
    on another thread (a communication hook's completion callback) are not seen. The result has
    the total and its split at the peak: params, grads, optim, activations, other.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class LeafSafeModTracker(ModTracker):
        """ModTracker marks a module's backward done by a hook on all its inputs' gradients,
        which PyTorch cannot count for a leaf input under `autograd.grad` (a pipeline stage's
        received activations, in torch.distributed.pipelining's split backward): leaves are
        left out of that hook; only per-module stats, unused here, would see it."""

        def _fw_pre_hook(self, mod: nn.Module, inputs) -> None:
            super()._fw_pre_hook(mod, tuple(a for a in inputs if not (
                isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)))

    class StepTracker(MemTracker):
        """MemTracker refuses a root module called twice (it keeps per-module stats, which are
        not used here): start that module's afresh at each micro-batch (only its own: a
        pipeline rank's other stage may be between its forward and its backward)."""

        def __init__(self):
            super().__init__()
            self._mod_tracker = LeafSafeModTracker()

        def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                    set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            """A buffer labelled after it was made (a backward hook allocates a gradient bucket,
            then makes parameters' .grad views into it) is relabelled at the peak it made too."""
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            current = self._curr_mem_snap.get(winfo.device, {})
            if old_reftype is not None and current.get("Total") == \
                    self._peak_mem.get(winfo.device):
                self._peak_mem_snap[winfo.device] = dict(current)

    tracker = StepTracker()
    # Every live tensor as `other` first (type(), not isinstance(): that reads __class__, which
    # some deprecated torch objects answer with a warning); tracking `tracked` after relabels
    # theirs by kind.
    tracker.track_external(*[o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)])
    tracker.track_external(*tracked)
    # An optimizer's parameters and their gradients count as params and grads even when they
    # are not a module's (ZeRO's shards).
    tracker.track_external(*[nn.ParameterList(g["params"]) for opt in tracked
                             if isinstance(opt, torch.optim.Optimizer) for g in opt.param_groups])
    with tracker, warnings.catch_warnings():
        # A hook that frees a gradient as soon as it is reduced (ZeRO-2) leaves MemTracker's own
        # post-accumulate hook, which runs after it, nothing to label; it warns and goes on.
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        result = step()
    peak = {str(getattr(k, "value", k)): v
            for k, v in tracker.get_tracker_snapshot("peak").get(device, {}).items()}
    split = {kind: sum(peak.get(name, 0) for name in names) / 2**20
             for kind, names in MEMORY_KINDS.items()}
    return result, {"total": peak.get("Total", 0) / 2**20, **split}


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s data on this rank: a DTensor's local shard, and the
    inner tensors of a wrapper subclass (torchao's float8 weights) rather than the wrapper."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _plain(getattr(t, name))]
    return [t]


def tensor_mb(tensors: Iterable[torch.Tensor]) -> float:
    """Bytes of the distinct storages holding `tensors`, as allocated: a tensor reached twice (a
    tied weight) or views into one buffer (ZeRO's flat parameters, DDP's gradient buckets) count
    the buffer once, padding included; a freed storage (resized to zero) counts nothing."""
    seen, total = set(), 0
    for t in (p for tensor in tensors for p in _plain(tensor)):
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
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


def ring_allreduce_mb(nbytes: float, world: int) -> float:
    """MB each rank sends in a ring all-reduce of `nbytes`: 2(N-1)/N x nbytes."""
    return 2 * (world - 1) / world * nbytes / 2**20


def ddp_bucket_bytes(model: nn.Module) -> list[int]:
    """Byte sizes of the gradient buckets a DistributedDataParallel model all-reduces each step.

    Read from DDP's own logging data: DDP starts with provisional buckets and, after the first
    steps, rebuilds them in the order gradients actually became ready; those are what it sends.
    """
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def timed_steps(train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                batches: list[tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
                topo: Topology, memory_of: Sequence = (), loss_rank: int | None = None,
                dp_world: int | None = None) -> Stats:
    """Run every batch through `train_step`; time the steps after the warm-up.

    Each step is bracketed by device synchronisation, so the time is the whole step. The loss
    of each step is averaged over ranks once at the end, outside the clock; with `loss_rank`
    (a pipeline's last stage, the only one that computes it) it is that rank's, which also
    prints the progress lines. `dp_world`: the ranks that each take their own share of the
    batch, for tokens/s (default: all; a pipeline's ranks share one batch: 1). The last
    warm-up step (optimizer state exists, nothing is timed or traced) counts the bytes this
    rank sends (`CollectiveBytes`) and measures the peak memory of that one step: on CPU under
    `peak_tensor_memory`, with the model and optimizer given as `memory_of` counted by kind; on
    CUDA the allocator's peak, reset just before it (not the whole process's: the unsharded
    model before FSDP sharded it, a validation replica, compile workspaces).
    """
    n = len(batches)
    every = args.log_every or max(1, n // 10)
    times, losses, memory, comm_mb, comm_by_kind = [], [], None, None, None
    traced = range(max(0, args.warmup - 3), args.warmup - 1) if args.trace else range(0)
    phase_hooks = nvtx_phase_ranges(memory_of) if topo.device.type == "cuda" else []
    for i, (inputs, targets) in enumerate(batches):
        if i == args.warmup:
            load_start = os.getloadavg()[0]
        if traced and i == traced.start:
            profiler = torch.profiler.profile(activities=_profiler_activities(topo.device),
                                              record_shapes=True)  # bytes per collective
            profiler.start()
        with step_range(i, topo.device, named=i in traced):
            _sync(topo.device)
            start = time.perf_counter()
            if i == args.warmup - 1:  # the last untimed step: count bytes sent and memory
                with CollectiveBytes() as sent:
                    if topo.device.type == "cuda":  # this step's peak, the window CPU counts
                        torch.cuda.reset_peak_memory_stats(topo.device)
                        loss = train_step(inputs, targets)
                        _sync(topo.device)
                        memory = {"total": torch.cuda.max_memory_allocated(topo.device) / 2**20}
                    elif memory_of:
                        loss, memory = peak_tensor_memory(
                            functools.partial(train_step, inputs, targets), memory_of, topo.device)
                    else:
                        loss = train_step(inputs, targets)
                comm_mb, comm_by_kind = sent.bytes / 2**20, {k: v / 2**20 for k, v in
                                                              sent.by_kind.items()}
            else:
                loss = train_step(inputs, targets)
            _sync(topo.device)
            elapsed = time.perf_counter() - start
        if traced and i == traced[-1]:
            # A collective the step left in flight (ZeRO's all-gathers, waited for in the next
            # forward) keeps the profiler's thread-local state until it runs; if that is after
            # stop(), dropping its handle crashed (torch 2.14, gloo). gloo's barrier waits for
            # every earlier collective of the group.
            dist.barrier()
            profiler.stop()
            _export_trace(profiler, args, topo)
        if i == args.warmup:
            startup_s = start - _IMPORTED_AT
        times.append(elapsed)
        losses.append(loss.detach().float().reshape(()))
        if ((i + 1) % every == 0 or i == n - 1) and topo.rank == (loss_rank or 0):
            print(f"step {i + 1:4d}/{n} | rank-{topo.rank} loss {loss.item():.4f} | "
                  f"{1e3 * elapsed:8.1f} ms | "
                  f"{items_per_step(args, dp_world or topo.world_size) / elapsed:10,.0f} "
                  f"{'tok' if args.model == 'gpt' else 'img'}/s | "
                  f"mem {peak_memory_mb(topo.device):,.0f} MB", flush=True)
    load_end = os.getloadavg()[0]
    for hook in phase_hooks:
        hook.remove()
    mean_losses = torch.stack(losses)
    if loss_rank is None:
        dist.all_reduce(mean_losses)
        mean_losses = (mean_losses / topo.world_size).tolist()
    else:
        dist.broadcast(mean_losses, src=loss_rank)
        mean_losses = mean_losses.tolist()
    diverged = [step for step, loss in enumerate(mean_losses, 1) if not math.isfinite(loss)]
    if diverged:  # a run that diverged is not a result, however fast it was
        raise FloatingPointError(f"the loss is not finite from step {diverged[0]} on: "
                                 f"lower --lr or use --dtype fp32")
    step_ms, p90, iqr = summarize_times(times[args.warmup:])
    return Stats(step_ms, p90, iqr, startup_s, sum(times[:args.warmup]), (load_start, load_end),
                 mean_losses, memory, comm_mb, comm_by_kind)


@contextlib.contextmanager
def step_range(i: int, device: torch.device, named: bool):
    """Step `i` as a range: `ProfilerStep#i` in a trace (`named`; the name torch.profiler and
    HolisticTraceAnalysis split iterations by, which report.py's breakdown reads too) and, on
    CUDA, an NVTX range `step i`, so an `nsys profile` timeline shows the same steps."""
    with contextlib.ExitStack() as stack:
        if named:
            stack.enter_context(torch.profiler.record_function(f"ProfilerStep#{i}"))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.nvtx.range(f"step {i}"))
        yield


def nvtx_phase_ranges(memory_of: Sequence) -> list:
    """NVTX ranges `forward` (each forward of the model) and `optimizer` (each optimizer step),
    from hooks on what `timed_steps` was given; the backward, with its communication, is what
    lies between them. A pipeline's stages are never called as a whole, so they get no
    `forward` (their F/B/W actions are in the record's `timeline`). Returns the hook handles.

    The hooks return None: a forward pre-hook's return value would replace the module's inputs,
    a forward hook's its output, and a step pre-hook's the optimizer's arguments, while
    `range_push`/`range_pop` return the nesting depth (an int)."""
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


def _profiler_activities(device: torch.device) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


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


def render_timeline(timelines: Sequence[Sequence[tuple[str, int, int, float, float]]],
                    width: int = 96) -> str:
    """One step of a pipeline as text: a row per rank, a column per 1/width of the step; an
    action (kind, micro-batch, stage, start, end in seconds) is its label (`F3`) then its kind
    letter, in lower case when it is not the rank's first stage (DualPipe's second); idle time
    is '.'."""
    t0 = min(a[3] for tl in timelines for a in tl)
    scale = width / (max(a[4] for tl in timelines for a in tl) - t0)
    rows = [f"one step, {1e3 * width / scale:.1f} ms, {1e3 / scale:.2f} ms a column:"]
    for rank, tl in enumerate(timelines):
        row, first_stage = ["."] * width, min(a[2] for a in tl)
        for kind, mb, stage, start, end in tl:
            kind = kind if stage == first_stage else kind.lower()
            first = min(round((start - t0) * scale), width - 1)
            label = f"{kind}{mb}"
            for k in range(first, max(first + 1, min(width, round((end - t0) * scale)))):
                row[k] = label[k - first] if k - first < len(label) else kind
        rows.append(f"rank {rank:2d} |{''.join(row)}|")
    return "\n".join(rows)


def write_timeline_trace(timelines: Sequence[Sequence[tuple[str, int, int, float, float]]],
                         args: argparse.Namespace, topo: Topology) -> None:
    """The same step as a Chrome/Perfetto trace, a track per rank, in the traces/ folder beside
    the results file (rank 0 writes it)."""
    if not topo.is_main:
        return
    t0 = min(a[3] for tl in timelines for a in tl)
    events = [{"name": f"rank {r}", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
              for r in range(len(timelines))]
    events += [{"name": f"{kind}{mb}", "cat": kind, "ph": "X", "pid": 0, "tid": r,
                "ts": 1e6 * (start - t0), "dur": 1e6 * (end - start),
                "args": {"micro-batch": mb, "stage": stage}}
               for r, tl in enumerate(timelines) for kind, mb, stage, start, end in tl]
    folder, script = _script_identity()
    path = args.results.parent / "traces" / f"{folder}_{script}_timeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    log(topo, f"timeline of one step written to {path} (open in https://ui.perfetto.dev)")


def clock_offset(topo: Topology, rounds: int = 10) -> float:
    """What to add to this rank's `time.perf_counter()` to read rank 0's: from the round trip
    to rank 0 with the least delay of `rounds` (NTP's estimate: rank 0 read its clock halfway),
    right to within half that round trip, whatever the ranks' clocks or nodes."""
    stamp, best = torch.zeros(1, dtype=torch.float64, device=topo.device), (math.inf, 0.0)

    def receive(src: int) -> None:  # until it is here: NCCL's recv returns once it is queued
        dist.recv(stamp, src)
        if topo.device.type == "cuda":
            torch.cuda.synchronize(topo.device)

    for peer in range(1, topo.world_size):
        for _ in range(rounds):
            if topo.rank == 0:
                receive(peer)
                stamp.fill_(time.perf_counter())
                dist.send(stamp, peer)
            elif topo.rank == peer:
                sent = time.perf_counter()
                dist.send(stamp, 0)
                receive(0)
                back = time.perf_counter()
                best = min(best, (back - sent, stamp.item() - (sent + back) / 2))
    return best[1]


def gather_timelines(steps: list[tuple[float, list[tuple[str, int, int, float, float]]]],
                     held: int, args: argparse.Namespace, topo: Topology
                     ) -> tuple[list[list[list[tuple]]], float, list[dict[str, float]], int]:
    """A pipeline's timed steps from every rank, each (its start, its actions: kind, micro-batch,
    stage, start, end) on the rank's own clock. Each rank's clock is read on rank 0's through
    `clock_offset`, and each step's times count from its common reference: the moment its first
    rank started it. No barrier: it would stop the ranks overlapping one step's end with the
    next's start. Rank 0 prints the last step's timeline and writes its trace. Returns the
    steps (a timeline per rank, in seconds from the reference); the mean idle fraction of a
    step, the bubble: 1 - busy time / (ranks x the time to its last action's end); each rank's
    mean time of each kind of action; and the most micro-batches' activations a rank `held`."""
    gathered = [None] * topo.world_size
    dist.all_gather_object(gathered, (steps, held, clock_offset(topo)))
    timed = []
    for ranks in zip(*[[(start + off, [(*a[:3], a[3] + off, a[4] + off) for a in actions])
                        for start, actions in rank] for rank, _, off in gathered], strict=True):
        reference = min(start for start, _ in ranks)
        timed.append([[(*a[:3], a[3] - reference, a[4] - reference) for a in actions]
                      for _, actions in ranks])
    bubble = statistics.mean(1 - sum(a[4] - a[3] for tl in ranks for a in tl)
                             / (len(ranks) * max(a[4] for tl in ranks for a in tl))
                             for ranks in timed)
    means = [{kind: statistics.mean(a[4] - a[3] for _, acts in rank for a in acts if a[0] == kind)
              for kind in {a[0] for _, acts in rank for a in acts}} for rank, _, _ in gathered]
    log(topo, render_timeline(timed[-1]))
    write_timeline_trace(timed[-1], args, topo)
    return timed, bubble, means, max(n for _, n, _ in gathered)


# ---------------------------------------------------------------------------------------------
# Results: one JSON line per run, appended by rank 0.
# ---------------------------------------------------------------------------------------------
def _script_identity() -> tuple[str, str]:
    path = Path(sys.argv[0]).resolve()
    return path.parent.name, path.stem


def _device_name(device: torch.device | None = None) -> str:
    """The GPU's name, or `cpu`; without a device, what `setup` would pick on this host."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _installed_version(package: str) -> str | None:
    """From the package's metadata, without importing it; None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _base_record(args: argparse.Namespace | None, topo: Topology | None, baseline: str | None,
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
        "device": _device_name(topo.device if topo else None),
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


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def record(args: argparse.Namespace, topo: Topology, stats: Stats, *, baseline: str | None,
           model: nn.Module, optimizer: torch.optim.Optimizer | None, comm_mb: float | None,
           theory: dict, loss_tolerance: float | None = None, dp_world: int | None = None,
           **extra) -> dict:
    """Append this run's result (rank 0) and print its one-line summary. `dp_world` as in
    `timed_steps`."""
    items = items_per_step(args, dp_world or topo.world_size)
    # The report shows the busiest rank: on CPU the one with the most live tensor bytes, and the
    # most state (a pipeline's ranks hold stages of different sizes).
    ranks = [None] * topo.world_size
    dist.all_gather_object(ranks, (peak_memory_mb(topo.device), stats.memory,
                                   state_mb(model, optimizer)))
    allocator_peak = max(peak for peak, _, _ in ranks)
    memory = max((m for _, m, _ in ranks if m), key=lambda m: m["total"], default=None)
    rec = _base_record(args, topo, baseline, "ok", None)
    rec.update({
        "params": sum(p.numel() for p in model.parameters()),  # a tied weight counts once
        "step_ms": round(stats.step_ms, 3), "step_ms_p90": round(stats.step_ms_p90, 3),
        "step_ms_iqr": [round(q, 3) for q in stats.step_ms_iqr],
        # the host's: the load average counts every runnable task on it, as cpu_count counts
        # every core (a container's affinity may list fewer)
        "load_avg": [round(load, 2) for load in stats.load_avg], "cpus": os.cpu_count(),
        ("tokens_per_s" if args.model == "gpt" else "samples_per_s"):
            round(items / (stats.step_ms / 1e3), 1),
        "peak_mem_mb": round(memory["total"] if memory else allocator_peak, 1),
        "state_mb": round(max(state for _, _, state in ranks), 2),
        "comm_mb": None if comm_mb is None else round(comm_mb, 3),
        "losses": [round(x, 6) for x in stats.losses],
        "loss_tolerance": loss_tolerance,
        "theory": {k: round(v, 3) if isinstance(v, float) else v for k, v in theory.items()},
        "steps": args.steps, "warmup": args.warmup, "batch_size": args.batch_size,
        "seed": args.seed, "lr": args.lr,
        "seq_len": args.seq_len if args.model == "gpt" else None, "dtype": args.dtype,
        "startup_s": round(stats.startup_s, 2), "warmup_s": round(stats.warmup_s, 2),
    })
    if topo.device.type == "cuda":
        rec["reserved_mb"] = round(torch.cuda.max_memory_reserved(topo.device) / 2**20, 1)
    else:
        rec["peak_rss_mb"] = round(allocator_peak, 1)
    if memory and len(memory) > 1:  # the split by kind, counted from the tensors (CPU)
        rec["memory"] = {k: round(v, 2) for k, v in memory.items() if k != "total"}
    rec.update(extra)
    if topo.is_main:
        _append(args.results, rec)
        unit = "tok/s" if args.model == "gpt" else "img/s"
        comm = "" if comm_mb is None else f", comm {comm_mb:.2f} MB/step"
        variant = f"{rec['variant']}, " if rec["variant"] else ""  # which of a script's runs
        print(f"{rec['script']}: {variant}{stats.step_ms:.1f} ms/step "
              f"(p90 {stats.step_ms_p90:.1f}), {items / (stats.step_ms / 1e3):,.0f} {unit}, "
              f"peak {rec['peak_mem_mb']:,.0f} MB, "
              f"state {rec['state_mb']:.1f} MB{comm}, final mean loss {stats.losses[-1]:.4f}",
              flush=True)
    return rec


def record_sweep(args: argparse.Namespace, topo: Topology, *, baseline: str | None,
                 sweep: list[dict], **extra) -> dict:
    """Append a collectives benchmark's result (rank 0): the sweep, no training fields."""
    rec = _base_record(args, topo, baseline, "ok", None)
    rec.update(sweep=sweep, iters=args.iters, **extra)
    if topo.is_main:
        _append(args.results, rec)
        for row in sweep:
            print(f"{rec['script']}: {row['op']:>14} {row['bytes']:>11,} B {row['ms']:9.3f} ms "
                  f"busbw {row['busbw_gbps']:7.2f} GB/s", flush=True)
        if args.trace:  # make all TRACE=1 passes it to every script
            print(f"{rec['script']}: no trace written: a sweep has no training step to break "
                  "down", flush=True)
    return rec


def print_summary(args: argparse.Namespace, topo: Topology, stats: Stats, *,
                  baseline: str | None, measured: dict[str, float], theory: dict) -> None:
    """`--summary`: a table, one row per rank, of the parameter, gradient and optimizer-state MB
    counted from that rank's tensors and the MB it sent in a step, each beside its formula, and
    its peak memory beside the baseline's (its last recorded run like this one)."""
    peak = stats.memory["total"] if stats.memory else peak_memory_mb(topo.device)
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, {**measured, "peak_mb": peak, "comm_mb": stats.comm_mb})
    if not topo.is_main:
        return
    from tabulate import tabulate

    here = _base_record(args, topo, baseline, "ok", None)
    base = next((r for r in reversed(load_results(args.results)) if r.get("script") == baseline
                 and r.get("status") == "ok" and run_key(r) == run_key(here)), None)
    kinds = ["params_mb", "grads_mb", "optim_mb"]
    table = [[rank, *[f"{row[k]:,.2f} ({theory[k]:,.2f})" for k in kinds],
              f"{sum(row[k] for k in kinds):,.2f} ({theory['state_mb']:,.2f})",
              f"{row['peak_mb']:,.1f}" + (f" ({base['peak_mem_mb']:,.1f})" if base else ""),
              f"{row['comm_mb']:,.2f} ({theory['comm_mb']:,.2f})"] for rank, row in enumerate(rows)]
    print(tabulate(table, ["rank", "params MB", "grads MB", "optim MB", "state MB", "peak MB",
                           "comm MB/step"], tablefmt="github"))
    compared = "" if baseline is None else f" ({baseline}'s busiest rank)" if base else \
        f"; {baseline} has no recorded run like this one to compare with"
    print(f"measured (formula); peak = live tensor MB at the step's peak{compared}", flush=True)


class Skip(Exception):
    """Raised when the machine lacks what the recipe needs; recorded as `skipped`, exit 0."""


class SetupError(Exception):
    """The run cannot start as launched (more processes than GPUs, say): recorded `failed`, one
    line that says what to change, exit 2, as a bad flag."""


def run_main(main: Callable[[], None]) -> None:
    """Run a recipe: skipped and failed runs still leave a record; the group is torn down.

    Run as the script itself, a run that finished (or skipped) then leaves without the
    interpreter's teardown: there, after a run had recorded its result, a rank has now and then
    aborted in C++ ("terminate called without an active exception", once in some hundred gloo
    launches), failing a good run. `faulthandler` prints where Python was if a rank aborts.
    """
    faulthandler.enable()
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
        if dist.is_initialized():
            dist.destroy_process_group()
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file and Path(main_file).resolve() == Path(sys.argv[0]).resolve():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _record_outcome(status: str, reason: str) -> None:
    """Rank 0 records a run that ends without a result, also before `setup` (a script that
    finds the world size too small for it, from its flags alone)."""
    args, topo = _RUN.get("args"), _RUN.get("topo")
    if args is not None and launch_rank() == 0:
        _append(args.results, _base_record(args, topo, None, status, reason))


# ---------------------------------------------------------------------------------------------
# Reading results back (report.py renders them; the Makefile's outcome lines check for a run's
# own record)
# ---------------------------------------------------------------------------------------------
def load_results(path: Path) -> list[dict]:
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


def max_loss_diff(losses: list[float] | None, baseline_losses: list[float] | None
                  ) -> float | None:
    """The largest per-step loss difference from the baseline's run (None: not comparable)."""
    if not losses or not baseline_losses or len(losses) != len(baseline_losses):
        return None
    return max(abs(a - b) for a, b in zip(losses, baseline_losses, strict=True))


def over_tolerance(rec: dict, base: dict | None) -> bool:
    """Whether a run's losses strayed from its baseline's further than the tolerance its script
    states: its status is then `over tolerance`, not `ok`."""
    diff = max_loss_diff(rec.get("losses"), (base or {}).get("losses"))
    tolerance = rec.get("loss_tolerance")
    return diff is not None and tolerance is not None and diff > tolerance


# ---------------------------------------------------------------------------------------------
# Runs seen from the Makefile: a failed run's one line and record, and `make smoke`
# ---------------------------------------------------------------------------------------------
_SCRIPT_ERROR = re.compile(r"^(\S+\.py: error: .*|rank \d+ failed: .*)$", re.M)
_FIRST_DEATH = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def failure_line(output: str, exit_code: int) -> str:
    """A failed run's cause in one line, from its output: the script's own error (a refused
    flag, or the line `run_main` prints before a traceback), else what torchrun saw of the
    first rank to die (a crash, a kill), else the exit code."""
    if found := _SCRIPT_ERROR.search(output):
        return found.group(1)
    # torchrun lists the other ranks' failures first, then the "Root Cause" (the first to die)
    found = _FIRST_DEATH.search(output, max(0, output.find("Root Cause")))
    who, code = (f"rank {found[1]}", int(found[2])) if found else ("a rank", exit_code)
    if code < 0:
        return f"{who} was killed by signal {-code}"
    return f"{who} exited with code {code}"


def _own_record(results: Path, script: Path, variant: str | None, since: float) -> dict | None:
    """The record the run of `script` (with `variant`) begun at `since` wrote, if any."""
    since_time = datetime.datetime.fromtimestamp(int(since), datetime.UTC)
    return next((rec for rec in reversed(load_results(results))
                 if (rec.get("folder"), rec.get("script"), rec.get("variant")) ==
                 (script.resolve().parent.name, script.stem, variant)
                 and datetime.datetime.fromisoformat(rec["time"]) >= since_time), None)


def _flags_of(script_args: Sequence[str]) -> tuple[argparse.Namespace, str | None]:
    """The shared flags of a run (for its results file and size) and its variant, also when
    the script refused them (then `--results`, `--size` read leniently and no variant)."""
    try:
        with contextlib.redirect_stderr(None):
            shared = parser(None)
            run_args, own_flags = shared.parse_known_args(script_args)
        return run_args, " ".join(shared.fill_shape(run_args) + own_flags) or None
    except SystemExit:
        lenient = argparse.ArgumentParser(add_help=False)
        lenient.add_argument("--results", type=Path, default=RESULTS)
        lenient.add_argument("--size")
        return lenient.parse_known_args(script_args)[0], None


def mark_failed(script: Path, script_args: Sequence[str], since: float, exit_code: int,
                log_path: Path, world_size: int, record: bool = True) -> str:
    """A run ended non-zero: the line to show (its output's `failure_line`), after writing a
    `failed` record when the run wrote none (a run that recorded itself keeps its own row: a
    failure's reason, or a result written before a crash in teardown)."""
    run_args, variant = _flags_of(script_args)
    own = _own_record(run_args.results, script, variant, since) if record else None
    if own and own["status"] == "failed":
        return own["reason"]
    reason = failure_line(log_path.read_text(errors="replace") if log_path.exists() else "",
                          exit_code)
    if own:
        return f"{reason}, after recording {own['status']}"
    if record:
        rec = _base_record(run_args, None, None, "failed", reason)
        rec.update(folder=script.resolve().parent.name, script=script.stem,
                   world_size=world_size, variant=variant)
        _append(run_args.results, rec)
    return reason


def _fork_rank(script: str, argv: list[str], env: dict[str, str], log_fd: int) -> int:
    """A process that runs `script` as one rank, as torchrun would start it, but forked from
    this interpreter: torch is imported once, not twice a run. CUDA cannot be used in a child
    forked after its parent initialised it, so this interpreter never touches torch.cuda."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(env)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.argv = [script, *argv]
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def smoke(runs: Sequence[str], nproc: int, flags: Sequence[str], out: Path,
          timeout: float) -> int:
    """`make smoke`: every run (a script and its flags) once, `nproc` ranks on this host, one
    line each: ok, over tolerance (its losses strayed from its baseline's, run just before, by
    more than its script allows), skipped (why) or FAILED (its error line). Returns 1 if any
    failed."""
    results, logs = out / "results.jsonl", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed, over, began = 0, 0, time.monotonic()
    for run in runs:
        script, *own = run.split()
        log_path = logs / (Path(script).stem + "".join(own) + ".log")
        argv = [*flags, *own, "--results", str(results)]
        since, port = time.time(), free_port()
        sys.stdout.flush()
        with open(log_path, "w") as log_file:
            pids = [_fork_rank(script, argv, {
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}, log_file.fileno()) for r in range(nproc)]
        codes, deadline = {}, time.monotonic() + timeout
        while len(codes) < nproc and time.monotonic() < deadline:
            for pid in set(pids) - set(codes):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        hung = set(pids) - set(codes)
        for pid in hung:  # past the timeout: a hang is a failure, not a wait
            os.kill(pid, signal.SIGKILL)
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        code = next((codes[pid] for pid in pids if codes[pid]), 0)
        own = _own_record(results, Path(script), _flags_of(argv)[1], since)
        base = next((rec for rec in reversed(load_results(results)) if own and rec.get("script")
                     == own.get("baseline") and run_key(rec) == run_key(own)), None)
        if code == 0 and own and own["status"] == "ok" and over_tolerance(own, base):
            diff = max_loss_diff(own["losses"], base["losses"])
            line = f"over tolerance (max loss difference {diff:.2e} > {own['loss_tolerance']:g})"
            over += 1
        elif code == 0 and own and own["status"] == "ok":
            line = f"ok ({own['step_ms']:.1f} ms/step, loss {own['losses'][-1]:.3f})" \
                if "losses" in own else f"ok ({len(own['sweep'])} sizes x ops timed)"
        elif code == 0 and own and own["status"] == "skipped":
            line = f"skipped: {own['reason']}"
        else:  # recorded by a Python of its own: this one must never touch CUDA (see above)
            reason = f"timed out after {timeout:.0f} s" if hung else subprocess.run(
                [sys.executable, __file__, "mark-failed", script, "--since", str(since),
                 "--exit-code", str(code or 1), "--log", str(log_path), "--world-size",
                 str(nproc), "--", *argv], capture_output=True, text=True).stdout.strip()
            line, failed = f"FAILED: {reason} (log: {log_path})", failed + 1
        print(f"{run:<62} {line}", flush=True)
    print(f"smoke: {len(runs)} runs, {failed} failed, {over} over tolerance, "
          f"{time.monotonic() - began:.0f} s ({nproc} processes each)", flush=True)
    return 1 if failed else 0


def _cli(argv: Sequence[str]) -> int:
    cli = argparse.ArgumentParser(prog="common.py", description="Run bookkeeping for the "
                                  "Makefile.")
    sub = cli.add_subparsers(dest="command", required=True)
    fail = sub.add_parser("mark-failed", help="a run ended non-zero: print its error line, and "
                          "record it if the run could not", epilog="Give the script's own "
                          "flags after --, to record its size and find its results file.")
    fail.add_argument("script", type=Path)
    fail.add_argument("--since", type=float, required=True, help="epoch seconds the run began")
    fail.add_argument("--exit-code", type=int, required=True)
    fail.add_argument("--log", type=Path, required=True, help="the run's output")
    fail.add_argument("--world-size", type=int, default=1)
    fail.add_argument("--no-record", action="store_true", help="print only (not node 0)")
    run = sub.add_parser("smoke", help="every run once, one line each",
                         epilog="Give the runs (a script and its flags, quoted) after --.")
    run.add_argument("--nproc", type=int, required=True)
    run.add_argument("--flags", default="", help="flags for every run")
    run.add_argument("--out", type=Path, default=ROOT / "outputs" / "smoke")
    run.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = cli.parse_args(argv[:split]), argv[split + 1:]
    if args.command == "smoke":
        return smoke(rest, args.nproc, args.flags.split(), args.out, args.timeout)
    print(mark_failed(args.script, rest, args.since, args.exit_code, args.log, args.world_size,
                      record=not args.no_record))
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
