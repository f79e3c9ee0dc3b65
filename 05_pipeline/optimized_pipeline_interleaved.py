"""Interleaved 1F1B by hand: v model chunks a rank, the pipeline's fill and drain cut v-fold.

What it does: the decoder's layers (GPT or Llama) are cut into v x p stages, and rank r holds v
of them, r, r + p, ... (`--virtual-stages v`, default 2), cut so that each rank's share is even
(`rank_balanced_cut`): a micro-batch loops round the ranks v times. The schedule is 1F1B's on
those stages (`schedule(p, m, v)`: forwards a chunk at a time in groups of p micro-batches,
backwards from the last chunk down; Megatron-LM's and PyTorch's order), run by DualPipeV's
runtime for several stages a rank (`MultiStagePipelineRank`). A weight tied across the first
and last stage (the GPT's embedding and head, on ranks 0 and p-1) has its gradients summed each
step around the run (`TiedGradients.summed()`), as 1F1B's.
Why it helps: a pipeline fills and drains in p-1 stage slots, and a stage here is 1/v of a rank's
layers: the bubble falls from 1F1B's (p-1)/(m+p-1) to (p-1)/(vm+p-1). The price: each micro-batch
crosses v p - 1 boundaries, not p - 1 (about v times the point-to-point bytes), and the longer
warm-up holds more activations: rank 0 up to (v-1)p + 2p - 1 stages' (a stage 1/v of its layers)
against 1F1B's p, 1.25 times 1F1B's at p = 2, v = 2, toward 1.5 times as p grows. It needs
v p stages <= the layers.
Run:        torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_interleaved.py --size small
Look for:   `bubble` below 1F1B's and near `theory.bubble`; the timeline's later chunks in lower
            case; `comm_mb` about (2v-1) times 1F1B's on rank 0; `inflight_max` in stages.
Theory:     bubble: these action lists run with the measured mean F and B times (`simulate_split`),
            (p-1)/(vm+p-1) when equal and m >= p (`bubble_uniform`; 1F1B's beside it).
            Activations: the most stages' a rank holds (`inflight_max`, each 1/v of a rank's
            layers). Bytes on rank 0: (2v-1) m activations and the tied gradient
            (`interleaved_comm_theory_mb`).
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
# No planner row: the planner's pipeline is 1F1B's; several stages a rank are not planned.
PLANNED = []


# Copied from 05_pipeline/optimized_pipeline_dualpipev.py: SplitAction
class SplitAction(NamedTuple):
    """GPipe's and 1F1B's `Action` with a backward that may be split, and a pairing."""
    kind: str  # F forward; B backward; I the input's gradient, its W (the weights') later
    micro: int  # the micro-batch's index
    stage: int
    paired: bool = False  # DeepSeek overlaps this F with the action after it


def schedule(p: int, m: int, v: int) -> list[list[SplitAction]]:
    """Interleaved 1F1B: rank r holds the v stages r, r + p, ..., r + (v-1)p (its model chunks).
    Forwards go a chunk at a time in groups of g micro-batches (g = p when p divides m, as
    Megatron-LM's; else m / max(1, m // p), which must divide: PyTorch's rule), then the next
    group; backwards alike, from the last chunk down. Rank r first runs (v-1)g + 2(p-1-r)
    forwards, then one forward and one backward in turn, then the backwards left."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"--microbatches {m} does not split into groups of about p = {p}: use a "
                         f"multiple of {rounds} (or of {p})")
    g = m // rounds

    def order(chunks: Sequence[int]) -> list[tuple[int, int]]:  # (micro, chunk), in turn
        return [(micro, chunk) for start in range(0, m, g) for chunk in chunks
                for micro in range(start, start + g)]

    ranks = []
    for r in range(p):
        warmup = min((v - 1) * g + 2 * (p - 1 - r), m * v)
        forwards = [SplitAction("F", micro, c * p + r) for micro, c in order(range(v))]
        backwards = [SplitAction("B", micro, c * p + r)
                     for micro, c in order(range(v - 1, -1, -1))]
        actions = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards, strict=False):  # the steady state
            actions += [f, b]
        ranks.append(actions + backwards[m * v - warmup:])
    return ranks


