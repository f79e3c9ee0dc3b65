"""GPipe by hand: all m micro-batches forward, then all m backward, over send/recv.

What it does: the decoder's layers (GPT or Llama) are cut into p stages of about equal cost, one
per rank, and the batch into m micro-batches. Every rank runs the forwards of all m micro-batches
as they arrive, then their backwards, last rank first. The schedule is data (`schedule(p, m)`:
each rank's ordered actions) and a small runtime runs it (`PipelineRank`, 1F1B's too: a
stage's layers, a loss function, the boundary's shape; `call_layer` for layers that take more
than the hidden states, such as HuggingFace's): a rank posts the receive for an input as soon
as the peer's action that sends it is scheduled, so the message crosses while it computes. A
weight tied across stages (the GPT's embedding and head, found by identity; the Llama's is
untied) has its two gradients summed each step (as Megatron-LM does): the unsplit model, exactly.
Why it helps: with the whole batch as one piece (baseline_pipeline.py) one rank computes at a
time, each idle (p-1)/p of the step. With m micro-batches, rank r+1 works on micro-batch i while
rank r works on i+1, and the idle fraction, the bubble, falls to (p-1)/(m+p-1). The price: every
rank holds the activations of all m micro-batches when its backwards start.
Run:        torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_gpipe.py --size small
Look for:   `make pipeline report`: the speedup over the baseline, `bubble` beside
            `theory.bubble`, `inflight_max` (m), and one step's timeline.
Theory:     bubble = the idle fraction of these action lists run with each rank's measured mean
            F and B times (`simulate`), (p-1)/(m+p-1) when they are equal. Activations: all m
            micro-batches' in flight on every rank (1F1B: at most p).
"""

import argparse
import contextlib
import itertools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Against baseline_pipeline, fp32: the same model, its gradients summed over micro-batches
# in another order (per step, absolute). bf16: the dtype's resolution.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# No planner row: 1F1B's state and bytes, with all m micro-batches' activations in flight.
PLANNED = []


class Action(NamedTuple):
    kind: str  # F forward, B backward
    micro: int  # the micro-batch's index
    stage: int


def schedule(p: int, m: int) -> list[list[Action]]:
    """GPipe: on every rank, the m forwards, then the m backwards in the same order."""
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
            for r in range(p)]


