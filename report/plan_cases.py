"""The seed guide's decision matrix, worked (`make plan --cases`): each model at its real shape
on its cluster, a table of the candidates and the pick, and its dry run (`make dryrun`) beside
the planner's formula."""

from __future__ import annotations

import argparse
from pathlib import Path

import common
from report.gpus import GPUS
from report.plan_input import FLAG_DEFAULTS, GB
from report.plan_print import case_table, crossover_lines, offload_lines, plan_json, why_picked
from report.planner import PICK_MARGIN, achieved, choose, plan_strategies

# ResNet-50's training FLOPs an image at 224 x 224, forward and backward: torch's
# FlopCounterMode over torchvision's resnet50 (tests/test_plan.py counts them again)
RESNET50_TRAIN_FLOPS = 24.3e9
# The published ResNet-50 training figure its case is checked against: NVIDIA's
# DeepLearningExamples, ResNet50 v1.5 for PyTorch, "Training performance: NVIDIA DGX A100 (8x
# A100 80GB)" (PyTorch/Classification/ConvNets/resnet50v1.5/README.md; pytorch-21.03 NGC
# container): 8 GPUs, mixed precision, 256 images a GPU a step (its configs.yml), 16,621 images/s
RESNET50_PUBLISHED = {"gpu": "a100", "gpus": 8, "images_per_s": 16621,
                      "source": "NVIDIA DeepLearningExamples, ResNet50 v1.5 for PyTorch, DGX A100 "
                                "(8x A100 80GB), mixed precision"}

# The seed guide's decision matrix, worked: each model at its real shape, on GPUs of 80 GB, bf16
CASES = [("ResNet-50 on 8 GPUs", {"params": 25.6e6, "gpus": 8, "layers": 16, "hidden": 1024,
                                  "vocab": 1000, "seq_len": 196, "micro_batch": 256,
                                  "flops_per_item": RESNET50_TRAIN_FLOPS},
          "a decoder-shaped stand-in for its memory: its 16 bottleneck blocks as layers of 1,024 "
          "units over 14 x 14 = 196 positions, 1,000 classes, 256 images a GPU (the published "
          "run's), its activations a rough guess; its FLOPs an image counted"),
         ("GPT-2 1.5B on 4 GPUs", {"params": 1.5e9, "gpus": 4, "layers": 48, "hidden": 1600,
                                   "vocab": 50257, "seq_len": 1024}, None),
         ("LLaMA-7B on 8 GPUs", {"params": 7e9, "gpus": 8, "layers": 32, "hidden": 4096,
                                 "vocab": 32000, "seq_len": 4096, "llama": True}, None),
         # where offload beats ZeRO-3 alone: GPUs too small for 16 bytes a parameter / 8
         ("LLaMA-7B on 8 16-GB GPUs", {"params": 7e9, "gpus": 8, "gpu_mem": 16.0,
                                       "layers": 32, "hidden": 4096, "vocab": 32000,
                                       "seq_len": 4096, "llama": True}, None),
         # Llama 2 70B's SwiGLU is 28,672 wide (its config.json), not the 8/3 rule's 22,016;
         # its 64 heads share 8 K/V heads
         ("LLaMA-70B on 64 GPUs", {"params": 70e9, "gpus": 64, "layers": 80, "hidden": 8192,
                                   "vocab": 32000, "seq_len": 4096, "llama": True,
                                   "ffn": 28672, "kv_heads": 8}, None),
         # Qwen3-30B-A3B, from its Hugging Face config.json (Qwen/Qwen3-30B-A3B): 48 layers,
         # hidden_size 2048, 128 experts a layer (every layer: mlp_only_layers empty), 8 a
         # token, moe_intermediate_size 768, vocab 151,936, untied head, 32 heads of 128 (q is
         # twice hidden_size wide) sharing 4 K/V heads; its model card: 30.5B parameters, 3.3B
         # activated
         ("Qwen3-30B-A3B on 16 GPUs", {"params": 30.5e9, "gpus": 16, "layers": 48,
                                       "hidden": 2048, "vocab": 151936, "seq_len": 4096,
                                       "llama": True, "experts": 128, "top_k": 8,
                                       "expert_ffn": 768, "heads": 32, "kv_heads": 4,
                                       "head_dim": 128},
          "a MoE: its activations what common.Experts keeps a token"),
         # the seed guide's fine-tuning row (FSDP + LoRA), on two GPUs of a workstation's size
         ("Fine-tuning LLaMA-7B on 2 GPUs", {"params": 7e9, "gpus": 2, "gpu_mem": 24.0,
                                             "layers": 32, "hidden": 4096, "vocab": 32000,
                                             "seq_len": 4096, "llama": True, "lora_rank": 8},
          "24 GB GPUs; LoRA of rank 8 on the attention allowed beside full training")]


