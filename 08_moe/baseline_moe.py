"""Data parallelism over a Mixture of Experts: every rank holds every expert.

What it does: DDP over the MoE Llama (`--model moe`: each MLP a router that sends each token to
its top-k of E SwiGLU experts, beside a shared expert every token sees). Each rank routes its own
tokens to its own copies of the experts, then all-reduces every gradient, the experts' too.
After each optimizer step the routers' tokens per expert are summed over the ranks and, with
`--moe-balance bias` (DeepSeek-V3's aux-loss-free balancing), each expert's selection bias moves
by --bias-rate toward equal load: up for an expert under the mean, down for one over it
(`aux`: the classic auxiliary loss instead; `none`: plain top-k).
Why it is the baseline: it is the first way to train a MoE on many GPUs, and exact. But every
rank holds all E experts of which a token uses k, so state grows with the total parameters, and
the all-reduce sends all of them every step though each expert saw only its share of tokens.
Run:        torchrun --nproc_per_node=2 08_moe/baseline_moe.py --size small
Look for:   `make moe report`: expert parallelism's step time, bytes and state beside this row;
            tokens per expert (the busiest's against the mean) with and without balancing.
Theory:     sends 2(N-1)/N x 4 bytes x every parameter a step (and the routers' counts); holds
            16 bytes a parameter (fp32 weight, gradient, Adam's two moments) on every rank; an
            expert gets global tokens x k / E tokens a step when the load is even.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
import common  # noqa: E402


def moe_parser(doc: str) -> argparse.ArgumentParser:
    """The folder's flags: the MoE model alone (any other --model is skipped, saying why), the
    folder's steps (`make moe` in ~2 minutes) and how the routers balance. A script adds its
    own, then add_long_run_flag."""
    parser = common.parser(doc, skips={
        model: "expert parallelism needs a model with experts: run --model moe"
        for model in common.MODELS if model != "moe"})
    parser.set_defaults(model="moe", steps=8, warmup=3)
    parser.add_argument("--moe-balance", choices=common.MOE_BALANCING, default="bias",
                        help="bias: DeepSeek-V3's aux-loss-free bias; aux: the auxiliary loss; "
                             "none: plain top-k (default: bias)")
    parser.add_argument("--bias-rate", type=common.positive_float, default=0.2,
                        help="how far an expert's bias moves a step, x its relative distance "
                             "from the mean load (--moe-balance bias)")
    return parser


def balance_experts(routers: list[torch.nn.Module], rate: float,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """After an optimizer step: the tokens each router sent to each expert, summed over `group`
    (every rank whose tokens it routed), returned as (layers, experts). With rate > 0 each
    expert's selection bias moves toward equal load, up under the mean and down over it, by
    `rate` x its distance from the mean, relative (DeepSeek-V3 moves it by a fixed step, the
    distance's sign, over thousands of steps; in proportion it settles in the tens a CPU run
    has). No gradient; the same on every rank, since the counts are. The counts restart.
    Computed where the counts are: no value is read back to the host (a sync a step on a GPU)."""
    counts = torch.stack([router.tokens_per_expert for router in routers])
    dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for router, count in zip(routers, counts, strict=True):
            mean = count.double().mean()
            if rate:  # no token routed (no forward since the last step): no news, no move
                router.expert_bias += torch.where(mean > 0, rate * (mean - count) / mean, 0.0)
            router.tokens_per_expert.zero_()
    return counts


def load_figures(loads: list[torch.Tensor], warmup: int) -> dict:
    """What the record says of the balance, from each step's (layers, experts) counts, over the
    timed steps: each layer's busiest expert against the mean, over the steps together
    (`expert_load`, 1 when even: what balancing evens out) and a step at a time
    (`expert_load_step`, the mean over steps: a batch's own spread is in it), the worst layer's
    of each; and the busiest expert's tokens a step (what sets a step's pace)."""
    timed = torch.stack(loads[warmup:]).double()  # (steps, layers, experts)
    together = timed.sum(0)
    by_layer = (together.max(-1).values / together.mean(-1)).tolist()
    by_step = (timed.max(-1).values / timed.mean(-1)).mean(0)
    return {"expert_load": round(max(by_layer), 4),
            "expert_load_by_layer": [round(x, 4) for x in by_layer],
            "expert_load_step": round(float(by_step.max()), 4),
            "busiest_expert_tokens": round(float(timed.max(-1).values.mean()), 1)}


# Copied from 02_compression/baseline_compression.py: add_long_run_flag, changed: 40 steps
def add_long_run_flag(parser: argparse.ArgumentParser) -> None:
    """`--long-run`: 40 steps (10 untimed, 30 timed) instead of the folder's 11, long enough for
    the model to learn past its first, clustered routing and for the routers' bias to settle: the
    balance rows of `make moe`. A --warmup or --steps given still wins. Added after the script's
    other flags (it reads the command line to set defaults)."""
    parser.add_argument("--long-run", action="store_true",
                        help="40 steps (10 untimed, 30 timed) instead of 11: `make moe`'s "
                             "balance rows, with bias balancing and without")
    if parser.parse_known_args()[0].long_run:
        parser.set_defaults(warmup=10, steps=30)


def ddp_theory(args: argparse.Namespace, model: torch.nn.Module, routers: list,
               world: int) -> dict[str, float]:
    """The record's theory: DDP all-reduces every parameter and the routers' counts (8 bytes
    an expert a layer) a step, and a rank holds 16 bytes a parameter; the busiest expert's
    tokens a step were the load even."""
    size = common.SIZES[args.size]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    count_bytes = sum(r.tokens_per_expert.numel() * 8 for r in routers)
    tokens = world * args.batch_size * args.seq_len
    return {"comm_mb": common.ring_allreduce_mb(param_bytes + count_bytes, world),
            "state_mb": 4 * param_bytes / 2**20,
            # the busiest expert's tokens if the load were even: the mean
            "busiest_expert_tokens": tokens * size.top_k / size.n_experts}


def main():
    parser = moe_parser(__doc__)
    add_long_run_flag(parser)
    args = parser.parse_args()
    topo = common.setup(args)
    model, batches = common.workload(args, topo)
    routers = [block.mlp.gate for block in common.transformer_blocks(model)]
    # the routers' buffers stay equal on every rank by balance_experts: nothing to broadcast
    model = DDP(model, device_ids=[topo.device] if topo.device.type == "cuda" else None,
                gradient_as_bucket_view=True, **common.DDP_NO_BUFFER_SYNC)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rate = args.bias_rate if args.moe_balance == "bias" else 0.0
    loads = []
    opt.register_step_post_hook(lambda *_: loads.append(balance_experts(routers, rate)))

    def train_step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    common.record(args, topo, stats, baseline=None, model=model.module, optimizer=opt,
                  overlapped=common.DDP_OVERLAP,
                  comm_mb=stats.comm_mb, moe_balance=args.moe_balance,
                  **load_figures(loads, args.warmup),
                  theory=ddp_theory(args, model, routers, topo.world_size))


if __name__ == "__main__":
    common.run_main(main)
