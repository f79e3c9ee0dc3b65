"""Everything that reads results rather than training: the report, the per-rank trace
breakdown, the charts and the strategy planner. Recipes never import this package; it imports
`common` for the results file and the shared flags, and the planner imports the scripts that
list planner rows (`PLANNED`) to call their formulas.

    python -m report                 # outputs/results.jsonl -> table, outputs/report.md, charts
    python -m report --wide          # the same, every column in one table
    python -m report traces          # where each traced step's time went, per script and rank
    python -m report plan --params 7e9 --gpus 8 --gpu-mem 80  # which strategy fits, its bytes
    python -m report list            # every script with the first line of its docstring
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import common
from report.calibrate import (
    MODELS,
    calibrate,
    compare_calibrations,
    render_calibration,
)
from report.charts import write_charts
from report.costmodel import CALIBRATION, calibration_covers, load_calibration, priced
from report.dryrun import render_dry_runs
from report.gpus import GPUS
from report.plan_cases import cases_json, render_cases
from report.plan_input import COMPUTE_BYTES, add_moe_flags, moe_error, plan_input, tp_degree
from report.plan_print import plan_json, render_plan, render_published
from report.results_table import json_rows, render_report
from report.runs import mark_failed, smoke
from report.traces import render_traces


def list_scripts(root: Path = common.ROOT) -> str:
    lines, width = [], max(len(s.name) for s in root.glob("[0-9][0-9]_*/*.py"))
    for folder in sorted(root.glob("[0-9][0-9]_*/")):
        lines += ["", f"{folder.name}/"]
        for script in sorted(folder.glob("*.py")):
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
            summary = " ".join(doc.split("\n\n")[0].split())  # its first line, wrapped or not
            lines.append(f"  {script.name:<{width}} {summary}")
    return "\n".join(lines[1:])


# ---------------------------------------------------------------------------------------------
# Command line: the results schema (`--help` prints it), the subcommands
# ---------------------------------------------------------------------------------------------
RESULTS_SCHEMA = """\
results schema: each run appends one JSON object (rank 0) to outputs/results.jsonl.
Every record:
  folder, script        e.g. 01_ddp, optimized_ddp
  baseline              the script this one is compared with (null for a baseline)
  variant               the flags that make it another run of its script (null: defaults)
  status, reason        ok | skipped (why) | failed (the script's own error line); the report
                        adds `over tolerance` when max loss difference > loss_tolerance
  time, host            when (ISO 8601, UTC) and on which host it ran
  size, model, world_size, nnodes, link, backend, device
                        the setup; link is LINK's rate (null: unshaped)
  torch, torchao, torchvision, cuda, nccl
                        versions that change results (null where absent or unused)
A training run (status ok) also:
  params                model parameters, all ranks together
  step_ms, step_ms_p90, step_ms_iqr
                        median, p90 and [q1, q3] of the timed steps' milliseconds
  tokens_per_s | samples_per_s
                        global throughput
  peak_mem_mb, memory   the busiest rank's peak over the measured step (live tensor MB on
                        CPU, with its split by kind; the allocator's on CUDA)
  peak_rss_mb | reserved_mb
                        the process's resident peak (CPU) or the allocator's reserve (CUDA)
  state_mb              the busiest rank's parameters + gradients + optimizer state
  comm_mb               MB a rank sends per step, counted where the script hands tensors over
  losses, loss_tolerance | loss_tolerance_final_rel
                        every step's loss; the largest per-step difference from the baseline
                        allowed, or (a long lossy run) how far the final loss may be from the
                        baseline's final loss, as a fraction of it
  theory                what the technique predicts, computed, beside the measured keys
  work                  what the step did, for the step-time model: this rank's FLOPs
                        (matmul_flops, attention_flops, in blocks of seq_len), token_layers,
                        layer_passes, stepped_params, collectives {"allreduce/2": [bytes sent,
                        calls]}, overlapped (which hide under compute), recompute, bubble,
                        float8_share; null for the ResNet
  predicted_step_ms, prediction
                        not in the file: the report adds them as it reads a record (and
                        --json prints them), the model's step (report/costmodel.py) at the
                        calibration its run took (`make calibrate`), null without one;
                        prediction holds its parts (compute_ms, communication_ms, bubble_ms,
                        optimizer_ms), bound_by (the largest) and calibration (its id), or
                        why (no calibration). An older record carries its own
  comm_by_op            the collectives of the measured step by op and group size:
                        {"allreduce/2": [MB sent, calls]}
  note                  what the host changed of the run's settings, in one line, where it did
                        (a mesh without dp, no weight gathered in float8 at this world): the
                        summary line ends with it, the report's status shows it
  steps, warmup, batch_size, seq_len, dtype, seed, lr, startup_s, warmup_s
  load_avg, cpus        the host's 1-minute load at the first timed step and after the last,
                        and its logical cores
A fine-tuning run (--init-from) also: init_from (the flag: a checkpoint folder, or `scratch`)
and started_from (the checkpoint it read; null from random weights); the report compares only
runs that started alike.
A collectives sweep has `sweep`: one {op, bytes, ms, algbw_gbps, busbw_gbps} per op and size.
A script adds what its technique measures (compression, bubble, timeline, optim_mb, ...).
"""


class OneLineErrors(argparse.ArgumentParser):
    """Bad flags end with one line that names what to change, as the recipes' do."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str]) -> int:
    cli = OneLineErrors(prog="python -m report", description=__doc__.split("\n\n")[0],
                        epilog=RESULTS_SCHEMA, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--results", type=Path, default=common.RESULTS)
    cli.add_argument("--out", type=Path, default=common.RESULTS.parent / "report.md")
    cli.add_argument("--json", action="store_true", help="every measured run as JSON lines for "
                     "machines: its step and the model's, and beside its baseline the measured "
                     "and predicted speedups (results_table.json_rows)")
    cli.add_argument("--wide", action="store_true", help="the results in one table of every "
                     "column (setup, spread, predicted step, theory), not the narrow table and "
                     "its detail below")
    sub = cli.add_subparsers(dest="command", parser_class=OneLineErrors)
    sub.add_parser("report", help="the results table (the default)")
    sub.add_parser("traces", help="where each traced step's time went, per script and rank")
    sub.add_parser("list", help="every script with the first line of its docstring")
    sub.add_parser("dryrun", help="(`make dryrun`) the dry runs' table: one rank of each world, "
                   "as fake tensors counted it (outputs/dryrun.jsonl)")
    plan = sub.add_parser("plan", help="which strategy fits a model on a cluster, and its bytes")
    plan.add_argument("--params", type=common.positive_float,
                      help="model parameters, e.g. 7e9 (required, as --gpus and --gpu-mem are)")
    plan.add_argument("--gpus", type=common.int_at_least(1))
    plan.add_argument("--gpu-mem", type=common.positive_float, help="GB of memory per GPU")
    plan.add_argument("--gpus-per-node", type=common.int_at_least(1), default=8,
                      help="FSDP hybrid shards within a node, TP stays within one (default 8)")
    plan.add_argument("--layers", type=common.int_at_least(1), default=32)
    plan.add_argument("--hidden", type=common.int_at_least(1), default=4096)
    plan.add_argument("--vocab", type=common.int_at_least(1), default=32000)
    plan.add_argument("--seq-len", type=common.int_at_least(1), default=4096)
    plan.add_argument("--micro-batch", type=common.int_at_least(1), default=1,
                      help="sequences per GPU per forward")
    plan.add_argument("--micro-batches", type=common.int_at_least(1), default=None,
                      help="a pipeline's micro-batches per step (default 4 x gpus; PP x FSDP x "
                           "TP: 2 x pp)")
    plan.add_argument("--dtype", choices=sorted(COMPUTE_BYTES), default="bf16")
    plan.add_argument("--llama", action="store_true", help="a Llama's layout: untied head, "
                      "rotary positions (no position table), RMSNorm, no biases (default GPT-2's)")
    plan.add_argument("--ffn", type=common.int_at_least(1), default=None,
                      help="with --llama, the SwiGLU's width (intermediate_size; default: "
                           "Llama's 8/3 x --hidden, rounded up to 256)")
    plan.add_argument("--heads", type=common.int_at_least(1), default=None,
                      help="attention heads (num_attention_heads; default: --hidden / 128)")
    plan.add_argument("--kv-heads", type=common.int_at_least(1), default=None,
                      help="K/V heads (num_key_value_heads; default: --heads)")
    plan.add_argument("--head-dim", type=common.int_at_least(1), default=None,
                      help="a head's width (head_dim; default: --hidden / --heads)")
    plan.add_argument("--cp", type=common.int_at_least(2), default=None,
                      help="FSDP x CP's context-parallel degree (default: the fewest GPUs of a "
                           "node that fit)")
    plan.add_argument("--pp", type=common.int_at_least(2), default=None,
                      help="PP x FSDP x TP's stages (default: the fewest at which it fits)")
    add_moe_flags(plan)
    plan.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                      help="the GPU whose datasheet prices the step (report/gpus.py)")
    plan.add_argument("--run-as", choices=("eager", "compiled", "float8"), default="eager",
                      help="how the step runs: eager, torch.compile, or compiled with float8 "
                           "matmuls (each at the share of the peak torchtitan's runs achieve)")
    plan.add_argument("--lora-rank", type=common.int_at_least(1), default=0,
                      help="fine-tuning: plan FSDP + LoRA beside full training, rank-r adapters "
                           "on every layer's attention projections, the rest frozen (03_fsdp/"
                           "optimized_fsdp_lora.py)")
    plan.add_argument("--muon", action="store_true",
                      help="train with Muon on the hidden matrices, AdamW on the rest: plan "
                           "04_zero's Muon layouts (DDP, ZeRO-1 and FSDP with owners) in place "
                           "of AdamW's, their Newton-Schulz FLOPs in the step")
    plan.add_argument("--published", action="store_true", help="the published runs the "
                      "step-time model is held to (torchtitan's, Megatron-LM's) beside its "
                      "predictions; the other flags are not read")
    plan.add_argument("--cases", action="store_true", help="the decision matrix's worked cases "
                      "(ResNet-50, GPT-2 1.5B, LLaMA-7B, LLaMA-70B, Qwen3-30B-A3B): what the "
                      "planner picks and why, and each case's dry run beside its formula; the "
                      "other flags are not read")
    plan.add_argument("--json", action="store_true", help="the same for machines: a JSON object "
                      "of every candidate row and the pick (with --cases, one a case)")
    plan.add_argument("--dry-results", type=Path, default=common.DRY_RESULTS,
                      help="with --cases: the dry runs' records (default: make dryrun's)")
    fail = sub.add_parser("mark-failed", help="(the Makefile's) a run ended non-zero: print its "
                          "error line, and record it if the run could not", epilog="Give the "
                          "script's own flags after --, to record its size and find its results "
                          "file.")
    fail.add_argument("script", type=Path)
    fail.add_argument("--since", type=float, required=True, help="epoch seconds the run began")
    fail.add_argument("--exit-code", type=int, required=True)
    fail.add_argument("--log", type=Path, required=True, help="the run's output")
    fail.add_argument("--world-size", type=int, default=1)
    fail.add_argument("--no-record", action="store_true", help="print only (not node 0)")
    cal = sub.add_parser("calibrate", help="(`make calibrate`) this host's rates for the "
                         "step-time model, into outputs/calibration.json")
    cal.add_argument("--worlds", type=common.int_at_least(1), nargs="+", default=[2, 4, 8],
                     help="process counts to measure at (default: make all's 2, 4 and 8)")
    cal.add_argument("--size", choices=sorted(common.SIZES), default="small")
    cal.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                     help="default: bf16 on CUDA, fp32 on CPU (as the recipes)")
    cal.add_argument("--reps", type=common.int_at_least(1), default=1,
                     help="timings a figure in each repeat, their median (a timing: 15 ms of "
                          "calls at least; default 1)")
    cal.add_argument("--repeats", type=common.int_at_least(1), default=3,
                     help="measurements of every figure, their median its value and their "
                          "lowest and highest its band (default 3)")
    cal.add_argument("--models", choices=MODELS, nargs="+", default=list(MODELS),
                     help="the decoders whose steps are decomposed (default: all three)")
    cal.add_argument("--quick", action="store_true", help="the calibration a `make` target "
                     "takes before its runs: the collectives over 2 ranks and the whole world "
                     "only (the others priced at the nearest measured)")
    cal.add_argument("--if-missing", action="store_true", help="only if outputs/calibration"
                     ".json lacks this size, device, dtype, one of the worlds or models")
    cal.add_argument("--if-older", type=common.int_at_least(1), default=None, metavar="SECONDS",
                     help="only if this host's calibration at --size, with this torch, is older "
                          "than SECONDS, or lacks one of the worlds or models")
    cal.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), default=None,
                     help="measure nothing: how far two calibration files' figures at --size "
                     "agree (within 10%%, and every one that does not)")
    run = sub.add_parser("smoke", help="(`make smoke`) every run once, one line each",
                         epilog="Give the runs (a script and its flags, quoted) after --.")
    run.add_argument("--nproc", type=int, required=True)
    run.add_argument("--flags", default="", help="flags for every run")
    run.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    # after `--`: the failed run's flags, or smoke's runs (which argparse would read as flags)
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = cli.parse_args(argv[:split]), argv[split + 1:]
    if args.command == "smoke":
        return smoke(rest, args.nproc, args.flags.split(), args.out.parent / "smoke", args.timeout)
    if args.command == "calibrate" and args.compare:
        entries = [(load_calibration(path) or {}).get("sizes", {}).get(args.size)
                   for path in args.compare]
        for path, entry in zip(args.compare, entries, strict=True):
            if entry is None:
                cli.error(f"--compare: {path} holds no calibration at --size {args.size} (is it "
                          f"a file `make calibrate` wrote, at that size?)")
        print(compare_calibrations(*entries))
        return 0
    if args.command == "calibrate":
        dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
        have = (load_calibration() or {}).get("sizes", {}).get(args.size, {})
        if (args.if_missing or args.if_older) and calibration_covers(
                have, dtype, args.worlds, args.models, args.if_older):
            return 0
        entry = calibrate(args.worlds, args.size, dtype, args.reps,
                          CALIBRATION, models=args.models, repeats=args.repeats,
                          quick=args.quick)
        print(render_calibration(entry))
        return 0
    if args.command == "mark-failed":
        print(mark_failed(args.script, rest, args.since, args.exit_code, args.log,
                          args.world_size, record=not args.no_record))
        return 0
    if args.command == "plan":
        missing = [flag for flag in ("--params", "--gpus", "--gpu-mem")
                   if getattr(args, flag[2:].replace("-", "_")) is None]
        shaped = [action.option_strings[0] for action in plan._actions if action.dest not in
                  ("help", "cases", "published", "dry_results", "json")
                  and getattr(args, action.dest) != action.default]
        if args.published:
            print(render_published())
            return 0
        if args.cases or not shaped:  # `make plan` alone: the worked cases, a first look
            print(json.dumps(cases_json(), indent=1) if args.json else
                  render_cases(args.dry_results))
            return 0
        if missing:
            plan.error(f"the following arguments are required: {', '.join(missing)} (or no "
                       "planner flags at all, or --cases, for the worked cases)")
        layout = plan_input(args)
        if args.params <= layout.embedding + layout.head:
            tables = "2 x --vocab x --hidden" if args.llama else \
                "--vocab x --hidden + --seq-len x --hidden"
            plan.error(f"--params {args.params:g} is no more than the embeddings ({tables} = "
                       f"{layout.embedding + layout.head:g}): raise --params or lower "
                       "--vocab/--hidden")
        tp = tp_degree(args.gpus, args.gpus_per_node)
        if args.pp and (args.gpus // tp % args.pp or args.pp > args.layers):
            plan.error(f"--pp {args.pp} does not divide the {args.gpus // tp} GPUs that TP "
                       f"{tp} (in a node) leaves of --gpus {args.gpus}, or exceeds --layers "
                       f"{args.layers}: use a divisor of {args.gpus // tp} up to {args.layers}")
        if moe_error(args):
            plan.error(moe_error(args))
        print(json.dumps(plan_json(args), indent=1) if args.json else render_plan(args))
        return 0
    if args.command == "list":
        print(list_scripts())
        return 0
    if args.command == "dryrun":
        print(render_dry_runs(common.load_results(common.DRY_RESULTS)))
        return 0
    records = priced(common.load_results(args.results))
    if args.json and args.command in (None, "report"):
        for row in json_rows(records):
            print(json.dumps(row))
        return 0
    traces = render_traces(args.results.parent / "traces", records)
    if args.command == "traces":
        print(traces or f"No traces in {args.results.parent / 'traces'}: run with --trace "
                        "(make all TRACE=1) first.")
        return 0
    charts = write_charts(records, args.out.parent / "charts")
    links = ["## Charts", ""] + [f"![{path.stem}](charts/{path.name})" for path in charts]
    text = "\n".join(filter(None, [render_report(records, args.wide), traces,
                                   "\n".join(links) + "\n" if charts else ""]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0
