"""`make calibrate`: this host's rates for the step-time model (common.Rates), measured at the
workload's shapes and at the process counts `make all` runs, into outputs/calibration.json.

For each world (2, 4 and 8 processes on CPU; the GPUs on a GPU host), forked from this
interpreter (torch imported once) and set up as a recipe's ranks are (`common.setup`: the same
threads a rank, backend and device), every rank at once measures:
- compute, per model: the whole model's forward and backward at the size's batch, each of its
  Linears' (three matmuls: forward, input and weight gradients) and its attention's; the matmuls'
  and attention's FLOP/s, and what is left (norms, activations, residuals, the loss, autograd)
  a token and layer;
- the optimizer: AdamW's step a parameter; the memory bandwidth (a triad over 64 MB);
- each collective, over every group size the world divides into (all groups busy at once, as a
  mesh's are): its time at two message sizes, hence the latency a message and the time a byte
  sent (bytes counted as common.CollectiveBytes counts them);
- overlap: the share of an all-reduce's time that compute running at once hides.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common

MODELS = ("gpt", "llama", "moe")
# The collectives a step hands over, by CollectiveBytes' kind names: the c10d call that runs each
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "send")
# Message sizes (bytes of the tensor handed over) whose times give latency and time a byte
SMALL_BYTES, LARGE_BYTES = 2**14, 2**24


def _median_s(run: Callable[[], object], device: torch.device, reps: int) -> float:
    """The median seconds of `reps` calls of `run`, after one untimed call, the ranks starting
    each measurement together."""
    run()
    dist.barrier()
    times = []
    for _ in range(reps):
        common._sync(device)
        start = time.perf_counter()
        run()
        common._sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward_backward(module: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    module(*inputs).sum().backward()


def linear_shapes(model: nn.Module, size: common.Size, tokens: int) -> dict[tuple, int]:
    """{(rows, in, out): how many} of the model's Linears in one forward: every Linear at the
    batch's tokens, a MoE's routed experts at their even share (tokens x top_k / experts)."""
    shapes: dict[tuple, int] = {}
    experts = {id(m) for e in model.modules() if isinstance(e, common.Experts)
               for m in e.modules() if isinstance(m, nn.Linear)}
    routed = tokens * size.top_k // max(1, size.n_experts)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            key = (routed if id(m) in experts else tokens, m.in_features, m.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def build_model(name: str, size: common.Size, device: torch.device, autocast) -> nn.Module:
    return (common.GPT(size, size.seq_len, autocast_dtype=autocast) if name == "gpt" else
            common.Llama(size, autocast_dtype=autocast,
                         moe_balance="none" if name == "moe" else None)).to(device)


def measure_compute(name: str, size_name: str, device: torch.device, dtype: str, reps: int,
                    decompose: bool) -> dict[str, float]:
    """One model's forward and backward at the size's batch (`step_s`) and, with `decompose`,
    its rates: matmul and attention FLOP/s and the rest's seconds a token and layer (the whole
    less its Linears' matmuls and its attention, each timed alone)."""
    size = common.SIZES[size_name]
    autocast = torch.bfloat16 if dtype == "bf16" else None
    model = build_model(name, size, device, autocast)
    tokens = torch.randint(size.vocab_size, (size.batch_size, size.seq_len + 1), device=device)
    n = size.batch_size * size.seq_len
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        whole = _median_s(lambda: model(tokens[:, :-1], tokens[:, 1:]).backward(), device, reps)
        if not decompose:
            return {"step_s": whole}
        matmul_s = matmul_flops = 0.0
        for (rows, fan_in, fan_out), count in linear_shapes(model, size, n).items():
            x = torch.randn(rows, fan_in, device=device, requires_grad=True)
            w = torch.randn(fan_out, fan_in, device=device, requires_grad=True)
            matmul_s += count * _median_s(lambda x=x, w=w: _forward_backward(F.linear, x, w),
                                          device, reps)
            matmul_flops += count * 6 * rows * fan_in * fan_out
        head_dim = size.d_model // size.n_heads
        kv_heads = size.n_heads if name == "gpt" else size.n_kv_heads
        q = torch.randn(size.batch_size, size.n_heads, size.seq_len, head_dim, device=device,
                        requires_grad=True)
        k, v = (torch.randn(size.batch_size, kv_heads, size.seq_len, head_dim, device=device,
                            requires_grad=True) for _ in range(2))
        attention_s = size.n_layers * _median_s(
            lambda: _forward_backward(common.causal_sdpa, q, k, v), device, reps)
    attention_flops = common.train_flops(size, name, n, size.seq_len)[1]
    rest = max(whole - matmul_s - attention_s, 0.0)
    return {"matmul_flops": matmul_flops / matmul_s, "attention_flops": attention_flops /
            attention_s, "other_s": rest / (n * size.n_layers), "step_s": whole,
            "matmul_s": matmul_s, "attention_s": attention_s}


