"""1F1B pipeline by hand: each rank alternates one forward and one backward, over send/recv.

What it does: the GPT's layers are cut into p stages of about equal cost, one per rank, and the
batch into m micro-batches. Rank r runs p-1-r forwards to fill the pipeline, then one forward and
one backward in turn, then the backwards left. The schedule is data (`schedule(p, m)`: each
rank's ordered actions) and a small runtime runs it: a rank posts the receive for an input as
soon as the peer's action that sends it is scheduled, so the message crosses while the rank
computes. The tied embedding/head weight lives on the first and last ranks; its two gradients
are summed between them each step (as Megatron-LM does): the unsplit model, exactly.
Why it helps: with the whole batch as one piece (baseline_pipeline.py) one rank computes at a
time, each idle (p-1)/p of the step. With m micro-batches the ranks work on different ones at
once and the idle fraction, the bubble, falls to (p-1)/(m+p-1). 1F1B has GPipe's bubble but
starts backwards early: a rank holds at most p micro-batches' activations, not m.
Run:        torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_1f1b.py --size small
Look for:   `make pipeline report`: the speedup over the baseline, `bubble` beside
            `theory.bubble`, `inflight_max` (p, against GPipe's m), and one step's timeline.
Theory:     bubble = the idle fraction of these action lists run with each rank's measured mean
            F and B times (`simulate`), (p-1)/(m+p-1) when they are equal. Activations: at most
            min(p, m) micro-batches' in flight, on the first rank (GPipe: m).
"""

import itertools
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


class Action(NamedTuple):
    kind: str  # F forward, B backward
    micro: int  # the micro-batch's index
    stage: int


def schedule(p: int, m: int) -> list[list[Action]]:
    """1F1B: rank r's warm-up forwards, then forward/backward pairs, then the last backwards."""
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", warmup + i, r), Action("B", i, r)]
        actions += [Action("B", i, r) for i in range(m - warmup, m)]
        ranks.append(actions)
    return ranks


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