def rank_balanced_cut(costs: Sequence[float], p: int, v: int) -> list[range]:
    """The layers (each's cost, as `Decoder.pipeline_stages` weighs it) cut into v p contiguous
    stages, stage s on rank s mod p, so that the busiest rank's cost is least, ties to the
    smallest largest stage. Cutting stage by stage (common's cut) can leave a rank two heavy
    stages: at `small` 4 blocks' cost on rank 0 against 2.3 on rank 1, where 1F1B's halves
    are 3 and 3.3. Every cut is tried where there are at most 10^5 (a few dozen layers), else
    common's."""
    n = v * p
    if math.comb(len(costs) - 1, n - 1) > 100_000:
        return common.cut_into_stages(list(costs), n)
    running = [0.0, *itertools.accumulate(costs)]

    def busiest(ends: tuple[int, ...]) -> tuple[float, float]:
        stages = [running[b] - running[a] for a, b in itertools.pairwise((0, *ends, len(costs)))]
        return max(sum(stages[r::p]) for r in range(p)), max(stages)

    ends = min(itertools.combinations(range(1, len(costs)), n - 1), key=busiest)
    return [range(a, b) for a, b in itertools.pairwise((0, *ends, len(costs)))]


# --- the runtime: DualPipeV's, for any number of stages a rank (the same in the ZB script) ---
# Copied from 05_pipeline/optimized_pipeline_dualpipev.py: simulate_split
def simulate_split(ranks: list[list[SplitAction]], seconds: list[dict[str, float]] | None = None,
                   paired: bool = False
                   ) -> tuple[float, int, list[list[list[tuple[str, int, int]]]]]:
    """GPipe's and 1F1B's walk (`simulate`), with I (its input a B's; it sends what a B sends),
    W (its input its own I; it sends nothing), two stages a rank (the turn, in memory) and, if
    `paired`, a paired F and the next action started together once both inputs are done (the
    paper's setting: on a GPU DeepSeek overlaps the two; here they run one after the other, the
    B's input arriving while the F runs). Returns the idle fraction, the most stages'
    activations a rank holds, and each action's receives (F or B, micro, stage)."""
    owner = {(a.micro, a.stage): r for r, actions in enumerate(ranks) for a in actions}
    p, last, done = len(ranks), max(s for _, s in owner), {}
    clock, at = [0.0] * p, [0] * p
    seconds = seconds or [{"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}] * p
    posts = [[[] for _ in actions] for actions in ranks]

    def needs(a: SplitAction) -> list[tuple[str, int, int]]:
        if a.kind == "W":
            return [("I", a.micro, a.stage)]
        src = a.stage - 1 if a.kind == "F" else a.stage + 1
        return [("F" if a.kind == "F" else "B", a.micro, src)] if 0 <= src <= last else []

    while any(at[r] < len(ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if at[r] == len(ranks[r]):
                continue
            a = ranks[r][at[r]]
            group = ranks[r][at[r]:at[r] + 2] if paired and a.paired else [a]
            inputs = [n for b in group for n in needs(b)]
            if any(n not in done for n in inputs):
                continue
            clock[r] = max([clock[r]] + [done[n] for n in inputs])
            for b in group:
                clock[r] += seconds[r][b.kind]
                done[(b.kind, b.micro, b.stage)] = clock[r]
                if b.kind == "I":  # what the previous stage's backward waits for
                    done[("B", b.micro, b.stage)] = clock[r]
                to = b.stage + 1 if b.kind == "F" else b.stage - 1
                if b.kind != "W" and 0 <= to <= last and (dst := owner[(b.micro, to)]) != r:
                    posts[dst][at[dst]].append(("F" if b.kind == "F" else "B", b.micro, to))
            at[r] += len(group)
            progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every rank waits for another")
    busy = sum(seconds[r][a.kind] for r, actions in enumerate(ranks) for a in actions)
    held = [list(itertools.accumulate({"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
                                      for a in actions)) for actions in ranks]
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


# Copied from 05_pipeline/optimized_pipeline_dualpipev.py: MultiStagePipelineRank
class MultiStagePipelineRank:
    """GPipe's and 1F1B's runtime (`PipelineRank`) for this rank's stages, any number of them
    (`stages`: index -> layers; a V's two, an interleaved pipeline's v), a backward whole (B) or
    as an I and a later W; an input for a stage on this rank (the V's turn) is handed over in
    memory, not sent. Its arguments are `PipelineRank`'s less `tied`: a weight on two stages of
    one rank (the V's tied embedding and head) has its gradients summed by autograd; on two
    ranks, `TiedGradients.summed()` around `run` sums them. The W's walk the layers with weights
    of their own (`parameters(recurse=False)`), so the loss function has none (the head is a
    layer)."""

    def __init__(self, stages: dict[int, list[nn.Module]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 ranks: list[list[SplitAction]], shape: Sequence[int],
                 dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 call_layer: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                 autocast_dtype: torch.dtype | None = None, record_timeline: bool = False):
        self.stages = {s: nn.ModuleList(layers) for s, layers in stages.items()}
        self.layers = nn.ModuleList(self.stages.values())  # each stage once
        self.loss_fn, self.call_layer = loss_fn, call_layer
        weight = next(self.layers.parameters())
        self.device, self.shape, self.dtype = weight.device, tuple(shape), dtype or weight.dtype
        self.autocast_dtype, self.record_timeline = autocast_dtype, record_timeline
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.m = len({a.micro for actions in ranks for a in actions})
        self.actions, self.receives_before = ranks[self.rank], simulate_split(ranks)[2][self.rank]
        self.owner = {(a.micro, a.stage): r for r, actions in enumerate(ranks) for a in actions}
        self.last = max(s for _, s in self.owner)
        self.split_backward = {(a.micro, a.stage) for a in self.actions if a.kind == "I"}
        self.inbox: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work | None]] = {}
        self.saved_for_backward: dict[tuple[int, int], tuple] = {}  # by (micro, stage)
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

    def timed(self, kind: str, micro: int, stage: int, start: float | None) -> None:
        if start is not None:
            action = TimedAction(kind, micro, stage, start, self.now())
            self.timelines[-1][1].append(action)

    def post_receive(self, kind: str, micro: int, stage: int) -> None:
        x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        src = self.owner[(micro, stage - 1 if kind == "F" else stage + 1)]
        self.inbox[(kind, micro, stage)] = x, dist.irecv(x, dist.get_global_rank(self.group, src),
                                                         group=self.group)

    def received(self, kind: str, micro: int, stage: int) -> torch.Tensor:
        x, work = self.inbox.pop((kind, micro, stage))
        if work is not None:  # None: handed over in memory
            work.wait()
        return x

    def send(self, tensor: torch.Tensor, kind: str, micro: int, stage: int) -> None:
        """`tensor` is stage `stage`'s input for its F (kind "F") or its backward ("B")."""
        if (tensor.shape, tensor.dtype) != (self.shape, self.dtype):  # the peer's buffer's
            raise ValueError(f"stage {stage - 1 if kind == 'F' else stage + 1} sends "
                             f"{tuple(tensor.shape)} {tensor.dtype}, not the boundary's "
                             f"{self.shape} {self.dtype}: pass shape, dtype")
        if (dst := self.owner[(micro, stage)]) == self.rank:
            self.inbox[(kind, micro, stage)] = tensor, None
        else:
            dst = dist.get_global_rank(self.group, dst)
            self.sending.append((tensor, dist.isend(tensor, dst, group=self.group)))

    def forward(self, micro: int, stage: int, tokens: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
        x = tokens if stage == 0 else self.received("F", micro, stage).requires_grad_()
        start = self.now()
        weighted = []  # (layer, its output) of each layer with weights, if its W comes later
        hooks = [layer.register_forward_hook(lambda mod, _, out: weighted.append((mod, out)))
                 for layer in self.stages[stage].modules()
                 if (micro, stage) in self.split_backward and list(layer.parameters(recurse=False))]
        with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            out = run_layers(self.stages[stage], x, self.call_layer, stage)
            if stage == self.last:
                out = self.loss_fn(out, targets)
        for hook in hooks:
            hook.remove()
        if stage == self.last:
            out = out / self.m  # the step's loss is the mean over micro-batches
        else:
            self.send(out.detach(), "F", micro, stage + 1)
        self.saved_for_backward[(micro, stage)] = (x, out, weighted)
        self.inflight_max = max(self.inflight_max, len(self.saved_for_backward))
        self.timed("F", micro, stage, start)
        return out.detach()

    def backward(self, micro: int, stage: int, split: bool) -> None:
        """B: the input's and the weights' gradients in one pass. I (split): the input's and each
        weighted layer's output's, the whole graph kept for the W (DeepSeek keeps less)."""
        grad = None if stage == self.last else self.received("B", micro, stage)
        start = self.now()
        x, out, weighted = self.saved_for_backward.pop((micro, stage))
        inputs = [x] if stage > 0 else []
        if split:  # into each one's .grad; the W walks one node of the graph per layer
            # a layer whose output is no one tensor (a MoE's router: weights, experts, scores,
            # one computed from another) gets its weights' gradients here, in the I: from each
            # output apart, the W would count a path through two of them twice
            later = [(layer, o) for layer, o in weighted if isinstance(o, torch.Tensor)]
            now = [q for layer, o in weighted if not isinstance(o, torch.Tensor)
                   for q in layer.parameters(recurse=False)]
            torch.autograd.backward(out, grad, inputs=inputs + [o for _, o in later] + now,
                                    retain_graph=True)
            self.saved_for_backward[(micro, stage)] = later
        else:
            out.backward(grad)
        if inputs:
            self.send(x.grad, "B", micro, stage - 1)
        self.timed("I" if split else "B", micro, stage, start)

    def weight_backward(self, micro: int, stage: int) -> None:
        """W: each layer's weight gradients from the gradient at its output (a layer at a time:
        from all outputs at once, a gradient would also flow on into the earlier layers)."""
        start = self.now()
        for layer, out in self.saved_for_backward.pop((micro, stage)):
            torch.autograd.backward(out, out.grad, inputs=list(layer.parameters(recurse=False)))
        self.timed("W", micro, stage, start)

    def run(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's actions on the whole batch (every rank is given it); returns the loss (on
        the rank of the last stage, else 0). The gradients accumulate in the layers' `.grad`."""
        if self.record_timeline:
            self.timelines.append((self.now(), []))
        loss = torch.zeros((), device=self.device)
        chunks = list(zip(tokens.chunk(self.m), targets.chunk(self.m), strict=True))
        for (kind, micro, stage, _), posts in zip(self.actions, self.receives_before, strict=True):
            for post in posts:
                self.post_receive(*post)
            self.sending = [(t, work) for t, work in self.sending if not work.is_completed()]
            if kind == "F":
                out = self.forward(micro, stage, *chunks[micro])
                if stage == self.last:
                    loss += out
            elif kind == "W":
                self.weight_backward(micro, stage)
            else:
                self.backward(micro, stage, split=kind == "I")
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


# Copied from 05_pipeline/baseline_pipeline.py: uniform_bubble
def uniform_bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a step whose actions all take the same time: a stage waits p-1
    slots in m+p-1, (p-1)/(m+p-1): GPipe's and 1F1B's alike, and this baseline's with its one
    batch (m = 1), (p-1)/p."""
    return (stages - 1) / (microbatches + stages - 1)


def interleaved_comm_theory_mb(shape: tuple[int, ...], dtype: torch.dtype, m: int, v: int,
                               tied: int) -> float:
    """What rank 0 sends a step: each micro-batch's activations from each of its v stages to the
    next (v m), and their gradients from each stage but the first back to the one before ((v-1)
    m), in the boundary's dtype, against 1F1B's m: the pipeline's boundaries, v p - 1 against
    p - 1, each crossed twice a micro-batch; plus the tied weight's gradient, as 1F1B's."""
    return ((2 * v - 1) * m * dtype.itemsize * math.prod(shape) + tied) / 2**20


def interleaved_bubble(p: int, m: int, v: int) -> float:
    """The idle fraction with every stage's F and B alike and m >= p: the fill and drain of
    (p-1) slots of a stage, 1/v of a rank's layers, against v m of them a rank: (p-1)/(v m +
    p-1). With fewer micro-batches than ranks a micro-batch's next chunk waits for it to come
    round, and the bubble is larger."""
    return (p - 1) / (v * m + p - 1)


def main():
    parser = common.parser(__doc__, skips={
        "resnet": "a pipeline cuts a decoder's list of layers into stages, and a ResNet's is no "
                  "such list: pipelines run --model gpt or llama"})
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="micro-batches m the batch is split into (default: 8)")
    parser.add_argument("--virtual-stages", type=common.int_at_least(1), default=2,
                        help="model chunks v a rank: the pipeline's stages are v x p (default: 2)")
    # batch 0: four sequences per micro-batch. On a CPU smaller ones run each GEMM well below
    # the whole batch's speed: a cost of splitting that would blur the bubble's.
    parser.set_defaults(batch_size=0)
    parser.set_defaults(steps=6, warmup=3)  # fewer than elsewhere: 14 runs in `make pipeline`
    args = parser.parse_args()
    settings = common.resolved(args, batch_size=args.batch_size or 4 * args.microbatches)
    if settings.batch_size % settings.microbatches:
        parser.error(f"--batch-size {settings.batch_size} does not split into --microbatches "
                     f"{settings.microbatches}: use a multiple of it")
    world, v = common.launch_world_size(), settings.virtual_stages
    try:  # the micro-batches' grouping, checked before any process group
        schedule(world, settings.microbatches, v)
    except ValueError as error:
        parser.error(str(error))
    skip_unless_pipelined(world, v * world, settings.size)
    topo = common.setup(settings)
    p, m = topo.world_size, settings.microbatches
    model, batches = common.workload(settings, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    broadcast_parameters(model)  # the whole model on every rank: rank 0's, whatever the seed
    params, tied = sum(q.numel() for q in model.parameters()), tied_weights(model)
    tied_bytes = sum(w.numel() * w.element_size() for w in tied)  # 0: an untied head
    layers = model.pipeline_layers()
    stages = [[layers[i] for i in stage] for stage in
              rank_balanced_cut([common.matmul_weights(layer) for layer in layers], p, v)]
    mine = {s: plain_layers(stages[s], s == v * p - 1) for s in range(topo.rank, v * p, p)}
    shape = (settings.batch_size // m, settings.seq_len,
             common.input_embedding(model).embedding_dim)
    # the timeline of every step: the timed ones give the bubble (on CUDA, each action synced)
    pipe = MultiStagePipelineRank(mine, cross_entropy, schedule(p, m, v), shape,
                                  autocast_dtype=model.autocast_dtype, record_timeline=True)
    # the first stage is rank 0's, the last rank p-1's: a tied weight's two gradients are summed
    held = list(pipe.layers.parameters())
    tied = TiedGradients([w for w in tied if any(w is q for q in held)], dist.group.WORLD)
    del model, layers, stages  # the other ranks' layers are freed: a rank holds its own
    opt = torch.optim.AdamW(pipe.layers.parameters(), lr=settings.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        with tied.summed():
            loss = pipe.run(tokens, targets)
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(pipe.layers, opt),
                               loss_rank=p - 1, dp_world=1)
    steps, measured, means, inflight_max = gather_timelines(
        common.of_timed_steps(pipe.timelines, settings), pipe.inflight_max, settings, topo)
    bubble, inflight, _ = simulate_split(schedule(p, m, v), means)
    common.record(settings, topo, stats, baseline="baseline_pipeline", model=pipe.layers,
                  optimizer=opt, comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=LOSS_TOLERANCE[settings.dtype],
                  schedule="interleaved", microbatches=m, stages=v * p,
                  timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4), inflight_max=inflight_max,
                  theory={"bubble": round(bubble, 4), "inflight_max": inflight,
                          "bubble_uniform": round(interleaved_bubble(p, m, v), 4),
                          "bubble_1f1b_uniform": round(uniform_bubble(p, m), 4),
                          "comm_mb": interleaved_comm_theory_mb(shape, pipe.dtype, m, v,
                                                                tied_bytes)})



if __name__ == "__main__":
    common.run_main(main)
