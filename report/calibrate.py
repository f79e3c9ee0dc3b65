"""`make calibrate`: this host's rates for the step-time model (costmodel.Rates), measured at the
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
import math
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
from report.costmodel import load_calibration
from report.gpus import ADAMW_BYTES

# Each world is forked from this interpreter, and CUDA once initialised does not survive a fork:
# torch.cuda.is_available() asks NVML, not the CUDA driver (the parent never initialises CUDA).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

MODELS = ("gpt", "llama", "moe")
# The collectives a step hands over, by CollectiveBytes' kind names: the c10d call that runs each
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "send")
# Bytes a rank of n sends a byte handed over, as common.CollectiveBytes counts each kind
SENT_PER_BYTE = {f"{name.strip('_').removesuffix('_base')}": rule
                 for name, (_, _, rule) in common._SENT_PER_BYTE.items()}
# Message sizes (bytes of the tensor handed over) whose times give latency and time a byte
SMALL_BYTES, LARGE_BYTES = 2**14, 2**24
# A timing's length at least (calls back to back, at most MAX_CALLS): several of the host's time
# slices, so that two calibrations agree to a few per cent
TIMING_WINDOW_S, MAX_CALLS = 0.015, 32


def _median_s(run: Callable[[], object], device: torch.device, reps: int) -> float:
    """The median seconds a call of `run` over `reps` timings, after two untimed calls, the
    ranks starting each timing together. A timing runs `run` back to back for TIMING_WINDOW_S
    at least, the same calls on every rank (a collective's ranks must agree): a mean of many
    calls that the host's time slices (processes outnumbering cores) and a collective's
    two-speed latency shift far less than one call's; on a GPU, kernels queued behind each
    other as in a step, not each behind its launch and a synchronisation."""
    run()
    common._sync(device)
    start = time.perf_counter()
    run()
    common._sync(device)
    once = time.perf_counter() - start
    calls = torch.tensor([min(MAX_CALLS, math.ceil(TIMING_WINDOW_S / max(once, 1e-9)))],
                         device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    calls = int(calls.item())
    dist.barrier()
    times = []
    for _ in range(reps):
        common._sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        common._sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _forward_backward(module: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    module(*inputs).sum().backward()


def linear_shapes(model: nn.Module, size: common.Size, tokens: int) -> dict[tuple, int]:
    """{(rows, in, out): how many} of the model's matmuls with a weight in one forward: every
    Linear (and MoE router) at the batch's tokens, a MoE's routed experts at their even share
    (tokens x top_k / experts)."""
    shapes: dict[tuple, int] = {}
    experts = {id(m) for e in model.modules() if isinstance(e, common.Experts)
               for m in e.modules() if isinstance(m, nn.Linear)}
    routed = tokens * size.top_k // max(1, size.n_experts)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            key = (routed if id(m) in experts else tokens, m.in_features, m.out_features)
        elif isinstance(m, common.TopKRouter):  # its F.linear, which train_flops counts too
            key = (tokens, m.weight.shape[1], m.weight.shape[0])
        else:
            continue
        shapes[key] = shapes.get(key, 0) + 1
    return shapes


def build_model(name: str, size: common.Size, device: torch.device, autocast) -> nn.Module:
    return (common.GPT(size, size.seq_len, autocast_dtype=autocast) if name == "gpt" else
            common.Llama(size, autocast_dtype=autocast,
                         moe_balance="none" if name == "moe" else None)).to(device)


def measure_compute(name: str, size_name: str, device: torch.device, dtype: str, reps: int,
                    decompose: bool) -> dict[str, float]:
    """One model's forward and backward at the size's batch (`step_s`) and, with `decompose`,
    its rates: matmul FLOP/s (its Linears, each timed alone), attention's at the size's length
    and at its long one (07's), and the rest (the whole less those) split into what a layer
    costs whatever its tokens (dispatch, autograd) and what a token adds, from the whole at the
    size's batch and at one sequence."""
    size = common.SIZES[size_name]
    autocast = torch.bfloat16 if dtype == "bf16" else None
    model = build_model(name, size, device, autocast)
    tokens = torch.randint(size.vocab_size, (size.batch_size, size.seq_len + 1), device=device)
    n, layers = size.batch_size * size.seq_len, size.n_layers

    def whole_s(batch: int) -> float:
        return _median_s(lambda: model(tokens[:batch, :-1], tokens[:batch, 1:]).backward(),
                         device, reps)

    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        whole = whole_s(size.batch_size)
        if not decompose:
            return {"step_s": whole}
        one = whole_s(1)
        matmul_s = matmul_flops = 0.0
        shapes = linear_shapes(model, size, n)
        for (rows, fan_in, fan_out), count in shapes.items():
            x = torch.randn(rows, fan_in, device=device, requires_grad=True)
            w = torch.randn(fan_out, fan_in, device=device, requires_grad=True)
            matmul_s += count * _median_s(lambda x=x, w=w: _forward_backward(F.linear, x, w),
                                          device, reps)
            matmul_flops += count * 6 * rows * fan_in * fan_out
        attention = layers * attention_s(name, size, size.batch_size, size.seq_len, device,
                                         reps, dtype)
        float8 = float8_matmul_flops(shapes, device, reps) if name != "moe" else None
    # Kernels timed alone that still add up to more than the whole (a GPU's step overlaps one
    # kernel's launch with the last's run): the whole is the step, so their rates rise alike.
    faster = max(1.0, (matmul_s + attention) / whole)
    matmul_s, attention = matmul_s / faster, attention / faster
    rest = max(whole - matmul_s - attention, 0.0)
    # at one sequence: the matmuls and attention a batch's 1/batch_size (the same lengths)
    rest_one = max(one - (matmul_s + attention) / size.batch_size, 0.0)
    per_token = max(rest - rest_one, 0.0) / (layers * (n - size.seq_len))
    return {"matmul_flops": matmul_flops / matmul_s,
            "attention_flops": common.train_flops(size, name, n, size.seq_len)[1] / attention,
            "other_s": per_token, "layer_s": max(rest / layers - per_token * n, 0.0),
            "step_s": whole, "matmul_s": matmul_s, "attention_s": attention,
            "parts_over_whole": faster,
            **({"float8_matmul_flops": float8 / faster} if float8 else {})}


def float8_matmul_flops(shapes: dict[tuple, int], device: torch.device, reps: int
                        ) -> float | None:
    """The FLOP/s of torchao's Float8Linear (03's optimized_fsdp_fp8) at the model's matmul
    shapes that float8 takes (multiples of 16), forward and backward: the casts to E4M3 and E5M2
    with their scales and the matmuls. None without torchao, and where float8 matmuls do not run
    natively (a CPU, a GPU before sm89), whose emulation is no rate a GPU's run would see and
    takes minutes at the workload's shapes; the model prices float8 at the matmul rate there."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    seconds = flops = 0.0
    for (rows, fan_in, fan_out), count in shapes.items():
        if fan_in % 16 or fan_out % 16:
            continue
        linear = nn.Sequential(nn.Linear(fan_in, fan_out, bias=False)).to(device)
        convert_to_float8_training(linear)
        x = torch.randn(rows, fan_in, device=device, requires_grad=True)
        try:
            seconds += count * _median_s(lambda x=x, linear=linear: _forward_backward(linear, x),
                                         device, reps)
        except RuntimeError:  # a kernel this build of torchao has not for this GPU
            return None
        flops += count * 6 * rows * fan_in * fan_out
    return flops / seconds if seconds else None


def attention_by_length(size_name: str, device: torch.device, reps: int, dtype: str
                        ) -> list[list[float]]:
    """[[length, FLOP/s]] of the GPT's attention (the models share its kernel) on one sequence
    of the size's long length and of four times it: a longer sequence's kernel runs nearer the
    matmul's rate, and context parallelism's blocks are that long."""
    size = common.SIZES[size_name]
    out = []
    for seq in (size.long_seq_len, 4 * size.long_seq_len):
        seconds = attention_s("gpt", size, 1, seq, device, reps, dtype)
        out.append([seq, common.train_flops(size, "gpt", seq, seq)[1] / size.n_layers / seconds])
    return out


def attention_s(name: str, size: common.Size, batch: int, seq: int, device: torch.device,
                reps: int, dtype: str) -> float:
    """One layer's attention, forward and backward, on `batch` sequences of `seq`: q, k and v
    in the step's compute dtype, as the projection before it hands them over."""
    head_dim = size.d_model // size.n_heads
    kv_heads = size.n_heads if name == "gpt" else size.n_kv_heads
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    q = torch.randn(batch, size.n_heads, seq, head_dim, device=device, dtype=kind,
                    requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=kind,
                        requires_grad=True) for _ in range(2))
    return _median_s(lambda: _forward_backward(common.causal_sdpa, q, k, v), device, reps)


def scaled_compute(decomposed: dict[str, float], step_s: float) -> dict[str, float]:
    """A world's rates from the first world's decomposition, every part slowed alike, to a
    whole step of `step_s` here: past one process a core the processes share the cores by time
    slices, which a microbenchmark shorter than a slice would not see."""
    slower = step_s / decomposed["step_s"]
    return {"matmul_flops": decomposed["matmul_flops"] / slower,
            "attention_flops": decomposed["attention_flops"] / slower,
            "attention_by_length": [[seq, rate / slower] for seq, rate in
                                    decomposed["attention_by_length"]],
            "other_s": decomposed["other_s"] * slower,
            "layer_s": decomposed["layer_s"] * slower, "step_s": step_s, "slowdown": slower,
            **({"float8_matmul_flops": decomposed["float8_matmul_flops"] / slower}
               if "float8_matmul_flops" in decomposed else {})}


def measure_optimizer(device: torch.device, reps: int) -> tuple[float, float]:
    """AdamW's step a parameter (seconds), over 16M parameters with gradients, and the memory
    bandwidth (bytes/s) of a triad over 16M floats: two read, one written. 16M parameters: on a
    GPU a few million would time the launches of AdamW's kernels, not their memory traffic."""
    params = [torch.zeros(2**22, device=device, requires_grad=True) for _ in range(4)]
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
    per_byte = SENT_PER_BYTE[op](n)
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


def measure_collectives(world: int, device: torch.device, reps: int,
                        groups: Sequence[int] = ()) -> tuple[dict[str, list[float]],
                                                             dict[str, float]]:
    """({"op/group": [seconds a message, seconds a byte sent]}, {"group": the wake-up}) for
    every group size dividing the world (of `groups` only, if given), all groups of that size
    busy at once. A message's time
    is what it costs inside a step: its small message's back to back (more calls: its median
    is noisier) and the wake-up (`wake_up_s`) each collective pays there; a byte's, the large
    message's less the small's."""
    out, woken = {}, {}
    rank = dist.get_rank()
    for g in [g for g in range(2, world + 1) if world % g == 0 and g in (groups or (g,))]:
        groups = [dist.new_group(list(range(start, start + g))) for start in range(0, world, g)]
        group = groups[rank // g]
        woken[str(g)] = wake_up_s(group, device, reps)
        for op in COLLECTIVES:
            if op == "send" and g != 2:
                continue
            messages = 2 if op == "send" else 1
            small, small_sent = _collective(op, SMALL_BYTES, group, device)
            large, large_sent = _collective(op, LARGE_BYTES, group, device)
            t_small = _median_s(small, device, 2 * reps) / messages
            t_large = _median_s(large, device, reps) / messages
            per_byte = max(t_large - t_small, 0.0) / ((large_sent - small_sent) / messages)
            out[f"{op}/{g}"] = [t_small - per_byte * small_sent / messages + woken[str(g)],
                                per_byte]
    return out, woken


def wake_up_s(group: dist.ProcessGroup, device: torch.device, reps: int) -> float:
    """What a small all-reduce costs more after compute than back to back, as a step's
    collectives come between layers: the ranks arrive apart (each its own compute's jitter,
    and on a shared core its turn), and gloo's threads, idle since the last one, wake. The
    median of 8 rounds of (a matmul burst, an all-reduce) less 8 bursts alone and 8
    all-reduces back to back, a round (twice the calls of a figure: a difference of three)."""
    a, x = torch.randn(256, 256, device=device), torch.ones(SMALL_BYTES // 4, device=device)

    def burst():
        for _ in range(4):
            a @ a

    def rounds(with_compute: bool, with_collective: bool):
        for _ in range(8):
            if with_compute:
                burst()
            if with_collective:
                dist.all_reduce(x, group=group)
    both = _median_s(lambda: rounds(True, True), device, 2 * reps)
    compute = _median_s(lambda: rounds(True, False), device, 2 * reps)
    back_to_back = _median_s(lambda: rounds(False, True), device, 2 * reps)
    return max(both - compute - back_to_back, 0.0) / 8


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
    alone = _median_s(compute, device, 2 * reps)
    reduce = _median_s(lambda: dist.all_reduce(grads), device, 2 * reps)
    together = _median_s(both, device, 2 * reps)
    return min(max((alone + reduce - together) / min(alone, reduce), 0.0), 1.0)


def measure_world(world: int, size: str, dtype: str, reps: int, first: dict | None,
                  models: Sequence[str] = MODELS, repeats: int = 1, quick: bool = False
                  ) -> dict:
    """This rank's part of a world's calibration, measured `repeats` times over; on rank 0 each
    figure's median over the ranks, then over the repeats, and in `band` the lowest and highest
    repeat's (the spread a prediction carries). The first world measured (`first` None)
    decomposes each of `models`' steps; the others time the first model's whole step and scale
    the first world's decomposition by it. `quick`: the collectives over 2 ranks and over the
    whole world only (the rest priced at the nearest group measured, as Rates.link does)."""
    topo = common.setup(timeout_s=300)
    passes = []
    for _ in range(repeats):
        # past the first world, one model's step alone: every model slows alike when ranks share
        # cores
        compute = {name: measure_compute(name, size, topo.device, dtype, reps, first is None)
                   for name in (models if first is None else models[:1])}
        if first is None:
            longer = attention_by_length(size, topo.device, reps, dtype)
            for rates in compute.values():
                rates["attention_by_length"] = [[common.SIZES[size].seq_len,
                                                 rates["attention_flops"]], *longer]
        figures = {"compute": compute}
        figures["optimizer_s"], figures["memory_bytes_per_s"] = measure_optimizer(topo.device,
                                                                                  reps)
        figures["collectives"], figures["wake_up_s"] = \
            measure_collectives(world, topo.device, reps, (2, world) if quick else ()) \
            if world > 1 else ({}, {})
        figures["overlap"] = measure_overlap(topo.device, reps) if world > 1 else 0.0
        gathered = [None] * world
        dist.all_gather_object(gathered, figures)
        passes.append(_median_of(gathered))
    dist.destroy_process_group()
    if first is not None:
        for figures in passes:
            step_s = figures["compute"][models[0]]["step_s"]
            figures["compute"] = {name: scaled_compute(decomposed, decomposed["step_s"] * step_s
                                                       / first["compute"][models[0]]["step_s"])
                                  for name, decomposed in first["compute"].items()}
    return {**_median_of(passes), "band": {"low": _median_of(passes, min),
                                           "high": _median_of(passes, max)}}


def _median_of(values: Sequence, of: Callable = statistics.median):
    """Figure by figure, the median (or `of`) over measurements (nested dicts and lists) of the
    same figures: the ranks', or the repeats'."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _median_of([v[key] for v in values], of) for key in first}
    if isinstance(first, (list, tuple)):
        return [_median_of([v[i] for v in values], of) for i in range(len(first))]
    return of(values)


def _fork_world(world: int, size: str, dtype: str, reps: int, first: dict | None, out: Path,
                timeout: float, models: Sequence[str], repeats: int, quick: bool) -> dict:
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
                figures = measure_world(world, size, dtype, reps, first, models, repeats, quick)
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


# Calibrations a file keeps besides the newest of each size: the records priced at them
HISTORY = 50


def calibrate(worlds: Sequence[int], size: str, dtype: str, reps: int, path: Path,
              timeout: float = 300, models: Sequence[str] = MODELS, repeats: int = 1,
              quick: bool = False) -> dict:
    """Every world's figures at `size` for `models`, each the median of `repeats` (its band:
    the lowest and highest), named by host, time and torch, into `path` (outputs/
    calibration.json) as this size's newest, the one it replaces kept in its history for the
    records priced at it; returns the entry."""
    began = time.monotonic()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    entry = {"id": f"{platform.node()} {now} torch {torch.__version__}" + (" quick" * quick),
             "host": platform.node(), "time": now, "torch": torch.__version__, "device": device,
             "cpus": os.cpu_count(), "size": size, "dtype": dtype, "reps": reps,
             "repeats": repeats, "models": list(models), "quick": quick, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        for world in worlds:
            sys.stdout.flush()
            figures = _fork_world(world, size, dtype, reps, first, Path(tmp) / f"{world}.json",
                                  timeout, models, repeats, quick)
            entry["worlds"][str(world)] = figures
            first = first or figures
    entry["seconds"] = round(time.monotonic() - began, 1)
    calibration = load_calibration(path) or {"sizes": {}}
    replaced = calibration["sizes"].get(size)
    history = calibration.get("history", []) + ([replaced] if replaced else [])
    calibration["history"] = history[-HISTORY:]
    calibration["sizes"][size] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    return entry


def render_calibration(calibration: dict) -> str:
    """The figures a prediction uses, a line a world and model (and collective)."""
    lines = [f"calibration {calibration['id']} ({calibration['size']}, {calibration['dtype']}, "
             f"{calibration['seconds']} s)"]
    for world, figures in calibration["worlds"].items():
        bandwidth = figures["memory_bytes_per_s"]
        lines.append(f"  {world} processes: AdamW {figures['optimizer_s'] * 1e9:.2f} ns a "
                     f"parameter (as {figures['optimizer_s'] * bandwidth:.0f} bytes at the "
                     f"triad's {bandwidth / 1e9:.1f} GB/s; report/gpus.py counts "
                     f"{ADAMW_BYTES} on a GPU), overlap {figures['overlap']:.2f}")
        for name, c in figures["compute"].items():
            by_length = ", ".join(f"{rate / 1e9:.1f} at {seq:.0f}"
                                  for seq, rate in c["attention_by_length"])
            float8 = (f" (float8 {c['float8_matmul_flops'] / 1e9:.1f})"
                      if "float8_matmul_flops" in c else "")
            lines.append(f"    {name:<5} matmul {c['matmul_flops'] / 1e9:5.1f} GFLOP/s{float8}, "
                         "attention "
                         f"{by_length}; a layer {c['layer_s'] * 1e6:,.0f} us + "
                         f"{c['other_s'] * 1e9:,.0f} ns a token (a step "
                         f"{c['step_s'] * 1e3:,.0f} ms)")
        if figures["wake_up_s"]:
            lines.append("    a collective after compute: " + ", ".join(
                f"{woken * 1e6:,.0f} us more over {g}" for g, woken in
                figures["wake_up_s"].items()) + " (in each latency below)")
        for key, (latency, per_byte) in figures["collectives"].items():
            lines.append(f"    {key:<16} {latency * 1e6:8.1f} us a message, "
                         f"{1 / per_byte / 1e9 if per_byte else float('inf'):6.2f} GB/s sent")
    lines += spread_lines(calibration)
    return "\n".join(lines)


def calibration_figures(entry: dict) -> dict[str, float]:
    """Every figure a calibration measured, by its path ("2/compute/gpt/matmul_flops",
    "4/collectives/allreduce/2/latency"): what two calibrations are compared on. The
    attention lengths are settings, not figures."""
    figures = {}
    for world, measured in entry["worlds"].items():
        for name, c in measured["compute"].items():
            for key, value in c.items():
                if key == "attention_by_length":
                    figures |= {f"{world}/compute/{name}/attention at {seq:.0f}": rate
                                for seq, rate in value}
                else:
                    figures[f"{world}/compute/{name}/{key}"] = value
        for key in ("optimizer_s", "memory_bytes_per_s", "overlap"):
            figures[f"{world}/{key}"] = measured[key]
        figures |= {f"{world}/wake_up_s/{g}": value for g, value in measured["wake_up_s"].items()}
        for link, (latency, per_byte) in measured["collectives"].items():
            figures[f"{world}/collectives/{link}/latency_s"] = latency
            figures[f"{world}/collectives/{link}/s_a_byte"] = per_byte
    return figures


def _about_zero(median: float, highest: float) -> bool:
    """A figure whose median is under 1% of its highest: a remainder clipped at zero."""
    return abs(median) <= 0.01 * abs(highest)


def band_figures(entry: dict, end: str) -> dict[str, float]:
    """calibration_figures of the lowest ("low") or highest ("high") repeat's figures, or {}
    for a calibration without bands."""
    if not all("band" in measured for measured in entry["worlds"].values()):
        return {}
    return calibration_figures({**entry, "worlds": {world: {**measured, **measured["band"][end]}
                                                    for world, measured in
                                                    entry["worlds"].items()}})


def spread_lines(entry: dict) -> list[str]:
    """Each figure's spread over the repeats, (highest - lowest) / median, the widest first; of
    the figures that are not about zero (a remainder the calibration clips at zero, as a layer's
    fixed cost where the step is all matmuls: its median under 1% of its highest)."""
    low, high, mid = band_figures(entry, "low"), band_figures(entry, "high"), \
        calibration_figures(entry)
    spreads = sorted(((high[p] - low[p]) / abs(mid[p]), p) for p in low
                     if not _about_zero(mid.get(p, 0.0), high[p]))
    if not spreads:
        return []
    return [f"{entry['id']}: {len(spreads)} figures over {entry.get('repeats', 1)} repeats, the "
            f"median's spread {statistics.median(s for s, _ in spreads):.1%}, the widest:"] + \
        [f"  {s:5.1%} {p}" for s, p in reversed(spreads[-8:])]


def outside_band(first: dict, second: dict) -> list[tuple[str, float, float, float]]:
    """(figure, second's value, first's lowest, first's highest) of each of `second`'s figures
    outside the band of `first`'s repeats (of those not about zero in the first)."""
    low, high, values = band_figures(first, "low"), band_figures(first, "high"), \
        calibration_figures(second)
    mid = calibration_figures(first)
    return [(p, values[p], low[p], high[p]) for p in sorted(low.keys() & values.keys())
            if not _about_zero(mid[p], high[p]) and not low[p] <= values[p] <= high[p]]


def compare_calibrations(first: dict, second: dict, tolerance: float = 0.10) -> str:
    """How far two calibrations of one size apart agree: the figures within `tolerance` of each
    other (relative to the larger), and every one that is not, farthest first."""
    a, b = calibration_figures(first), calibration_figures(second)
    apart = []
    for path in a.keys() & b.keys():
        larger = max(abs(a[path]), abs(b[path]))
        gap = abs(a[path] - b[path]) / larger if larger else 0.0
        if gap > tolerance:
            apart.append((gap, path))
    lines = [f"{first['id']} against {second['id']}: {len(a.keys() & b.keys()) - len(apart)} of "
             f"{len(a.keys() & b.keys())} figures within {tolerance:.0%}"]
    lines += [f"  {gap:4.0%} apart: {path} {a[path]:.4g} and {b[path]:.4g}"
              for gap, path in sorted(apart, reverse=True)]
    if band_figures(first, "low"):
        outside = outside_band(first, second)
        lines += spread_lines(first) + spread_lines(second)
        lines.append(f"{len(a.keys() & b.keys()) - len(outside)} of {len(a.keys() & b.keys())} "
                     f"figures of the second within the first's band (its repeats' lowest to "
                     f"highest)" + (", outside:" if outside else ""))
        lines += [f"  {path} {value:.4g}, the band {low:.4g} to {high:.4g}"
                  for path, value, low, high in outside]
    return "\n".join(lines)