class PipelineRank:
    """This rank's stage: runs its actions, keeping each micro-batch's input and output until its
    backward. A receive is posted where `simulate` places it, into a buffer of its own, and
    waited for when the action that needs it starts; a send goes out as soon as its tensor is
    ready and is waited for at the end of the step. An action is timed from the moment its input
    is here, on this rank's clock (on CUDA after synchronising the compute stream: its kernels'
    time, not their launch)."""

    def __init__(self, layers: list[nn.Module], ranks: list[list[Action]], topo: common.Topology,
                 m: int, shape: tuple[int, ...], autocast_dtype: torch.dtype | None):
        self.layers = nn.ModuleList(layers)
        self.topo, self.m, self.shape, self.autocast_dtype = topo, m, shape, autocast_dtype
        self.stage, self.last = topo.rank, topo.world_size - 1
        self.actions, self.receives_before = ranks[topo.rank], simulate(ranks)[2][topo.rank]
        # (kind, micro) -> the buffer and its receive, posted ahead of the action that needs it
        self.inbox: dict[tuple[str, int], tuple[torch.Tensor, dist.Work]] = {}
        # micro -> its input and output: what its backward differentiates, until it runs
        self.saved_for_backward: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sending: list[tuple[torch.Tensor, dist.Work]] = []  # tensors kept alive until sent
        self.timelines: list[tuple[float, list[tuple]]] = []  # a step's start, its timed actions
        self.inflight_max = 0

    def now(self) -> float:
        if self.topo.device.type == "cuda":  # this stream's kernels, not the receives posted
            torch.cuda.current_stream(self.topo.device).synchronize()
        return time.perf_counter()

    def post_receive(self, kind: str, micro: int) -> None:
        x = torch.empty(self.shape, device=self.topo.device)
        src = self.stage - 1 if kind == "F" else self.stage + 1
        self.inbox[(kind, micro)] = x, dist.irecv(x, src)

    def received(self, kind: str, micro: int) -> torch.Tensor:
        x, work = self.inbox.pop((kind, micro))
        work.wait()
        return x

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.sending.append((tensor, dist.isend(tensor, dst)))

    def forward(self, micro: int, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = tokens if self.stage == 0 else self.received("F", micro).requires_grad_()
        start = self.now()
        with torch.autocast(self.topo.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            out = x
            for layer in self.layers:
                out = layer(out, targets) if isinstance(layer, common.LossHead) else layer(out)
        if self.stage == self.last:
            out = out / self.m  # the step's loss is the mean over micro-batches
        else:
            self.send(out.detach(), self.stage + 1)
        self.saved_for_backward[micro] = (x, out)
        self.inflight_max = max(self.inflight_max, len(self.saved_for_backward))
        self.timelines[-1][1].append(("F", micro, self.stage, start, self.now()))
        return out.detach()

    def backward(self, micro: int) -> None:
        grad = None if self.stage == self.last else self.received("B", micro)
        start = self.now()
        x, out = self.saved_for_backward.pop(micro)
        out.backward(grad)
        if self.stage > 0:
            self.send(x.grad, self.stage - 1)
        self.timelines[-1][1].append(("B", micro, self.stage, start, self.now()))

    def run(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's actions; returns the loss (on the last stage, else 0)."""
        self.timelines.append((self.now(), []))
        loss = torch.zeros((), device=self.topo.device)
        chunks = list(zip(tokens.chunk(self.m), targets.chunk(self.m), strict=True))
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


def comm_theory_mb(shape: tuple[int, ...], m: int, tied: int) -> float:
    """What rank 0 sends a step: each micro-batch's activations to rank 1, and its share of the
    tied weight's gradient all-reduce with the last rank (a group of two: the tensor once).
    4 bytes a value: the residual stream between blocks stays fp32, under autocast too."""
    return (m * 4 * shape[0] * shape[1] * shape[2] + 4 * tied) / 2**20


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=8,
                        help="micro-batches m the batch is split into (default: 8)")
    # batch 0: four sequences per micro-batch. On a CPU smaller ones run each GEMM well below
    # the whole batch's speed: a cost of splitting that would blur the bubble's.
    parser.set_defaults(batch_size=0)
    parser.set_defaults(steps=8, warmup=3)  # fewer than elsewhere: eight runs in `make pipeline`
    args = parser.parse_args()
    args.batch_size = args.batch_size or 4 * args.microbatches
    if args.model != "gpt":
        parser.error("05_pipeline cuts the GPT's layers into stages: use --model gpt")
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size {args.batch_size} does not split into --microbatches "
                     f"{args.microbatches}: use a multiple of it")
    world = common.launch_world_size()
    common.skip_unless_pipelined(world, world, args.size)
    topo = common.setup(args)
    p, m = topo.world_size, args.microbatches
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)  # one batch, all ranks
    params, params_tied = sum(q.numel() for q in model.parameters()), model.tok_emb.weight.numel()
    mine = model.pipeline_stages(p)[topo.rank]
    shape = (args.batch_size // m, args.seq_len, model.tok_emb.embedding_dim)
    pipe = PipelineRank(mine, schedule(p, m), topo, m, shape, model.autocast_dtype)
    del model  # the other ranks' layers are freed: a rank holds its stage only
    tied = dist.new_group([0, p - 1])
    tied_weight = mine[0].tok_emb.weight if topo.rank == 0 else \
        mine[-1].head.weight if topo.rank == p - 1 else None
    opt = torch.optim.AdamW(pipe.layers.parameters(), lr=args.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        loss = pipe.run(tokens, targets)
        if tied_weight is not None:
            dist.all_reduce(tied_weight.grad, group=tied)  # embedding's + head's gradient
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(pipe.layers, opt),
                               loss_rank=p - 1, dp_world=1)
    steps, measured, means, inflight_max = common.gather_timelines(
        pipe.timelines[args.warmup:], pipe.inflight_max, args, topo)
    bubble, inflight, _ = simulate(schedule(p, m), means)
    common.record(args, topo, stats, baseline="baseline_pipeline", model=pipe.layers,
                  optimizer=opt, comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=1e-5 if args.dtype == "fp32" else 5e-2,
                  schedule="1f1b", microbatches=m, stages=p,
                  timeline=[[list(a) for a in tl] for tl in steps[-1]],
                  bubble=round(measured, 4), inflight_max=inflight_max,
                  theory={"bubble": round(bubble, 4), "inflight_max": inflight,
                          "bubble_uniform": round((p - 1) / (m + p - 1), 4),
                          "comm_mb": comm_theory_mb(shape, m, params_tied)})


if __name__ == "__main__":
    common.run_main(main)