def scaled_compute(decomposed: dict[str, float], step_s: float) -> dict[str, float]:
    """A world's rates from the first world's decomposition, every part slowed alike by what
    the whole step took here: past one process a core the processes share the cores by time
    slices, which a microbenchmark shorter than a slice would not see."""
    slower = step_s / decomposed["step_s"]
    return {"matmul_flops": decomposed["matmul_flops"] / slower,
            "attention_flops": decomposed["attention_flops"] / slower,
            "other_s": decomposed["other_s"] * slower, "step_s": step_s, "slowdown": slower}


def measure_optimizer(device: torch.device, reps: int) -> tuple[float, float]:
    """AdamW's step a parameter (seconds), over 4M parameters with gradients, and the memory
    bandwidth (bytes/s) of a triad over 16M floats: two read, one written."""
    params = [torch.zeros(2**20, device=device, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    optimizer_s = _median_s(opt.step, device, reps) / sum(p.numel() for p in params)
    a, b, c = (torch.rand(2**24, device=device) for _ in range(3))
    triad_s = _median_s(lambda: torch.add(b, c, alpha=2.0, out=a), device, reps)
    return optimizer_s, 3 * a.numel() * a.element_size() / triad_s


def _collective(op: str, nbytes: int, group: dist.ProcessGroup, device: torch.device
                ) -> tuple[Callable[[], object], float]:
    """A call of `op` handing over `nbytes`, and the bytes a rank sends in it (CollectiveBytes'
    count: the ring's share of what is handed over)."""
    n, rank = group.size(), group.rank()
    x = torch.ones(nbytes // 4, device=device)
    per_byte = {"allreduce": 2 * (n - 1) / n, "allgather": n - 1, "reduce_scatter": (n - 1) / n,
                "alltoall": (n - 1) / n, "broadcast": (n - 1) / n, "send": 1}[op]
    if op == "allreduce":
        return lambda: dist.all_reduce(x, group=group), per_byte * nbytes
    if op == "allgather":  # `nbytes` gathered: each rank hands over its 1/n
        out, x = torch.empty(x.numel() // n * n, device=device), x[:x.numel() // n]
        return lambda: common.all_gather_single(out, x, group=group), per_byte * nbytes / n
    if op == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=device)
        return lambda: common.reduce_scatter(out, x[:out.numel() * n], group=group), \
            per_byte * nbytes
    if op == "alltoall":
        out = torch.empty_like(x[:x.numel() // n * n])
        return lambda: dist.all_to_all_single(out, x[:out.numel()], group=group), \
            per_byte * nbytes
    if op == "broadcast":
        root = dist.get_global_rank(group, 0)
        return lambda: dist.broadcast(x, src=root, group=group), per_byte * nbytes
    peer = dist.get_global_rank(group, rank ^ 1)  # pairs (0, 1), (2, 3): a pipeline's hops

    def exchange():  # one message each way, as a stage's activation and its gradient
        for sender in (0, 1):
            if rank % 2 == sender:
                dist.send(x, peer, group=group)
            else:
                dist.recv(x, peer, group=group)
    return exchange, 2 * nbytes  # two messages: the per-message figures halve it


def measure_collectives(world: int, device: torch.device, reps: int
                        ) -> dict[str, list[float]]:
    """{"op/group": [seconds a message, seconds a byte sent]} for every group size dividing
    the world, all groups of that size busy at once: the latency from the small message (more
    calls: its median is noisier), the time a byte from the large one less that."""
    out = {}
    rank = dist.get_rank()
    for g in [g for g in range(2, world + 1) if world % g == 0]:
        groups = [dist.new_group(list(range(start, start + g))) for start in range(0, world, g)]
        group = groups[rank // g]
        for op in COLLECTIVES:
            if op == "send" and g != 2:
                continue
            messages = 2 if op == "send" else 1
            small, small_sent = _collective(op, SMALL_BYTES, group, device)
            large, large_sent = _collective(op, LARGE_BYTES, group, device)
            t_small = _median_s(small, device, 4 * reps) / messages
            t_large = _median_s(large, device, reps) / messages
            per_byte = max(t_large - t_small, 0.0) / ((large_sent - small_sent) / messages)
            out[f"{op}/{g}"] = [t_small - per_byte * small_sent / messages, per_byte]
    return out


def measure_overlap(device: torch.device, reps: int) -> float:
    """The share of an all-reduce's time hidden when compute runs meanwhile, as DDP's buckets
    run under backward: (compute alone + all-reduce alone - both at once) / the shorter."""
    a = torch.randn(512, 512, device=device)
    grads = torch.ones(2**21, device=device)

    def compute():
        for _ in range(8):
            a @ a

    def both():
        work = dist.all_reduce(grads, async_op=True)
        compute()
        work.wait()
    alone = _median_s(compute, device, reps)
    reduce = _median_s(lambda: dist.all_reduce(grads), device, reps)
    together = _median_s(both, device, reps)
    return min(max((alone + reduce - together) / min(alone, reduce), 0.0), 1.0)


def measure_world(world: int, size: str, dtype: str, reps: int, first: dict | None) -> dict:
    """This rank's part of a world's calibration; the ranks' median of each figure on rank 0.
    The first world measured (`first` None) decomposes each model's step; the others scale it."""
    topo = common.setup(timeout_s=300)
    compute = {name: measure_compute(name, size, topo.device, dtype, reps, first is None)
               for name in MODELS}
    figures = {"compute": compute}
    figures["optimizer_s"], figures["memory_bytes_per_s"] = measure_optimizer(topo.device, reps)
    figures["collectives"] = measure_collectives(world, topo.device, reps) if world > 1 else {}
    figures["overlap"] = measure_overlap(topo.device, reps) if world > 1 else 0.0
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    dist.destroy_process_group()
    figures = _median_of(gathered)
    if first is not None:
        figures["compute"] = {name: scaled_compute(first["compute"][name], c["step_s"])
                              for name, c in figures["compute"].items()}
    return figures


def _median_of(values: Sequence):
    """Figure by figure, the median over the ranks' measurements (nested dicts and lists)."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _median_of([v[key] for v in values]) for key in first}
    if isinstance(first, list):
        return [_median_of([v[i] for v in values]) for i in range(len(first))]
    return statistics.median(values)


def _fork_world(world: int, size: str, dtype: str, reps: int, first: dict | None, out: Path,
                timeout: float) -> dict:
    """`world` processes forked from this one, as torchrun would start them; rank 0's JSON."""
    port, pids = common.free_port(), []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
                figures = measure_world(world, size, dtype, reps, first)
                if rank == 0:
                    out.write_text(json.dumps(figures))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                for other in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                raise TimeoutError(f"calibrating {world} processes took over {timeout:.0f} s")
            time.sleep(0.05)
    if not out.exists():
        raise RuntimeError(f"calibrating {world} processes failed: see the traceback above")
    return json.loads(out.read_text())


def calibrate(worlds: Sequence[int], size: str, dtype: str, reps: int, path: Path,
              timeout: float = 300) -> dict:
    """Every world's figures at `size`, named by host, time and torch, into `path`
    (outputs/calibration.json) beside the other sizes' there; returns this size's."""
    began = time.monotonic()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    entry = {"id": f"{platform.node()} {now} torch {torch.__version__}", "host": platform.node(),
             "time": now, "torch": torch.__version__, "device": device, "cpus": os.cpu_count(),
             "size": size, "dtype": dtype, "reps": reps, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        for world in worlds:
            sys.stdout.flush()
            figures = _fork_world(world, size, dtype, reps, first, Path(tmp) / f"{world}.json",
                                  timeout)
            entry["worlds"][str(world)] = figures
            first = first or figures
    entry["seconds"] = round(time.monotonic() - began, 1)
    calibration = common.load_calibration(path) or {"sizes": {}}
    calibration["sizes"][size] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    return entry


def render_calibration(calibration: dict) -> str:
    """The figures a prediction uses, a line a world and model."""
    lines = [f"calibration {calibration['id']} ({calibration['size']}, {calibration['dtype']}, "
             f"{calibration['seconds']} s)"]
    for world, figures in calibration["worlds"].items():
        lines.append(f"  {world} processes: AdamW {figures['optimizer_s'] * 1e9:.2f} ns a "
                     f"parameter, memory {figures['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
                     f"overlap {figures['overlap']:.2f}")
        for name, c in figures["compute"].items():
            lines.append(f"    {name:<5} matmul {c['matmul_flops'] / 1e9:6.1f} GFLOP/s, attention "
                         f"{c['attention_flops'] / 1e9:6.1f} GFLOP/s, the rest "
                         f"{c['other_s'] * 1e9:7.1f} ns a token and layer (step "
                         f"{c['step_s'] * 1e3:.0f} ms)")
        for key, (latency, per_byte) in figures["collectives"].items():
            lines.append(f"    {key:<16} {latency * 1e6:8.1f} us a message, "
                         f"{1 / per_byte / 1e9 if per_byte else float('inf'):6.2f} GB/s sent")
    return "\n".join(lines)