# --- the runtime, the same in the GPipe and 1F1B scripts ---------------------------------------
def simulate(ranks: list[list[Action]], seconds: list[dict[str, float]] | None = None
             ) -> tuple[float, int, list[list[list[tuple[str, int]]]]]:
    """Walks these action lists in rounds, each rank taking its next action once its input is
    done (an F's: the previous stage's F; a B's: the next stage's B), with each rank's times of
    F and B (`seconds`, default 1) and free communication. Returns the idle fraction; the most
    micro-batches a rank holds at once (from an F to its B); and for each rank and action, the
    receives (kind, micro-batch) to post just before it: as soon as the action that sends one
    is taken. Posted in that one global order, as torch.distributed.pipelining does, no rank
    waits for a peer that waits for it under NCCL's rule (a send completes only once its
    receive is posted; tests/test_pipeline.py). The rounds, so the posts, ignore the times."""
    p, done, clock, at = len(ranks), {}, [0.0] * len(ranks), [0] * len(ranks)
    seconds = seconds or [{"F": 1.0, "B": 1.0}] * p
    posts = [[[] for _ in actions] for actions in ranks]
    while any(at[r] < len(ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if at[r] == len(ranks[r]):
                continue
            kind, micro, stage = ranks[r][at[r]]
            needs = (kind, micro, stage - 1 if kind == "F" else stage + 1)
            if 0 <= needs[2] < p and needs not in done:
                continue
            clock[r] = max(clock[r], done.get(needs, 0.0)) + seconds[r][kind]
            done[(kind, micro, stage)] = clock[r]
            if 0 <= (to := stage + 1 if kind == "F" else stage - 1) < p:
                posts[to][at[to]].append((kind, micro))
            at[r] += 1
            progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every rank waits for another")
    busy = sum(seconds[r][a.kind] for r, actions in enumerate(ranks) for a in actions)
    held = [list(itertools.accumulate(1 if a.kind == "F" else -1 for a in actions))
            for actions in ranks]
    return 1 - busy / (p * max(clock)), max(max(counts) for counts in held), posts


# Copied from 01_ddp/baseline_ddp.py: broadcast_parameters
def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank of `group` (None: the world) start from the group's first rank's weights
    and buffers (a tied weight is sent once)."""
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.detach(), src=first, group=group)


# Copied from 05_pipeline/baseline_pipeline.py: run_layers
def run_layers(layers: Iterable[nn.Module], x: torch.Tensor,
               call_layer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
               stage: int) -> torch.Tensor:
    """`x` through `layers` in order, each as `call_layer(layer, x)` (None: `layer(x)`). A layer
    that cannot be called so stops the step with one line naming what to pass: a HuggingFace
    decoder layer, for one, takes its positions and causal mask from its model's forward."""
    for i, layer in enumerate(layers):
        try:
            x = layer(x) if call_layer is None else call_layer(layer, x)
        except TypeError as error:
            how = "as layer(x)" if call_layer is None else "by call_layer"
            raise TypeError(f"stage {stage}'s layer {i} ({type(layer).__name__}) fails called "
                            f"{how}: {error}. Pass call_layer=f, where f(layer, x) calls it as "
                            f"your model's forward does (05_pipeline/README.md)") from error
        if not isinstance(x, torch.Tensor):  # the next layer would fail, naming the wrong one
            raise TypeError(f"stage {stage}'s layer {i} ({type(layer).__name__}) returns "
                            f"{type(x).__name__}, not a tensor: pass call_layer=f, where "
                            f"f(layer, x) returns its hidden states")
    return x


# Copied from 05_pipeline/baseline_pipeline.py: TiedGradients
class TiedGradients:
    """Sums the gradients of `weights`, the weights of this rank's stage that other ranks of
    `group` hold too (a tied embedding and head, on the first and last stages), with theirs, as
    Megatron-LM sums its embedding's and head's. Only what one step adds is summed: what earlier
    steps left in `.grad` (gradient accumulation) stays counted once. Building it is collective
    over `group` (each rank says whether it holds any) and makes the holders' copies equal, the
    lowest holder's (as DDP broadcasts from its first rank), which the sum keeps equal. The
    holders talk by send/recv, a new process group being collective over the whole world."""

    def __init__(self, weights: list[nn.Parameter], group: dist.ProcessGroup):
        holds = [False] * dist.get_world_size(group)
        dist.all_gather_object(holds, bool(weights), group=group)
        self.group, self.rank = group, dist.get_rank(group)
        self.holders = [r for r, held in enumerate(holds) if held]
        self.weights = weights if len(self.holders) > 1 else []  # alone: autograd summed them
        for w in self.weights:  # the same list on every holder: the same order
            if self.rank == self.holders[0]:
                for r in self.holders[1:]:
                    dist.send(w.detach(), dist.get_global_rank(group, r), group=group)
            else:  # into the weight itself
                dist.recv(w.detach(), dist.get_global_rank(group, self.holders[0]), group=group)

    @contextlib.contextmanager
    def summed(self):
        """Around one step's backwards: every holder ends with the same sum, in rank order."""
        earlier = [w.grad for w in self.weights]
        for w in self.weights:
            w.grad = None
        yield
        for w, grad in zip(self.weights, earlier, strict=True):
            parts = {r: w.grad if r == self.rank else torch.empty_like(w.grad)
                     for r in self.holders}
            works = [op(parts[r] if op is dist.irecv else w.grad,
                        dist.get_global_rank(self.group, r), group=self.group)
                     for r in self.holders if r != self.rank for op in (dist.isend, dist.irecv)]
            for work in works:
                work.wait()
            total = parts[self.holders[0]]
            for r in self.holders[1:]:
                total = total + parts[r]
            w.grad = total if grad is None else grad.add_(total)


class PipelineRank:
    """This rank's stage of a pipeline of the ranks of `group` (default: the world), running
    its actions of `ranks` (each group rank's, from `schedule`). Given: the stage's `layers`,
    cut from one model (rank 0's on every rank: `broadcast_parameters` before the cut), run in
    order by `run_layers`, each as `call_layer(layer, x)` if given, else `layer(x)`;
    `loss_fn(output, targets)` after them on the last stage (the step's loss: its mean over the
    micro-batches); the `shape` of one micro-batch's activations between stages and their
    `dtype` (default: the layers' weights'); `tied`, weights that may be on another stage too (a
    tied embedding and head: pass the same list on every rank), whose copies `TiedGradients`
    starts equal and whose gradients it sums; `autocast_dtype` for the forwards.
    Keeps each micro-batch's input and output until its backward. A receive is posted where
    `simulate` places it, into a buffer of its own, and waited for when the action that needs
    it starts; a send goes out as soon as its tensor is ready and is waited for at the end of
    the step. With `record_timeline` each action is timed from the moment its input is here,
    on this rank's clock (on CUDA after synchronising the compute stream: its kernels' time,
    not their launch); without it nothing synchronises."""

    def __init__(self, layers: list[nn.Module],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 ranks: list[list[Action]], shape: Sequence[int], dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None, tied: Sequence[nn.Parameter] = (),
                 call_layer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                 autocast_dtype: torch.dtype | None = None, record_timeline: bool = False):
        self.layers, self.loss_fn, self.call_layer = nn.ModuleList(layers), loss_fn, call_layer
        weight = next(self.layers.parameters(), None)
        if weight is None:  # more stages than the model has layers: this one was cut empty
            raise ValueError(f"rank {dist.get_rank(group)}'s stage holds no layer with weights: "
                             "cut into at most as many stages as the model has layers")
        self.device, self.shape, self.dtype = weight.device, tuple(shape), dtype or weight.dtype
        self.autocast_dtype, self.record_timeline = autocast_dtype, record_timeline
        self.group = dist.group.WORLD if group is None else group
        self.stage, self.last = dist.get_rank(self.group), dist.get_world_size(self.group) - 1
        self.m = len({a.micro for actions in ranks for a in actions})
        self.actions, self.receives_before = ranks[self.stage], simulate(ranks)[2][self.stage]
        held = list(self.layers.parameters())
        self.tied = TiedGradients([w for w in tied if any(w is q for q in held)], self.group)
        # (kind, micro) -> the buffer and its receive, posted ahead of the action that needs it
        self.inbox: dict[tuple[str, int], tuple[torch.Tensor, dist.Work]] = {}
        # micro -> its input and output: what its backward differentiates, until it runs
        self.saved_for_backward: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sending: list[tuple[torch.Tensor, dist.Work]] = []  # tensors kept alive until sent
        # a step's start, its timed actions
        self.timelines: list[tuple[float, list[TimedAction]]] = []
        self.inflight_max = 0

    def now(self) -> float | None:
        """This rank's clock if the timeline is recorded, else None (and no synchronisation)."""
        if not self.record_timeline:
            return None
        if self.device.type == "cuda":  # this stream's kernels, not the receives posted
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def timed(self, kind: str, micro: int, start: float | None) -> None:
        if start is not None:
            action = TimedAction(kind, micro, self.stage, start, self.now())
            self.timelines[-1][1].append(action)

    def post_receive(self, kind: str, micro: int) -> None:
        x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        src = dist.get_global_rank(self.group, self.stage - 1 if kind == "F" else self.stage + 1)
        self.inbox[(kind, micro)] = x, dist.irecv(x, src, group=self.group)

    def received(self, kind: str, micro: int) -> torch.Tensor:
        x, work = self.inbox.pop((kind, micro))
        work.wait()
        return x

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        if (tensor.shape, tensor.dtype) != (self.shape, self.dtype):  # the peer's buffer's
            raise ValueError(f"stage {self.stage} sends {tuple(tensor.shape)} {tensor.dtype}, "
                             f"not the boundary's {self.shape} {self.dtype}: pass shape, dtype")
        dst = dist.get_global_rank(self.group, stage)
        self.sending.append((tensor, dist.isend(tensor, dst, group=self.group)))

    def forward(self, micro: int, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = tokens if self.stage == 0 else self.received("F", micro).requires_grad_()
        start = self.now()
        with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            out = run_layers(self.layers, x, self.call_layer, self.stage)
            if self.stage == self.last:
                out = self.loss_fn(out, targets)
        if self.stage == self.last:
            out = out / self.m  # the step's loss is the mean over micro-batches
        else:
            self.send(out.detach(), self.stage + 1)
        self.saved_for_backward[micro] = (x, out)
        self.inflight_max = max(self.inflight_max, len(self.saved_for_backward))
        self.timed("F", micro, start)
        return out.detach()

    def backward(self, micro: int) -> None:
        grad = None if self.stage == self.last else self.received("B", micro)
        start = self.now()
        x, out = self.saved_for_backward.pop(micro)
        out.backward(grad)
        if self.stage > 0:
            self.send(x.grad, self.stage - 1)
        self.timed("B", micro, start)

    def run(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's actions on the whole batch (every rank is given it); returns the loss (on
        the last stage, else 0). The gradients accumulate in the layers' `.grad`."""
        if self.record_timeline:
            self.timelines.append((self.now(), []))
        loss = torch.zeros((), device=self.device)
        chunks = list(zip(tokens.chunk(self.m), targets.chunk(self.m), strict=True))
        with self.tied.summed():
            for (kind, micro, _), posts in zip(self.actions, self.receives_before, strict=True):
                for post in posts:
                    self.post_receive(*post)
                self.sending = [(t, work) for t, work in self.sending if not work.is_completed()]
                if kind == "F":
                    out = self.forward(micro, *chunks[micro])
                    if self.stage == self.last:
                        loss += out
                else:
                    self.backward(micro)
            for _, work in self.sending:
                work.wait()
            self.sending.clear()
        return loss


# Copied from 05_pipeline/baseline_pipeline.py: cross_entropy
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a pipeline's last stage is given: what the project's decoders compute."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# Copied from 05_pipeline/baseline_pipeline.py: plain_layers
def plain_layers(stage: list[nn.Module], last: bool) -> list[nn.Module]:
    """A stage of the project's `pipeline_stages` as a runtime takes it: the last one ends in
    the loss head (norm, head and loss), whose norm and head become its last two layers."""
    return [*stage[:-1], stage[-1].ln_f, stage[-1].head] if last else stage


# Copied from 05_pipeline/baseline_pipeline.py: tied_weights
def tied_weights(model: common.Decoder) -> list[nn.Parameter]:
    """The weights on two stages: the input embedding's if the output head is the same
    Parameter (the GPT's), none if untied (the Llama's). Found by identity, not by name."""
    embedding, head = common.input_embedding(model), common.output_head(model)
    return [embedding.weight] if embedding.weight is head.weight else []


# Copied from 05_pipeline/baseline_pipeline.py: TimedAction
class TimedAction(NamedTuple):
    """One action of a pipeline rank's step: its kind (F, B, I, W), micro-batch and stage, and
    when it started and ended (seconds, on the rank's clock until `gather_timelines`)."""
    kind: str
    micro: int
    stage: int
    start: float
    end: float


# Copied from 05_pipeline/baseline_pipeline.py: clock_offset
def clock_offset(topo: common.Topology, rounds: int = 10) -> float:
    """What to add to this rank's `time.perf_counter()` to read rank 0's, from the quickest of
    `rounds` round trips (NTP's estimate: rank 0 read its clock halfway): right to half of it."""
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


# Copied from 05_pipeline/baseline_pipeline.py: gather_timelines
def gather_timelines(steps: list[tuple[float, list[TimedAction]]], held: int,
                     args: argparse.Namespace, topo: common.Topology
                     ) -> tuple[list[list[list[TimedAction]]], float, list[dict[str, float]], int]:
    """A pipeline's timed steps from every rank: each (its start, its actions: kind, micro-batch,
    stage, start, end) on the rank's clock, read on rank 0's (`clock_offset`) and counted from
    its first stage's first forward, which waits for nothing (the simulator's time 0; no
    barrier: it would stop ranks overlapping one step's end with the next's start). A rank that
    started the step before it waited for another rank to end the step before: idle counted
    there (that one's tail), not twice. Rank 0 prints and writes the last step. Returns the steps
    (a timeline per rank); the bubble, the steps' median idle fraction, 1 - busy time / (ranks x
    the step's span), as `step_ms` is their median time (a step where the host stalled a rank
    moves neither); each rank's mean time per kind of action; the most micro-batches'
    activations a rank `held`."""
    gathered = [None] * topo.world_size
    dist.all_gather_object(gathered, (steps, held, clock_offset(topo)))

    def shifted(a: tuple, by: float) -> TimedAction:
        a = TimedAction(*a)
        return a._replace(start=a.start + by, end=a.end + by)

    timed = []
    for ranks in zip(*[[(start + off, [shifted(a, off) for a in actions])
                        for start, actions in rank] for rank, _, off in gathered], strict=True):
        reference = min(a.start for _, actions in ranks for a in actions
                        if a.kind == "F" and a.stage == 0)
        timed.append([[shifted(a, -reference) for a in actions] for _, actions in ranks])
    bubble = statistics.median(1 - sum(a.end - a.start for tl in ranks for a in tl)
                               / (len(ranks) * max(a.end for tl in ranks for a in tl))
                               for ranks in timed)
    means = [{kind: statistics.mean(a.end - a.start for a in actions if a.kind == kind)
              for kind in {a.kind for a in actions}}
             for actions in ([TimedAction(*a) for _, acts in rank for a in acts]
                             for rank, _, _ in gathered)]
    common.log(topo, render_timeline(timed[-1]))
    write_timeline_trace(timed[-1], args, topo)
    return timed, bubble, means, max(n for _, n, _ in gathered)


# Copied from 05_pipeline/baseline_pipeline.py: render_timeline
def render_timeline(timelines: Sequence[Sequence[TimedAction]], width: int = 96) -> str:
    """One pipeline step as text, a row per rank: an action is its label (`F3`) then its kind
    letter, in lower case on the rank's second stage (DualPipe's); idle time is '.'."""
    timelines = [[TimedAction(*a) for a in tl] for tl in timelines]
    t0 = min(a.start for tl in timelines for a in tl)
    scale = width / (max(a.end for tl in timelines for a in tl) - t0)
    rows = [f"one step, {1e3 * width / scale:.1f} ms, {1e3 / scale:.2f} ms a column:"]
    for rank, tl in enumerate(timelines):
        row, first_stage = ["."] * width, min(a.stage for a in tl)
        for kind, micro, stage, start, end in tl:
            kind = kind if stage == first_stage else kind.lower()
            first = min(round((start - t0) * scale), width - 1)
            label = f"{kind}{micro}"
            for k in range(first, max(first + 1, min(width, round((end - t0) * scale)))):
                row[k] = label[k - first] if k - first < len(label) else kind
        rows.append(f"rank {rank:2d} |{''.join(row)}|")
    return "\n".join(rows)


# Copied from 05_pipeline/baseline_pipeline.py: write_timeline_trace
def write_timeline_trace(timelines: Sequence[Sequence[TimedAction]], args: argparse.Namespace,
                         topo: common.Topology) -> None:
    """The same step as a Chrome/Perfetto trace, a track per rank, in the results' traces/,
    named as common names a run's profiler traces: by script and flags (`..._zb--zbv_...`)."""
    if not topo.is_main:
        return
    timelines = [[TimedAction(*a) for a in tl] for tl in timelines]
    t0 = min(a.start for tl in timelines for a in tl)
    events = [{"name": f"rank {r}", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
              for r in range(len(timelines))]
    events += [{"name": f"{kind}{micro}", "cat": kind, "ph": "X", "pid": 0, "tid": r,
                "ts": 1e6 * (start - t0), "dur": 1e6 * (end - start),
                "args": {"micro-batch": micro, "stage": stage}}
               for r, tl in enumerate(timelines) for kind, micro, stage, start, end in tl]
    script = Path(sys.argv[0]).resolve()
    variant = re.sub(r"[^\w.-]", "", getattr(args, "variant", None) or "")
    path = args.results.parent / "traces" / \
        f"{script.parent.name}_{script.stem}{variant}_timeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    common.log(topo, f"timeline of one step written to {path} (open in https://ui.perfetto.dev)")


# Copied from 05_pipeline/baseline_pipeline.py: skip_unless_pipelined
def skip_unless_pipelined(world: int, stages: int, size: str) -> None:
    """Skip a world a pipeline of `stages` cannot use: it is the host's (NPROC), not a bad flag.
    The cut's layers are the embeddings, each decoder block and the loss head, and each may be a
    stage alone: the runtimes run any list of layers, so a stage need not hold a block."""
    blocks = common.SIZES[size].n_layers
    if world == 1:
        raise common.Skip("a pipeline runs its stages on two or more processes: launch two or more")
    if stages > blocks + 2:
        raise common.Skip(f"--size {size} cuts into {blocks + 2} layers (the embeddings, {blocks} "
                          f"decoder blocks, the loss head), fewer than the {stages} stages on "
                          f"{world} processes: launch fewer (--nproc_per_node) or pass a larger "
                          f"--size")


# Copied from 05_pipeline/baseline_pipeline.py: comm_theory_mb
def comm_theory_mb(shape: tuple[int, ...], dtype: torch.dtype, m: int, tied: int) -> float:
    """What rank 0 sends a step: each micro-batch's activations to rank 1, in the boundary's
    dtype (the residual stream: fp32 under autocast too), and its share of the tied weight's
    gradient all-reduce with the last rank (a group of two: the tensor once; `tied` its bytes,
    0 for an untied head)."""
    return (m * dtype.itemsize * math.prod(shape) + tied) / 2**20


# Copied from 05_pipeline/baseline_pipeline.py: uniform_bubble
def uniform_bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a step whose actions all take the same time: a stage waits p-1
    slots in m+p-1, (p-1)/(m+p-1): GPipe's and 1F1B's alike, and this baseline's with its one
    batch (m = 1), (p-1)/p."""
    return (stages - 1) / (microbatches + stages - 1)


def main():
    parser = common.parser(__doc__, skips={
        "resnet": "a pipeline cuts a decoder's list of layers into stages, and a ResNet's is no "
                  "such list: pipelines run --model gpt or llama"})
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="micro-batches m the batch is split into (default: 8)")
    # batch 0: four sequences per micro-batch. On a CPU smaller ones run each GEMM well below
    # the whole batch's speed: a cost of splitting that would blur the bubble's.
    parser.set_defaults(batch_size=0)
    parser.set_defaults(steps=6, warmup=3)  # fewer than elsewhere: 14 runs in `make pipeline`
    args = parser.parse_args()
    settings = common.resolved(args, batch_size=args.batch_size or 4 * args.microbatches)
    if settings.batch_size % settings.microbatches:
        parser.error(f"--batch-size {settings.batch_size} does not split into --microbatches "
                     f"{settings.microbatches}: use a multiple of it")
    world = common.launch_world_size()
    skip_unless_pipelined(world, world, settings.size)
    topo = common.setup(settings)
    p, m = topo.world_size, settings.microbatches
    model, batches = common.workload(settings, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    broadcast_parameters(model)  # the whole model on every rank: rank 0's, whatever the seed
    params, tied = sum(q.numel() for q in model.parameters()), tied_weights(model)
    tied_bytes = sum(w.numel() * w.element_size() for w in tied)  # 0: an untied head
    shape = (settings.batch_size // m, settings.seq_len,
             common.input_embedding(model).embedding_dim)
    # the timeline of every step: the timed ones give the bubble (on CUDA, each action synced)
    pipe = PipelineRank(plain_layers(model.pipeline_stages(p)[topo.rank], topo.rank == p - 1),
                        cross_entropy, schedule(p, m), shape, tied=tied,
                        autocast_dtype=model.autocast_dtype, record_timeline=True)
    del model, tied  # the other ranks' layers are freed: a rank holds its stage only
    opt = torch.optim.AdamW(pipe.layers.parameters(), lr=settings.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss = pipe.run(tokens, targets)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(pipe.layers, opt),
                               loss_rank=p - 1, dp_world=1)
    steps, measured, means, inflight_max = gather_timelines(
        common.of_timed_steps(pipe.timelines, settings), pipe.inflight_max, settings, topo)
    bubble, inflight, _ = simulate(schedule(p, m), means)
    common.record(settings, topo, stats, baseline="baseline_pipeline", model=pipe.layers,
                  optimizer=opt, comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=LOSS_TOLERANCE[settings.dtype],
                  schedule="gpipe", microbatches=m, stages=p,
                  timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4), inflight_max=inflight_max,
                  theory={"bubble": round(bubble, 4), "inflight_max": inflight,
                          "bubble_uniform": round(uniform_bubble(p, m), 4),
                          "comm_mb": comm_theory_mb(shape, pipe.dtype, m, tied_bytes)})


if __name__ == "__main__":
    common.run_main(main)