# Each seed case's layout run by its script, at the case's world on the published shape it stands
# for, as `make dryrun` runs it (its DRY_SEED_RUNS, held equal by tests/test_dryrun.py), and the
# planner's flags for what the script runs where they are not the case's: the pipeline's default
# batch, 8 micro-batches of 4 sequences (the case's 64 of one take a dry run minutes a step)
CASE_DRY_RUNS = {
    "LLaMA-7B on 8 GPUs": ("FSDP full", "03_fsdp/optimized_fsdp.py --size llama2-7b --dry-run 8",
                           {}),
    "LLaMA-7B on 8 16-GB GPUs": ("ZeRO-3 + offload", "04_zero/optimized_zero3_offload.py --size "
                                 "llama2-7b --dry-run 8", {}),
    "LLaMA-70B on 64 GPUs": ("FSDP x TP", "03_fsdp/optimized_fsdp_tp.py --size llama2-70b "
                             "--dry-run 64 --tp 8", {}),
    "Qwen3-30B-A3B on 16 GPUs": ("pipeline", "05_pipeline/optimized_pipeline_1f1b.py --size "
                                 "qwen3-30b-a3b --dry-run 16",
                                 {"micro_batch": 4, "micro_batches": 8}),
    "Fine-tuning LLaMA-7B on 2 GPUs": ("FSDP + LoRA", "03_fsdp/optimized_fsdp_lora.py --size "
                                       "llama2-7b --dry-run 2", {}),
}
# How near a dry run's memory beyond its state must come to the planner's activations (with the
# weights it holds gathered or cast): the planner counts a layer's activations by formula
DRY_RUN_ACTIVATIONS_TOLERANCE = 0.15


def dry_run_record(run: str, records: list[dict]) -> dict | None:
    """The newest record of `run` (a script and its flags, CASE_DRY_RUNS') among `records`."""
    path, *flags = run.split()
    folder, script = path.removesuffix(".py").split("/")
    size, world = flags[flags.index("--size") + 1], int(flags[flags.index("--dry-run") + 1])
    own = " ".join(f for i, f in enumerate(flags) if f not in ("--size", "--dry-run") and
                   flags[i - 1] not in ("--size", "--dry-run")) or None
    matching = [r for r in records if (r["folder"], r["script"], r["size"], r.get("variant"),
                                       r["world_size"]) == (folder, script, size, own, world)]
    return matching[-1] if matching else None


def beside_dry_run(args: argparse.Namespace, strategy: str, rec: dict) -> dict[str, tuple]:
    """A dry run's figures and the planner's for the same strategy at the dry run's exact
    parameter count (the flags `args` give the rest), in bytes a GPU: {"state", "activations",
    "sent": (dry run's, planner's)}. Activations: the dry run's peak beyond the state alive at it
    (`beyond_state_mb`) against the planner's activations and the weights it holds gathered or
    cast. Sent: rank 0's, an end stage's in a pipeline. A LoRA run's adapters are its own (the
    base model's count without them)."""
    adapters = float(rec["trainable_params"]) if rec.get("lora_rank") else 0.0
    exact = argparse.Namespace(**{**vars(args), "params": rec["params"] - adapters,
                                  **({"lora_params": adapters} if adapters else {})})
    row = next(r for r in plan_strategies(exact) if r["strategy"] == strategy and
               not r["checkpointing"])
    return {"state": (rec["state_mb"] * 2**20, row["state"]),
            "activations": (rec["dry_run"]["beyond_state_mb"] * 2**20, row["activations"]),
            "sent": ((rec["comm_mb"] or 0.0) * 2**20, row.get("sent_first", row["sent"]))}


