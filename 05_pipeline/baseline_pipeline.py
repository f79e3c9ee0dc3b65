"""Naive model parallelism: the layers cut across ranks, the whole batch through them at once.

What it does: the GPT's layers (embeddings, blocks, final norm + head + loss) are cut into p
contiguous stages, one per rank. The whole batch goes forward from rank 0 to rank p-1, then
backward from rank p-1 to rank 0; activations go to the next rank and their gradients come back
with isend/irecv. It is the pipeline scripts' runtime with one micro-batch, so
`diff baseline_pipeline.py optimized_pipeline_gpipe.py` shows the schedule and little else.
The tied embedding/head weight lives on the first and last ranks; its two gradients are summed
between them each step (as Megatron-LM does), so it trains exactly the unsplit model.
Why it is the baseline: it is what splitting a model too large for one device gives first, and
every rank but one waits at any moment: each is idle (p-1)/p of the step.
Run:        torchrun --nproc_per_node=2 05_pipeline/baseline_pipeline.py --size small
Look for:   `bubble` near (p-1)/p, and the ASCII timeline: one rank busy at a time.
Theory:     bubble (p-1)/p with uniform stages; one micro-batch (the batch) in flight.
"""

import collections
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# kind: F forward; B backward, input and weight gradients in one pass; I the input's gradient
# only, its W (the weights' gradient) later. paired: DeepSeek overlaps this F with the next action.
Action = collections.namedtuple("Action", "kind mb stage paired", defaults=(False,))


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: n_stages
def n_stages(p: int) -> int:
    return p


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: rank_of
def rank_of(stage: int, mb: int, p: int, m: int) -> int:
    """Stage r on rank r."""
    return stage


def schedule(p: int, m: int) -> list[list[Action]]:
    """The whole batch (m = 1): forward, then backward, on every rank."""
    return [[Action("F", 0, r), Action("B", 0, r)] for r in range(p)]


