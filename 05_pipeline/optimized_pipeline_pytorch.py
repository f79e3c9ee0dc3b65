"""PyTorch's own pipeline schedules on the same model, cut and batches: the side-by-side check.

What it does: the same stages as the hand-written scripts (the decoder's layers, GPT or Llama,
cut into p contiguous stages; a tied embedding and head, found by identity, has its gradients
summed between the first and last rank), run by torch.distributed.pipelining: a `PipelineStage`
per rank and `ScheduleGPipe` (`--schedule gpipe`, the default), `Schedule1F1B` (`1f1b`) or
`ScheduleInterleavedZeroBubble` (`zb`: ZB-H1 at one stage a rank); two stages per rank in a loop
(rank r: stages r and r+p) and `ScheduleInterleaved1F1B` (`interleaved`); or two in a V (rank r:
stages r and 2p-1-r, a tied weight twice on rank 0, nothing to sum) and `ScheduleDualPipeV`
(`dualpipev`) or `ScheduleZBVZeroBubble` (`zbv`). The last stage hands its logits to the
schedule's loss function.
Why it is here: a schedule written by hand is checked against the library's. The losses must
match the hand-written one's to float rounding (the launch tests check it), and
`make pipeline report` puts the step times side by side.
Run:        torchrun --nproc_per_node=2 05_pipeline/optimized_pipeline_pytorch.py --size small
            (and with --schedule 1f1b, interleaved, zb, zbv, dualpipev)
Look for:   the rows `optimized_pipeline_pytorch` (beside optimized_pipeline_gpipe), and each
            `--schedule` beside its hand-written twin: 1f1b, interleaved, zb (ZB-H1), zbv
            (`optimized_pipeline_zb --zbv`), dualpipev.
Theory:     the schedules' own: bubble (p-1)/(m+p-1) for GPipe and 1F1B, activations of m (GPipe)
            or min(p, m) (1F1B) micro-batches in flight; torch records no timeline to measure them.
"""

import itertools
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402

# Against baseline_pipeline, fp32: the same model, its gradients summed over micro-batches
# in another order (per step, absolute). bf16: the dtype's resolution.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}
# No planner row: PyTorch's schedules, the same rows as the hand-written ones'.
PLANNED = []

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleInterleavedZeroBubble,
             "interleaved": ScheduleInterleaved1F1B, "dualpipev": ScheduleDualPipeV,
             "zbv": ScheduleZBVZeroBubble}
# Each rank's stages, by the schedule: one, two in a loop (r, r + p) or two in a V (r, 2p-1-r)
LOOPED, V_SHAPED = {"interleaved"}, {"dualpipev", "zbv"}
# Those that take a list of a rank's stages (PipelineScheduleMulti), a single one among them
MULTI_STAGE = LOOPED | V_SHAPED | {"zb"}


