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
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

Action = collections.namedtuple("Action", "kind mb")  # kind "F": forward, "B": backward


def schedule(p: int, m: int) -> list[list[Action]]:
    """The whole batch (m = 1): forward, then backward, on every rank."""
    return [[Action("F", 0), Action("B", 0)] for _ in range(p)]


# --- the runtime: the same in every 05_pipeline script -------------------------------------------
def cut(n_layers: int, p: int) -> list[range]:
    """p contiguous stages whose sizes differ by at most one layer."""
    bounds = [round(r * n_layers / p) for r in range(p + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(p)]


def measure(steps: list[list[list[tuple[str, int, float, float]]]]
            ) -> tuple[float, list[dict[str, float]]]:
    """Over steps of every rank's timed actions: the mean idle fraction of a step (1 - busy
    time / (ranks x the span from its first action's start to its last's end)), and each
    rank's mean F and B times."""
    bubbles = []
    for ranks in steps:
        span = max(a[3] for tl in ranks for a in tl) - min(a[2] for tl in ranks for a in tl)
        bubbles.append(1 - sum(a[3] - a[2] for tl in ranks for a in tl) / (len(ranks) * span))
    per_rank = [[a for ranks in steps for a in ranks[r]] for r in range(len(steps[0]))]
    means = [{k: sum(a[3] - a[2] for a in acts if a[0] == k) / sum(a[0] == k for a in acts)
              for k in "FB"} for acts in per_rank]
    return sum(bubbles) / len(bubbles), means


def simulate(ranks: list[list[Action]], seconds: list[dict[str, float]]) -> tuple[float, int]:
    """The idle fraction of running these action lists with each rank's durations of an F and a
    B and free communication, and the most micro-batches a rank holds between their F and B."""
    p, done, clock, at = len(ranks), {}, [0.0] * len(ranks), [0] * len(ranks)
    while any(at[r] < len(ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if at[r] == len(ranks[r]):
                continue
            kind, mb = ranks[r][at[r]]
            needs = [(kind, mb, r - 1)] if kind == "F" else [(kind, mb, r + 1), ("F", mb, r)]
            needs = [n for n in needs if 0 <= n[2] < p]  # a neighbour's action, or its own F
            if any(n not in done for n in needs):
                continue
            start = max([clock[r]] + [done[n] for n in needs])
            clock[r] = done[(kind, mb, r)] = start + seconds[r][kind]
            at[r] += 1
            progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every rank waits for another")
    busy = sum(seconds[r][a.kind] for r, actions in enumerate(ranks) for a in actions)
    inflight = max(max(sum(1 if a.kind == "F" else -1 for a in actions[:k + 1])
                       for k in range(len(actions))) for actions in ranks)
    return 1 - busy / (p * max(clock)), inflight


class Stage:
    """This rank's layers; runs its actions, keeping each micro-batch's input and output until
    its backward, and times every action from the moment its input is here.

    Sends go out together with the next receive, in one `batch_isend_irecv` (or at once when
    the next action receives nothing): in 1F1B's steady state both ranks of a link send and
    then receive, and NCCL runs a send until its peer's receive starts, so unpaired, two large
    messages would wait for each other (Megatron-LM and torch.distributed.pipelining pair them
    the same way). On CUDA the clock is read after synchronising the device, so an action's
    time is its kernels', not their launch."""

    def __init__(self, layers: list[nn.Module], topo: common.Topology, m: int,
                 shape: tuple[int, ...], autocast_dtype: torch.dtype | None):
        self.layers, self.topo, self.m, self.shape = nn.ModuleList(layers), topo, m, shape
        self.first, self.last = topo.rank == 0, topo.rank == topo.world_size - 1
        self.autocast_dtype = autocast_dtype
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # mb -> (input, output)
        self.outbox: list[dist.P2POp] = []  # sends not posted yet
        self.sent: list[dist.Work] = []  # sends posted, dropped once done (their tensors too)
        self.timelines: list[list[tuple[str, int, float, float]]] = []  # per step, per action
        self.inflight_max = 0

    def now(self) -> float:
        if self.topo.device.type == "cuda":
            torch.cuda.synchronize(self.topo.device)
        return time.time()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.outbox.append(dist.P2POp(dist.isend, tensor, dst))

    def flush(self) -> None:
        """Post the sends still owed; forget those that are done."""
        if self.outbox:
            self.sent += dist.batch_isend_irecv(self.outbox)
            self.outbox = []
        self.sent = [work for work in self.sent if not work.is_completed()]

    def receive(self, src: int) -> torch.Tensor:
        """The next action's input; the sends still owed go out with its receive."""
        x = torch.empty(self.shape, device=self.topo.device)
        works = dist.batch_isend_irecv([*self.outbox, dist.P2POp(dist.irecv, x, src)])
        works[-1].wait()  # the receive (NCCL: the whole group)
        self.sent += works[:-1]
        self.outbox = []
        return x

    def forward(self, mb: int, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = tokens if self.first else self.receive(self.topo.rank - 1).requires_grad_()
        start = self.now()
        with torch.autocast(self.topo.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            out = x
            for layer in self.layers:
                out = layer(out, targets) if isinstance(layer, common.LossHead) else layer(out)
        if self.last:
            out = out / self.m  # the step's loss is the mean over micro-batches
        else:
            self.send(out.detach(), self.topo.rank + 1)
        self.kept[mb] = (x, out)
        self.inflight_max = max(self.inflight_max, len(self.kept))
        self.timelines[-1].append(("F", mb, start, self.now()))
        return out.detach()

    def backward(self, mb: int) -> None:
        grad = None if self.last else self.receive(self.topo.rank + 1)
        start = self.now()
        x, out = self.kept.pop(mb)
        out.backward(grad)
        if not self.first:
            self.send(x.grad, self.topo.rank - 1)
        self.timelines[-1].append(("B", mb, start, self.now()))

    def run(self, actions: list[Action], tokens: torch.Tensor, targets: torch.Tensor
            ) -> torch.Tensor:
        """One step's actions; returns the step's loss (on the last rank; 0 elsewhere)."""
        self.timelines.append([])
        loss = torch.zeros((), device=self.topo.device)
        micro = list(zip(tokens.chunk(self.m), targets.chunk(self.m), strict=True))
        for kind, mb in actions:
            if (kind == "F" and self.first) or (kind == "B" and self.last):
                self.flush()  # this action receives nothing: what it owes goes out now
            if kind == "F":
                out = self.forward(mb, *micro[mb])
                if self.last:
                    loss += out
            else:
                self.backward(mb)
        self.flush()
        for work in self.sent:
            work.wait()
        self.sent.clear()
        return loss


def comm_theory_mb(shape: tuple[int, ...], m: int, tied: int, topo: common.Topology) -> float:
    """What rank 0 sends a step: each micro-batch's activations to rank 1, and its share of the
    tied weight's gradient all-reduce with the last rank (a group of two: the tensor once).
    4 bytes a value: the residual stream between blocks stays fp32, under autocast too."""
    if topo.world_size == 1:
        return 0.0
    return (m * 4 * shape[0] * shape[1] * shape[2] + 4 * tied) / 2**20


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="the pipelines' m: sets the default batch only (2 sequences per "
                             "micro-batch, as theirs), which this baseline runs in one piece")
    parser.set_defaults(batch_size=0)
    args = parser.parse_args()
    args.batch_size = args.batch_size or 2 * args.microbatches
    args.microbatches = 1  # the whole batch is the one micro-batch
    if args.model != "gpt":
        parser.error("05_pipeline cuts the GPT's layers into stages: use --model gpt")
    layers = common.SIZES[args.size].n_layers + 2  # embeddings, blocks, norm + head + loss
    if int(os.environ.get("WORLD_SIZE", "1")) > layers:
        parser.error(f"--size {args.size} has {layers} layers, fewer than the "
                     f"{os.environ['WORLD_SIZE']} stages (processes): use fewer processes")
    topo = common.setup(args)
    p, m = topo.world_size, args.microbatches
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    layers = model.pipeline_layers()
    params = sum(q.numel() for q in model.parameters())
    params_tied = model.tok_emb.weight.numel()
    mine = [layers[i] for i in cut(len(layers), p)[topo.rank]]
    shape = (args.batch_size // m, args.seq_len, model.tok_emb.embedding_dim)
    stage = Stage(mine, topo, m, shape, model.autocast_dtype)
    del model, layers  # the other ranks' layers are freed: a rank holds its stage only
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    tied_weight = mine[0].tok_emb.weight if topo.rank == 0 else \
        mine[-1].head.weight if topo.rank == p - 1 else None
    opt = torch.optim.AdamW(stage.layers.parameters(), lr=args.lr)
    actions = schedule(p, m)[topo.rank]

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)  # first, so the gradients still exist when state is counted
        loss = stage.run(actions, tokens, targets)
        if tied_weight is not None and tied is not None:
            dist.all_reduce(tied_weight.grad, group=tied)  # embedding's + head's gradient
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(stage.layers, opt),
                               loss_rank=p - 1, dp_world=1)
    gathered = [None] * p  # every rank's timed steps
    dist.all_gather_object(gathered, (stage.timelines[args.warmup:], stage.inflight_max))
    steps = [list(ranks) for ranks in zip(*[tls for tls, _ in gathered], strict=True)]
    measured, means = measure(steps)
    bubble, inflight = simulate(schedule(p, m), means)
    common.log(topo, common.render_timeline(steps[-1]))
    common.write_timeline_trace(steps[-1], args, topo)
    common.record(args, topo, stats, baseline=None, model=stage.layers,
                  optimizer=opt, comm_mb=stats.comm_mb, dp_world=1, params=params,
                  schedule="naive", microbatches=m, stages=p,
                  timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4), inflight_max=max(n for _, n in gathered),
                  theory={"bubble": round(bubble, 4), "inflight_max": inflight,
                          "bubble_uniform": round((p - 1) / (m + p - 1), 4),
                          "comm_mb": comm_theory_mb(shape, m, params_tied, topo)})


if __name__ == "__main__":
    common.run_main(main)