# --- the runtime: the same in every 05_pipeline script -------------------------------------------
# Copied from 05_pipeline/optimized_pipeline_1f1b.py: layer_cost
def layer_cost(layer: nn.Module) -> int:
    """A layer's compute, roughly: the weights of its matrix multiplies (2 FLOPs each a token);
    the embedding lookups, norms and the attention's own product are small beside them."""
    return sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, nn.Linear))


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: cut
def cut(costs: list[int], stages: int) -> list[range]:
    """Contiguous stages of about equal cost, each of at least one layer: stage s ends where the
    running cost comes nearest to s/stages of the total (the embeddings cost nearly nothing and
    the head a third of a block at `small`, so equal numbers of layers would not balance)."""
    running, bounds = list(itertools.accumulate(costs)), [0]
    for s in range(1, stages):
        ends = range(bounds[-1] + 1, len(costs) - (stages - s) + 1)
        bounds.append(min(ends, key=lambda end: abs(running[end - 1] - s * running[-1] / stages)))
    return [range(a, b) for a, b in zip(bounds, [*bounds[1:], len(costs)], strict=True)]


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: measure
def measure(steps: list[list[list[tuple[str, int, int, float, float]]]]
            ) -> tuple[float, list[dict[str, float]]]:
    """Over steps of every rank's timed actions (kind, micro-batch, stage, start, end): the mean
    idle fraction of a step (1 - busy time / (ranks x the span from its first action's start to
    its last's end)), and each rank's mean time of each kind of action."""
    bubbles = []
    for ranks in steps:
        span = max(a[4] for tl in ranks for a in tl) - min(a[3] for tl in ranks for a in tl)
        bubbles.append(1 - sum(a[4] - a[3] for tl in ranks for a in tl) / (len(ranks) * span))
    per_rank = [[a for ranks in steps for a in ranks[r]] for r in range(len(steps[0]))]
    means = [{k: sum(a[4] - a[3] for a in acts if a[0] == k) / sum(a[0] == k for a in acts)
              for k in {a[0] for a in acts}} for acts in per_rank]
    return sum(bubbles) / len(bubbles), means


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: simulate
def simulate(ranks: list[list[Action]], seconds: list[dict[str, float]], paired: bool = False
             ) -> tuple[float, int]:
    """The idle fraction of running these action lists with each rank's durations of each kind
    and free communication, and the most stages' activations a rank holds at once (from an F to
    its B or W). An action starts when its rank is free and its input is done: an F's the
    previous stage's F, a B's or I's the next stage's B or I (and its own F), a W's its I. With
    `paired`, a paired F and the action after it start together, when both inputs are done."""
    p, done, clock, at = len(ranks), {}, [0.0] * len(ranks), [0] * len(ranks)
    last = max(a.stage for actions in ranks for a in actions)

    def needs(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
        if a.kind == "W":
            return [("I", a.mb, a.stage)]
        return [("F", a.mb, a.stage)] + ([("B", a.mb, a.stage + 1)] if a.stage < last else [])

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
                done[(b.kind, b.mb, b.stage)] = clock[r]
                if b.kind == "I":  # what the previous stage's backward waits for
                    done[("B", b.mb, b.stage)] = clock[r]
            at[r] += len(group)
            progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every rank waits for another")
    busy = sum(seconds[r][a.kind] for r, actions in enumerate(ranks) for a in actions)
    inflight = 0
    for actions in ranks:
        held = set()
        for a in actions:
            if a.kind == "F":
                held.add((a.mb, a.stage))
            elif a.kind in "BW":  # after an I the stage still holds what its W needs
                held.discard((a.mb, a.stage))
            inflight = max(inflight, len(held))
    return 1 - busy / (p * max(clock)), inflight


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: PipelineRank
class PipelineRank:
    """This rank's stages; runs its actions, keeping each micro-batch's input and output per
    stage until its backward, and times every action from the moment its input is here.

    An output goes to the rank holding the next stage: in memory when that is this rank (the
    V's turn), else by isend. Activations and gradients travel in two process groups: two
    ordered channels per link, because a rank may send its neighbour an activation and then a
    gradient that the neighbour wants in the other order (DualPipeV from p = 3), and NCCL, unlike
    gloo, ignores tags. Within a channel both ends post in the same order (a test checks it).
    Sends go out together with the next receive, in one `batch_isend_irecv` (or at once when the
    next action receives nothing): in a steady state both ranks of a link send and then receive,
    and NCCL runs a send until its peer's receive starts, so unpaired, two large messages would
    wait for each other (Megatron-LM and torch.distributed.pipelining pair them the same way).
    On CUDA the clock is read after synchronising the device, so an action's time is its
    kernels', not their launch."""

    def __init__(self, stages: dict[int, list[nn.Module]], actions: list[Action],
                 topo: common.Topology, m: int, shape: tuple[int, ...],
                 autocast_dtype: torch.dtype | None):
        self.stages = {s: nn.ModuleList(layers) for s, layers in stages.items()}
        self.layers = nn.ModuleList(self.stages.values())  # every parameter once
        self.topo, self.m, self.shape, self.autocast_dtype = topo, m, shape, autocast_dtype
        self.p, self.last = topo.world_size, n_stages(topo.world_size) - 1
        self.split = {(a.mb, a.stage) for a in actions if a.kind == "I"}
        self.weighted = {s: [mod for mod in layers.modules() if list(mod.parameters(recurse=False))]
                         for s, layers in self.stages.items()}  # what a W differentiates
        self.groups = {"F": dist.new_group(), "B": dist.new_group()}  # activations, gradients
        self.kept: dict[tuple[int, int], tuple] = {}  # (mb, stage) -> what its backward needs
        self.handed: dict[tuple[str, int, int], torch.Tensor] = {}  # to a stage of this rank
        self.outbox: list[dist.P2POp] = []  # sends not posted yet
        self.sent: list[dist.Work] = []  # sends posted, dropped once done (their tensors too)
        self.timelines: list[list[tuple[str, int, int, float, float]]] = []  # per step, action
        self.inflight_max = 0

    def now(self) -> float:
        if self.topo.device.type == "cuda":
            torch.cuda.synchronize(self.topo.device)
        return time.time()

    def give(self, kind: str, mb: int, stage: int, tensor: torch.Tensor) -> None:
        """Stage `stage`'s input for its F (kind "F") or its backward (kind "B")."""
        dst = rank_of(stage, mb, self.p, self.m)
        if dst == self.topo.rank:
            self.handed[(kind, mb, stage)] = tensor
        else:
            self.outbox.append(dist.P2POp(dist.isend, tensor, dst, group=self.groups[kind]))

    def take(self, kind: str, mb: int, stage: int, src: int | None) -> torch.Tensor | None:
        """This action's input from rank `src` (None: it has none); the sends still owed go out
        with its receive, or at once when it receives nothing."""
        if src is None or src == self.topo.rank:
            self.flush()
            return None if src is None else self.handed.pop((kind, mb, stage))
        group = self.groups[kind]
        x = torch.empty(self.shape, device=self.topo.device)
        self.flush(besides=group)
        works = dist.batch_isend_irecv([*self.outbox, dist.P2POp(dist.irecv, x, src, group=group)])
        works[-1].wait()  # the receive (NCCL: the whole group)
        self.sent += works[:-1]
        self.outbox = []
        return x

    def flush(self, besides: dist.ProcessGroup | None = None) -> None:
        """Post the sends still owed (but those in group `besides`); forget those that are done."""
        for group in self.groups.values():
            ops = [op for op in self.outbox if op.group is group]
            if ops and group is not besides:
                self.sent += dist.batch_isend_irecv(ops)
                self.outbox = [op for op in self.outbox if op.group is not group]
        self.sent = [work for work in self.sent if not work.is_completed()]

    def forward(self, mb: int, stage: int, tokens: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
        src = rank_of(stage - 1, mb, self.p, self.m) if stage > 0 else None
        x = self.take("F", mb, stage, src)
        x = tokens if x is None else x.requires_grad_()
        start = self.now()
        weighted = []  # (layer, its output) of each layer with weights, if its W comes later
        hooks = [layer.register_forward_hook(lambda mod, _, out: weighted.append((mod, out)))
                 for layer in self.weighted[stage] if (mb, stage) in self.split]
        with torch.autocast(self.topo.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            out = x
            for layer in self.stages[stage]:
                out = layer(out, targets) if isinstance(layer, common.LossHead) else layer(out)
        for hook in hooks:
            hook.remove()
        if stage == self.last:
            out = out / self.m  # the step's loss is the mean over micro-batches
        else:
            self.give("F", mb, stage + 1, out.detach())
        self.kept[(mb, stage)] = (x, out, weighted)
        self.inflight_max = max(self.inflight_max, len(self.kept))
        self.timelines[-1].append(("F", mb, stage, start, self.now()))
        return out.detach()

    def backward(self, mb: int, stage: int, split: bool) -> None:
        """B: the input's and the weights' gradients in one pass. I (split): the input's and the
        gradient at the output of every layer with weights; the stage's graph is kept for the W
        (all it saved, not only what the W needs: more memory than DeepSeek's per-Linear W)."""
        src = rank_of(stage + 1, mb, self.p, self.m) if stage < self.last else None
        grad = self.take("B", mb, stage, src)
        start = self.now()
        x, out, weighted = self.kept[(mb, stage)]
        inputs = [x] if stage > 0 else []
        if split:  # the graph is kept for the W, which walks one node of it per layer
            torch.autograd.backward(out, grad, inputs=inputs + [o for _, o in weighted],
                                    retain_graph=True)  # into each one's .grad
            self.kept[(mb, stage)] = weighted
            if inputs:
                self.give("B", mb, stage - 1, x.grad)
        else:
            out.backward(grad)
            del self.kept[(mb, stage)]
            if inputs:
                self.give("B", mb, stage - 1, x.grad)
        self.timelines[-1].append(("I" if split else "B", mb, stage, start, self.now()))

    def weight_backward(self, mb: int, stage: int) -> None:
        """W: each layer's weight gradients from the gradient at its output (a layer at a time:
        from all outputs at once, a gradient would also flow on into the earlier layers)."""
        self.flush()  # a W receives nothing: what this rank owes goes out now
        start = self.now()
        for layer, out in self.kept.pop((mb, stage)):
            torch.autograd.backward(out, out.grad, inputs=list(layer.parameters(recurse=False)))
        self.timelines[-1].append(("W", mb, stage, start, self.now()))

    def run(self, actions: list[Action], tokens: torch.Tensor, targets: torch.Tensor
            ) -> torch.Tensor:
        """One step's actions; returns the loss of the micro-batches whose last stage is here."""
        self.timelines.append([])
        loss = torch.zeros((), device=self.topo.device)
        micro = list(zip(tokens.chunk(self.m), targets.chunk(self.m), strict=True))
        for kind, mb, stage, _ in actions:
            if kind == "F":
                out = self.forward(mb, stage, *micro[mb])
                if stage == self.last:
                    loss += out
            elif kind == "W":
                self.weight_backward(mb, stage)
            else:
                self.backward(mb, stage, split=kind == "I")
        self.flush()
        for work in self.sent:
            work.wait()
        self.sent.clear()
        return loss


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: comm_theory_mb
def comm_theory_mb(shape: tuple[int, ...], m: int, tied: int) -> float:
    """What rank 0 sends a step: each micro-batch's activations to rank 1, and its share of the
    tied weight's gradient all-reduce with the last rank (a group of two: the tensor once).
    4 bytes a value: the residual stream between blocks stays fp32, under autocast too."""
    return (m * 4 * shape[0] * shape[1] * shape[2] + 4 * tied) / 2**20


# Copied from 05_pipeline/optimized_pipeline_1f1b.py: skip_unless_pipelined
def skip_unless_pipelined(world: int, stages: int, size: str) -> None:
    """The world size is the host's (the Makefile's NPROC: its GPUs), not a flag: where this
    pipeline cannot use it, the run is skipped with why, not refused."""
    layers = common.SIZES[size].n_layers + 2  # embeddings, blocks, norm + head + loss
    if world == 1:
        raise common.Skip("a pipeline runs its stages on two or more processes: launch two or "
                          "more")
    if stages > layers:
        raise common.Skip(f"--size {size} has {layers} layers, fewer than the {stages} stages "
                          f"on {world} processes: use fewer processes or a larger --size")


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="the pipelines' m: sets the default batch only (2 sequences per "
                             "micro-batch, as theirs), which this baseline runs in one piece")
    parser.set_defaults(batch_size=0)
    parser.set_defaults(steps=10, warmup=3)  # 8 runs in `make pipeline`: ~2 min
    args = parser.parse_args()
    args.batch_size = args.batch_size or 2 * args.microbatches
    args.microbatches = 1  # the whole batch is the one micro-batch
    if args.model != "gpt":
        parser.error("05_pipeline cuts the GPT's layers into stages: use --model gpt")
    world = common.launch_world_size()
    skip_unless_pipelined(world, n_stages(world), args.size)
    topo = common.setup(args)
    p, m = topo.world_size, args.microbatches
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    layers = model.pipeline_layers()
    params = sum(q.numel() for q in model.parameters())
    params_tied = model.tok_emb.weight.numel()
    actions = schedule(p, m)[topo.rank]
    stages = cut([layer_cost(layer) for layer in layers], n_stages(p))
    mine = {s: [layers[i] for i in stages[s]] for s in sorted({a.stage for a in actions})}
    shape = (args.batch_size // m, args.seq_len, model.tok_emb.embedding_dim)
    pipe = PipelineRank(mine, actions, topo, m, shape, model.autocast_dtype)
    del model, layers  # the other ranks' layers are freed: a rank holds its stage only
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    tied_weight = mine[0][0].tok_emb.weight if topo.rank == 0 else \
        mine[p - 1][-1].head.weight if topo.rank == p - 1 else None
    opt = torch.optim.AdamW(pipe.layers.parameters(), lr=args.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)  # first, so the gradients still exist when state is counted
        loss = pipe.run(actions, tokens, targets)
        if tied_weight is not None and tied is not None:
            dist.all_reduce(tied_weight.grad, group=tied)  # embedding's + head's gradient
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(pipe.layers, opt),
                               loss_rank=p - 1, dp_world=1)
    gathered = [None] * p  # every rank's timed steps
    dist.all_gather_object(gathered, (pipe.timelines[args.warmup:], pipe.inflight_max))
    steps = [list(ranks) for ranks in zip(*[tls for tls, _ in gathered], strict=True)]
    measured, means = measure(steps)
    bubble, inflight = simulate(schedule(p, m), means)
    common.log(topo, common.render_timeline(steps[-1]))
    common.write_timeline_trace(steps[-1], args, topo)
    common.record(args, topo, stats, baseline=None, model=pipe.layers,
                  optimizer=opt, comm_mb=stats.comm_mb, dp_world=1, params=params,
                  schedule="naive", microbatches=m, stages=p,
                  timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4), inflight_max=max(n for _, n in gathered),
                  theory={"bubble": round(bubble, 4), "inflight_max": inflight,
                          "bubble_uniform": round((p - 1) / (m + p - 1), 4),
                          "comm_mb": comm_theory_mb(shape, m, params_tied)})


if __name__ == "__main__":
    common.run_main(main)