# Copied from 01_ddp/baseline_ddp.py: broadcast_parameters
def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank of `group` (None: the world) start from the group's first rank's weights
    and buffers (a tied weight is sent once)."""
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.detach(), src=first, group=group)


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


# Copied from 05_pipeline/optimized_pipeline_interleaved.py: rank_balanced_cut
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
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe",
                        help="torch.distributed.pipelining's schedule (default: gpipe)")
    parser.add_argument("--microbatches", type=common.int_at_least(1), default=None,
                        help="micro-batches m the batch is split into (default: 8; for "
                             "dualpipev and zbv 2p above 4 processes)")
    parser.set_defaults(batch_size=0)  # 0: four sequences per micro-batch, as the others
    parser.set_defaults(steps=6, warmup=3)  # fewer than elsewhere: 14 runs in `make pipeline`
    args = parser.parse_args()
    world = common.launch_world_size()
    v, looped = args.schedule in V_SHAPED, args.schedule in LOOPED
    n_stages = 2 * world if v or looped else world
    m = args.microbatches or max(8, n_stages if v else 0)
    settings = common.resolved(args, microbatches=m, batch_size=args.batch_size or 4 * m)
    if settings.batch_size % settings.microbatches:
        parser.error(f"--batch-size {settings.batch_size} does not split into --microbatches "
                     f"{settings.microbatches}: use a multiple of it")
    skip_unless_pipelined(world, n_stages, settings.size)
    if args.schedule == "dualpipev" and settings.microbatches < n_stages:  # never the default
        parser.error(f"ScheduleDualPipeV needs at least as many micro-batches as its {n_stages} "
                     f"stages: use --microbatches {n_stages} or more")
    rounds = max(1, settings.microbatches // world)  # torch's interleaved schedules' groups
    if args.schedule in {"interleaved", "zb"} and settings.microbatches % rounds:
        parser.error(f"--schedule {args.schedule} takes the micro-batches in {rounds} equal "
                     f"groups of about {world}: use --microbatches a multiple of {rounds}")
    topo = common.setup(settings)
    if common.dry_run():
        raise common.Skip("torch's pipelining learns each stage's shapes by running it over the "
                          "group, which a fake group cannot: the hand-written schedules dry-run")
    p = topo.world_size
    model, batches = common.workload(settings, topo, dp_rank=0, dp_world=1)
    broadcast_parameters(model)  # the whole model on every rank: rank 0's, whatever the seed
    params, tied = sum(q.numel() for q in model.parameters()), tied_weights(model)
    if looped:  # the interleaved script's cut: each rank's share balanced, not each stage's
        layers = model.pipeline_layers()
        stages = [[layers[i] for i in stage] for stage in rank_balanced_cut(
            [common.matmul_weights(layer) for layer in layers], p, n_stages // p)]
        del layers  # with the model: a rank keeps its own stages
    else:
        stages = model.pipeline_stages(n_stages)
    mine = [topo.rank, 2 * p - 1 - topo.rank] if v else [topo.rank, topo.rank + p] if looped \
        else [topo.rank]  # stage indices
    modules = {s: nn.Sequential(*plain_layers(stages[s], s == n_stages - 1)) for s in mine}
    autocast_dtype = model.autocast_dtype
    del model, stages
    held = nn.ModuleList(modules.values())
    pipe_stages = [PipelineStage(modules[s], s, n_stages, topo.device) for s in mine]
    if v:  # torch (2.14) divides each stage's gradients by m: the tied weight's, in two of rank
        # 0's stages, twice. Each micro-batch's loss divided by m instead: the same gradients, once.
        pipe = SCHEDULES[settings.schedule](
            pipe_stages, m, scale_grads=False,
            loss_fn=lambda logits, targets: cross_entropy(logits, targets) / m)
    elif settings.schedule in MULTI_STAGE:
        pipe = SCHEDULES[settings.schedule](pipe_stages, m, loss_fn=cross_entropy)
    else:
        pipe = SCHEDULES[settings.schedule](pipe_stages[0], m, loss_fn=cross_entropy)
    first, last = 0 in mine, n_stages - 1 in mine  # this rank feeds the tokens, the targets
    # a weight tied across stages is on the first and last rank (the V's: both on rank 0)
    tied_group = dist.new_group([0, p - 1]) if tied and not v else None  # by every rank
    tied = [w for w in tied if not v and any(w is q for q in held.parameters())]
    opt = torch.optim.AdamW(held.parameters(), lr=settings.lr)

    def train_step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        losses = []
        with torch.autocast(topo.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            pipe.step(*([tokens] if first else []),
                      **({"target": targets, "losses": losses} if last else {}))
        for w in tied:  # the embedding's + the head's gradient
            dist.all_reduce(w.grad, group=tied_group)
        opt.step()
        if not losses:
            return torch.zeros((), device=topo.device)
        return torch.stack(losses).sum() if v else torch.stack(losses).mean()

    stats = common.timed_steps(train_step, batches, settings, topo, memory_of=(held, opt),
                               loss_rank=0 if v else p - 1, dp_world=1)
    common.record(settings, topo, stats, baseline="baseline_pipeline", model=held, optimizer=opt,
                  comm_mb=stats.comm_mb, dp_world=1, params=params,
                  loss_tolerance=LOSS_TOLERANCE[settings.dtype],
                  schedule=f"torch {settings.schedule}", microbatches=m, stages=n_stages,
                  theory={} if settings.schedule in MULTI_STAGE else
                  {"bubble_uniform": round(uniform_bubble(p, m), 4)})


if __name__ == "__main__":
    common.run_main(main)