def dry_run_line(args: argparse.Namespace, strategy: str, run: str, rec: dict | None) -> str:
    """A case's dry run beside the planner's row for the same strategy (beside_dry_run), in GB
    a GPU."""
    head = f"Dry run of {strategy} (`{run}`, rank 0): "
    if rec is None:
        return head + "none yet (`make dryrun`)."
    if rec["status"] != "ok":
        return head + f"{rec['status']}, {rec['reason']}"
    if "beyond_state_mb" not in rec.get("dry_run", {}):
        return head + "older than this planner (`make dryrun` again)."
    pairs = beside_dry_run(args, strategy, rec)
    (state, planned_state), (beyond, acts), (sent, planned_sent) = (
        (dry / GB, planned / GB) for dry, planned in pairs.values())
    return head + (f"state {state:,.1f} GB (planner {planned_state:,.1f}), its peak beyond the "
                   f"state {beyond:,.1f} GB (planner's activations {acts:,.1f}, "
                   f"{beyond / acts - 1:+.0%}), sent {sent:,.2f} GB a step (planner "
                   f"{planned_sent:,.2f}).")


def published_resnet_line(args: argparse.Namespace) -> str:
    """The ResNet case's DDP row on the published run's GPUs beside RESNET50_PUBLISHED."""
    published = RESNET50_PUBLISHED
    at = argparse.Namespace(**{**vars(args), "gpu": published["gpu"], "gpus": published["gpus"]})
    ddp = next(r for r in plan_strategies(at) if r["strategy"] == "DDP" and not r["checkpointing"])
    gpu, per_gpu = GPUS[published["gpu"]], published["images_per_s"] / published["gpus"]
    return (f"Checked against {published['source']}: {per_gpu:,.0f} images/s a GPU; this model's "
            f"DDP row on {published['gpus']} {gpu.name}: "
            f"{ddp['per_gpu_s']:,.0f} ({ddp['per_gpu_s'] / per_gpu - 1:+.0%}: the share of the "
            f"peak it assumes, {achieved(args.run_as):.0%}, is a transformer's; that run's "
            f"convolutions reach {per_gpu * RESNET50_TRAIN_FLOPS / gpu.bf16_flops:.0%}).")


def cases_json() -> list[dict]:
    """`make plan ARGS='--cases --json'`: each case's flags, candidate rows and pick (plan_json)."""
    return [{"case": name, "note": note,
             **plan_json(argparse.Namespace(**{**FLAG_DEFAULTS, **flags}))}
            for name, flags, note in CASES]


def render_cases(dry_results: Path = common.DRY_RESULTS) -> str:
    """Each of CASES: a table of its candidates (case_table), then what the planner picks
    (`choose`) and why in a sentence, and its dry run (CASE_DRY_RUNS) from `dry_results` beside
    the formula."""
    d = FLAG_DEFAULTS
    lines = [f"GPUs of {d['gpu_mem']:g} GB, {d['gpus_per_node']} a node, {d['dtype']}, micro-batch "
             f"{d['micro_batch']} a GPU unless said, {GPUS[d['gpu']].name}, eager. Pick: of what "
             f"fits, the most tokens/s a GPU the step-time model predicts; within "
             f"{PICK_MARGIN:.0%} of it, the simplest.", ""]
    dry_runs = common.load_results(dry_results)
    for name, flags, note in CASES:
        args = argparse.Namespace(**{**FLAG_DEFAULTS, **flags})
        rows = plan_strategies(args)
        best = choose(rows)
        pick = why_picked(rows, best, args.gpu_mem) if best else "nothing fits."
        count = f"{args.params / 1e9:g}B" if args.params >= 1e9 else f"{args.params / 1e6:g}M"
        lines += [f"{name} ({count} parameters{f'; {note}' if note else ''})", "",
                  case_table(rows), "",
                  f"Pick: {pick}" + "".join(f" {line}" for line in
                                            crossover_lines(rows) + offload_lines(rows))]
        if args.flops_per_item:
            lines.append(published_resnet_line(args))
        if name in CASE_DRY_RUNS:
            strategy, run, configured = CASE_DRY_RUNS[name]
            lines.append(dry_run_line(argparse.Namespace(**{**vars(args), **configured}),
                                      strategy, run, dry_run_record(run, dry_runs)))
        lines.append("")
    return "\n".join(lines).rstrip("\n")
