"""report/planner.py: the strategies it finds in the scripts (PLANNED), their formulas (the
scripts'), its verdicts, its one-line errors, and its figures against what each folder
recorded and measured in real runs (tests/fixtures)."""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import re
import subprocess
import sys

import pytest
import torch

import common
import helpers
from report import cli, gpus, plan_cases, plan_input, plan_print, planner

FIXTURE = common.ROOT / "tests" / "fixtures" / "records_small.jsonl"
MESH_FIXTURE = common.ROOT / "tests" / "fixtures" / "records_mesh.jsonl"
# Each script whose kept state is one of the planned strategies. Not planned: DualPipe (every
# rank holds two stages, the whole model at 2 ranks) and the collective sweeps (no model).
STRATEGY_OF = {
    "baseline_ddp": "DDP", "optimized_ddp": "DDP", "baseline_ddp_flash": "DDP",
    "optimized_ddp_flash": "DDP", "baseline_compression": "DDP",
    "optimized_compression_int8": "DDP", "optimized_compression_powersgd": "DDP",
    "baseline_fsdp": "DDP", "optimized_fsdp": "FSDP full", "optimized_fsdp_fp8": "FSDP full",
    "baseline_zero": "DDP", "optimized_zero1": "ZeRO-1", "optimized_zero2": "ZeRO-2",
    "optimized_zero3": "ZeRO-3", "optimized_zero_pytorch": "ZeRO-1",
    "optimized_zero_pytorch --stage 3": "ZeRO-3", "baseline_symmem_training": "DDP",
    "optimized_symmem_training": "ZeRO-1",  # AdamW's state by share, weights and grads whole
    "baseline_pipeline": "pipeline", "optimized_pipeline_gpipe": "pipeline",
    "optimized_pipeline_1f1b": "pipeline", "optimized_pipeline_dualpipev": "pipeline",
    "optimized_pipeline_pytorch": "pipeline",
    "optimized_pipeline_pytorch --schedule 1f1b": "pipeline",
    "optimized_pipeline_pytorch --schedule dualpipev": "pipeline",
    "baseline_symmem_tp": "TP", "optimized_symmem_tp": "TP", "optimized_symmem_tp_pytorch": "TP",
    "baseline_context": "DDP", "baseline_moe": "DDP", "optimized_moe_ep": "EP",
    "baseline_muon": "DDP + Muon", "optimized_zero1_muon": "ZeRO-1 + Muon",
    "optimized_fsdp_muon": "FSDP + Muon"}


def plan(*flags) -> subprocess.CompletedProcess:
    """`python -m report plan` with `flags`, run in this process (a fresh Python imports torch
    and the scripts: seconds a call): its exit code, stdout and stderr. The command itself runs
    in test_plan_alone_shows_the_cases."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["plan", *flags])
        except SystemExit as exited:
            code = exited.code
    return subprocess.CompletedProcess(["plan", *flags], code, out.getvalue(), err.getvalue())


ENTRIES = {entry["strategy"]: entry for entry in planner.planned_strategies()}
# optimized_fsdp.py's records name the strategy their flags ran
FSDP_STRATEGY = {"full_shard": "FSDP full", "shard_grad_op": "FSDP grad-op"}


def run_input(rec: dict) -> plan_input.PlanInput:
    """A record's own configuration as the planner hands it to a script's formulas: its model
    (size preset, sequence length), world (one node), fp32, and a GPU's sequences a
    micro-batch: a pipeline's batch over its m micro-batches (3-D: a dp rank's pp x batch),
    tensor parallelism's batch (the whole one, on every rank) over the world. A MoE's (a Llama's
    layout): its routed experts, ep, and all its parameters (an EP rank records its own)."""
    size, mesh = common.SIZES[rec["size"]], rec.get("mesh")
    mesh = mesh if isinstance(mesh, dict) else {}  # optimized_fsdp's is a list: its one dim
    m, batch = rec.get("microbatches"), rec["batch_size"]
    if "pp" in mesh:
        micro_batch = mesh["pp"] * batch // m
    elif rec["folder"] == "05_pipeline":
        micro_batch = batch // m
    elif rec["script"].endswith("symmem_tp") or rec["script"].endswith("symmem_tp_pytorch"):
        micro_batch = batch // rec["world_size"]
    elif "cp" in rec:  # a rank's share of its cp group's sequences
        micro_batch = round(batch * rec["cp"])
    else:
        micro_batch = batch
    moe = rec["model"] == "moe"
    flags = argparse.Namespace(
        params=helpers.moe_param_counts(size)[0] if moe else rec["params"],
        gpus=rec["world_size"], gpus_per_node=rec["world_size"],
        layers=size.n_layers, hidden=size.d_model, vocab=size.vocab_size, seq_len=rec["seq_len"],
        micro_batch=micro_batch, micro_batches=m, dtype="fp32",
        llama=rec["model"] in ("llama", "moe"), experts=size.n_experts if moe else 0,
        top_k=size.top_k if moe else 0, expert_ffn=size.expert_ffn if moe else 0,
        moe_layers=None, lora_rank=0, ffn=size.llama_ffn if rec["model"] != "gpt" else None)
    layout = plan_input.plan_input(flags, mesh.get("tp", 1), mesh.get("pp", 1), rec.get("cp", 1),
                                rec.get("ep", 1))
    # LoRA's adapters as the run counted them (the Llama's grouped-query k and v: narrower),
    # beside the model they adapt
    adapters = rec.get("trainable_params", 0.0) if rec.get("lora_rank") else 0.0
    return dataclasses.replace(layout, params=layout.params - adapters, lora_params=adapters) \
        if adapters else layout


def planned(strategy: str, rec: dict) -> dict:
    return ENTRIES[strategy]["figures"](run_input(rec))


def records(*fixtures):
    for fixture in fixtures:
        yield from (r for r in common.load_results(fixture) if r.get("status") == "ok")


def test_the_planner_figure_is_the_recorded_theory():
    """For every run of a script with planner rows, the planner's figures at the run's own
    configuration are the theory the run recorded: one formula, called by both. To the
    records' rounding (3 decimals), and ZeRO's bucket padding (under N values a bucket)."""
    scripts = {}
    for entry in ENTRIES.values():
        scripts.setdefault(entry["script"], []).append(entry["strategy"])
    keys = {"state": "state_mb", "sent": "comm_mb", "gathered": "gathered_mb",
            "bubble": "bubble_uniform"}
    checked = set()
    for rec in records(FIXTURE, MESH_FIXTURE):
        script = f"{rec['folder']}/{rec['script']}.py"
        if script not in scripts or not rec.get("theory") or rec.get("model") == "resnet":
            continue
        strategy = FSDP_STRATEGY.get(rec.get("strategy"), rec.get("strategy", scripts[script][0]))
        if strategy not in scripts[script]:  # a run of a layout the planner has no row for
            continue
        figures, theory = planned(strategy, rec), rec["theory"]
        slack = 0.0015 + 3 * theory.get("padding_mb_max", 0.0)
        if "optim_mb_by_rank" in theory:  # whole tensors to owners (ZeRO-1 + Muon): the planner
            # splits evenly; the run pads every slice to the largest owner's (weights, gradients
            # and both collectives) and its state is the busiest owner's
            owners = theory["optim_mb_by_rank"]
            slack += 2 * theory["padding_mb"] + max(owners) - sum(owners) / len(owners)
        if "alltoall_uniform_mb" in theory:  # EP: the planner's all-to-all is uniform routing's
            theory = {**theory, "comm_mb": theory["comm_mb"] - theory["alltoall_mb"]
                      + theory["alltoall_uniform_mb"],
                      "comm_mb_by_dim": {**theory["comm_mb_by_dim"],
                                         "ep": theory["alltoall_uniform_mb"]}}
            slack += 0.001  # three figures rounded
        label = f"{script} {rec.get('model')} ({strategy})"
        compared = [key for key in keys if key in figures and keys[key] in theory]
        for key in compared:
            scale = 1 if key == "bubble" else 2**20
            assert figures[key] / scale == pytest.approx(theory[keys[key]], abs=slack), \
                f"{label}: {key}"
        for dim, sent in theory.get("comm_mb_by_dim", {}).items():
            assert figures["by_dim"][dim] / 2**20 == pytest.approx(sent, abs=slack), \
                f"{label}: {dim}"
        assert compared, label
        checked.add(script)
    unrecorded = sorted(set(scripts) - checked)
    assert not unrecorded, f"{unrecorded[0]} lists planner rows but has no run in " \
        f"{FIXTURE.relative_to(common.ROOT)}: append the records of its folder's `make <folder> " \
        "SIZE=small` (CONTRIBUTING.md, step 9)"


def test_the_planned_state_is_what_each_folder_measured():
    checked = set()
    for rec in records(FIXTURE):
        label = " ".join(filter(None, [rec["script"], rec.get("variant")]))
        if label not in STRATEGY_OF or "state_mb" not in rec:
            continue
        state = planned(STRATEGY_OF[label], rec)["state"]
        assert state / 2**20 == pytest.approx(rec["state_mb"], rel=0.05), label
        checked.add(label)
    assert checked == set(STRATEGY_OF)


# Each script whose bytes sent are a planned strategy's, counted by the script from what it
# handed to collectives. Not planned: compression and FP8 (fewer bytes by design),
# ZeroRedundancyOptimizer (DDP's all-reduce, then a broadcast of every shard), DualPipe(V)
# (two stages a rank), symmetric-memory training (no process group).
BYTES_OF = {
    "baseline_ddp": "DDP", "optimized_ddp": "DDP", "baseline_ddp_flash": "DDP",
    "optimized_ddp_flash": "DDP", "baseline_compression": "DDP", "baseline_fsdp": "DDP",
    "optimized_fsdp": "FSDP full", "baseline_zero": "DDP", "optimized_zero1": "ZeRO-1",
    "optimized_zero2": "ZeRO-2", "optimized_zero3": "ZeRO-3",
    "optimized_zero_pytorch --stage 3": "FSDP full", "baseline_symmem_training": "DDP",
    "baseline_pipeline": "pipeline", "optimized_pipeline_gpipe": "pipeline",
    "optimized_pipeline_1f1b": "pipeline", "optimized_pipeline_pytorch": "pipeline",
    "optimized_pipeline_pytorch --schedule 1f1b": "pipeline",
    "baseline_symmem_tp": "TP", "optimized_symmem_tp": "TP", "optimized_symmem_tp_pytorch": "TP",
    "baseline_context": "DDP", "baseline_moe": "DDP", "baseline_muon": "DDP + Muon",
    "optimized_zero1_muon": "ZeRO-1 + Muon", "optimized_fsdp_muon": "FSDP + Muon"}


def test_the_planned_bytes_are_what_each_folder_counted():
    checked = set()
    for rec in records(FIXTURE):
        label = " ".join(filter(None, [rec["script"], rec.get("variant")]))
        if label not in BYTES_OF:
            continue
        sent = planned(BYTES_OF[label], rec)["sent"]
        assert sent / 2**20 == pytest.approx(rec["comm_mb"], rel=0.05), label
        checked.add(label)
    assert checked == set(BYTES_OF)


def decoder(**numbers) -> plan_input.PlanInput:
    """A 1e9-parameter decoder of 32 layers with no tables (what shards is all of it)."""
    parts = {"params": 1e9, "gpus": 8, "per_node": 8, "state_bytes": (4, 4, 8), "layers": 32,
             "hidden": 4096, "vocab": 32000, "seq": 4096, "micro_batch": 1,
             "micro_batches": None, "tp": 1, "pp": 1, "cp": 1, "embedding": 0.0, "head": 0.0,
             "tied": 0.0, "replicated": 0.0, "norms": 0.0, "position_table": False}
    return plan_input.PlanInput(**{**parts, **numbers})


def figure(strategy: str, key: str, **numbers) -> float:
    return ENTRIES[strategy]["figures"](decoder(**numbers))[key]


def test_the_strategies_come_from_the_scripts_simplest_first():
    assert list(ENTRIES) == ["DDP", "DDP + Muon", "ZeRO-1", "ZeRO-1 + Muon", "ZeRO-2", "ZeRO-3",
                             "ZeRO-3 + offload", "FSDP full", "FSDP + Muon", "FSDP + LoRA",
                             "FSDP grad-op",
                             "FSDP hybrid", "pipeline", "TP", "TP x DP", "FSDP x TP",
                             "FSDP x CP", "PP x FSDP x TP", "EP", "EP x FSDP"]


def test_a_new_folder_is_planned_with_no_edit_to_the_planner(tmp_path, monkeypatch):
    """A script of a new numbered folder with a PLANNED entry gets its row."""
    (tmp_path / "99_example").mkdir()
    (tmp_path / "99_example" / "optimized_example.py").write_text(
        "def planned_example(plan):\n"
        "    return {'state': 1.0, 'sent': 2.0}\n\n\n"
        "PLANNED = [{'strategy': 'example', 'place': 5, 'figures': planned_example}]\n")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    assert [e["strategy"] for e in planner.planned_strategies()] == ["example"]


@pytest.mark.parametrize("bytes_per", [(4, 4, 8), (2, 2, 12)])
def test_sharding_divides_what_it_shards(bytes_per):
    n = 8
    ddp = figure("DDP", "state", state_bytes=bytes_per)
    assert ddp == 16e9  # both count 16 bytes a parameter, split differently
    assert figure("ZeRO-3", "state", state_bytes=bytes_per) == ddp / n
    stages = [figure(s, "state", state_bytes=bytes_per)
              for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert stages == sorted(stages, reverse=True) and len(set(stages)) == 4
    assert figure("FSDP hybrid", "state", state_bytes=bytes_per, gpus=16) == ddp / 8


def test_bytes_sent_follow_the_ring_formulas():
    p = 1e9
    assert figure("DDP", "sent", gpus=4) == pytest.approx(2 * 3 / 4 * 4 * p)
    # no root: every block gathered twice, reduce-scattered once
    assert figure("ZeRO-3", "sent", gpus=4) == pytest.approx(1.5 * figure("DDP", "sent", gpus=4))
    # the root (the tables) is gathered once: it stays gathered from forward to backward
    assert figure("ZeRO-3", "sent", gpus=4, embedding=1e8) == pytest.approx(
        3 / 4 * (12 * 9e8 + 8 * 1e8))
    assert figure("DDP", "sent", gpus=1) == 0
    # the busiest stage: a middle one sends activations forward and gradients back, an end one
    # activations one way and the tied table's gradient (4 bytes a value in fp32)
    stage_output = 16 * 4096 * 4096 * 4  # m = 16 micro-batches of one sequence, fp32
    assert figure("pipeline", "sent", gpus=4) == pytest.approx(2 * stage_output)
    assert figure("pipeline", "sent", gpus=2, micro_batches=16) == pytest.approx(stage_output)
    assert figure("pipeline", "sent", gpus=2, micro_batches=16, tied=5) == \
        pytest.approx(stage_output + 20)
    assert figure("pipeline", "sent", gpus=1) == 0
    assert figure("pipeline", "bubble", gpus=4, micro_batches=12) == 3 / 15


def test_tensor_parallelism_moves_activations_not_parameters():
    tables, stream = 1e7, 32 * 4096 * 4096  # the tables; one GPU's activations, every layer
    tp = figure("TP", "sent", gpus=4, embedding=tables)
    # 4 all-gathers and 4 reduce-scatters of the 4 GPUs' batch a layer, 3/4 of each, and the
    # tables' gradients all-reduced
    assert tp == pytest.approx(3 / 4 * (8 * 4 * stream * 4 + 2 * 4 * tables))
    assert figure("TP", "sent", gpus=4, embedding=tables, params=2e9) == pytest.approx(tp)
    assert figure("TP", "sent", gpus=1, embedding=tables) == 0
    # inside one node TP x DP is TP; across two, each GPU's gradients cross to its other replica
    assert figure("TP x DP", "sent", embedding=tables) == figure("TP", "sent", embedding=tables)
    across = figure("TP x DP", "sent", gpus=16, embedding=tables)
    kept = (1e9 - tables) / 8 + tables
    assert across == pytest.approx(figure("TP", "sent", embedding=tables) + 2 / 2 * 4 * kept)
    assert figure("TP x DP", "network", gpus=16, embedding=tables) == pytest.approx(4 * kept)
    assert figure("TP", "state", embedding=tables) == pytest.approx(16 * kept)
    assert figure("TP x DP", "state", gpus=16, embedding=tables) == \
        figure("TP", "state", embedding=tables)


def test_checkpointing_shrinks_activations():
    kw = {"layers": 32, "seq": 4096, "batch": 1, "hidden": 4096, "vocab": 32000, "dtype": "bf16"}
    full = plan_input.activations_per_gpu(checkpointing=False, **kw)
    assert plan_input.activations_per_gpu(checkpointing=True, **kw) < full / 4
    assert plan_input.activations_per_gpu(checkpointing=False, **{**kw, "dtype": "fp32"}) > full
    # a Llama layer saves 4 tensors of its SwiGLU's width (8/3 hidden): more than a GPT block
    assert plan_input.activations_per_gpu(checkpointing=False, llama=True, **kw) > full


def test_the_planned_activations_are_the_recorded_theory():
    """The planner's activations at the FP8 script's recorded configuration (its model's head
    count; without the planner's loss term, which the script leaves out) are what the script
    recorded, with and without checkpointing: one formula, called by both."""
    checked = 0
    for rec in records(FIXTURE):
        if rec["script"] != "optimized_fsdp_fp8" or not rec.get("theory"):
            continue
        size, seq, batch = common.SIZES[rec["size"]], rec["seq_len"], rec["batch_size"]
        for checkpointing, key in ((rec["checkpointing"], "activation_mb"),
                                   (False, "activation_mb_without_checkpointing")):
            acts = plan_input.activations_per_gpu(size.n_layers, seq, batch, size.d_model,
                                               size.vocab_size, rec["dtype"], checkpointing,
                                               rec["model"] == "llama", heads=size.n_heads,
                                               ffn=size.llama_ffn, loss=None)
            assert acts / 2**20 == pytest.approx(rec["theory"][key], abs=0.0015), key
            checked += 1
    assert checked


def test_the_pick_names_ddp_by_name():
    """why_picked finds DDP's row (without checkpointing) wherever it sits, and says nothing of
    DDP when no row is DDP's."""
    args = argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, "params": 7e9, "gpus": 8, "layers": 32,
                                 "hidden": 4096, "vocab": 32000, "seq_len": 4096})
    rows = planner.plan_strategies(args)
    best = planner.choose(rows)
    ddp = next(r for r in rows if r["strategy"] == "DDP" and not r["checkpointing"])
    assert f"DDP needs {ddp['total'] / plan_input.GB:,.1f}" in \
        plan_print.why_picked(rows[::-1], best, args.gpu_mem)
    without = [r for r in rows if r["strategy"] != "DDP"]
    assert "DDP" not in plan_print.why_picked(without, planner.choose(without), args.gpu_mem)


def test_a_7b_model_on_8_gpus_of_80_gb():
    run = plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80")
    assert run.returncode == 0, run.stderr
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[6].strip()
            for line in run.stdout.splitlines() if line.startswith("| ")}
    assert rows[("DDP", "yes")] == "no"  # 16 bytes x 7e9 = 112 GB of state alone
    assert rows[("ZeRO-3", "no")] == rows[("FSDP full", "yes")] == "yes"
    assert rows[("TP", "no")] == rows[("TP x DP", "yes")] == "yes"  # the blocks split 8 ways
    assert "Cheapest in communication that fits: pipeline" in run.stdout


def test_nothing_fits_says_what_to_change():
    run = plan("--params", "70e9", "--gpus", "2", "--gpu-mem", "24")
    assert run.returncode == 0 and "Nothing fits" in run.stdout and "--gpus" in run.stdout


@pytest.mark.parametrize("flags, hint", [
    (["--gpus", "8", "--gpu-mem", "80"], "--params"),
    (["--llama"], "--params"),  # a planner flag given: not the cases, the three are needed
    (["--params", "7e9", "--gpus", "0", "--gpu-mem", "80"], "--gpus"),
    (["--params", "1e5", "--gpus", "8", "--gpu-mem", "80"], "--params"),
    (["--params", "7e9", "--gpus", "8", "--gpu-mem", "80", "--dtype", "fp16"], "--dtype"),
    # TP 8 in a node leaves 8 GPUs of 64 for pp x dp: 3 stages do not divide them
    (["--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--pp", "3"], "--pp"),
    (["--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--pp", "8", "--layers", "4"],
     "--pp")])
def test_bad_input_is_one_line(flags, hint):
    run = plan(*flags)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert hint in run.stderr


def test_tp_over_one_gpu_is_fsdp():
    llama = {"embedding": 32000 * 4096, "head": 32000 * 4096, "replicated": 65 * 4096,
             "norms": 65 * 4096, "params": 7e9}
    fsdp_tp = ENTRIES["FSDP x TP"]["figures"](decoder(**llama))
    assert fsdp_tp["state"] == pytest.approx(figure("FSDP full", "state", params=7e9))
    assert fsdp_tp["by_dim"]["tp"] == 0
    # sharding over pp x dp x tp: the last stage's blocks 1/pp of them, its head split dp x tp,
    # its 32 layers' norms (64) and the final one whole over tp
    three_d = ENTRIES["PP x FSDP x TP"]["figures"](decoder(**llama, gpus=64, pp=2, tp=8))
    assert three_d["state"] == pytest.approx(16 * ((7e9 - 2 * 32000 * 4096 - 65 * 4096) / 64
                                                   + 32000 * 4096 / 32 + 33 * 4096 / 4))


def test_tp_traffic_stays_in_the_node():
    """Across 8 nodes, the composed rows' bytes across nodes are FSDP's and the pipeline's: TP's
    stay on NVLink, and the table shows each dim's."""
    run = plan("--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--layers", "80",
               "--hidden", "8192", "--llama", "--pp", "4")
    assert run.returncode == 0, run.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| ") and " x TP" in line]
    assert len(rows) == 4
    for row in rows:
        by_dim = dict(part.rsplit(" ", 1) for part in row[-1].split(": ")[1].split(" / "))
        assert float(row[8]) == pytest.approx(sum(float(by_dim[d]) for d in ("FSDP", "PP")
                                                  if d in by_dim), abs=0.02)
        assert float(row[7]) == pytest.approx(sum(map(float, by_dim.values())), abs=0.03)
    assert all(row[-1].startswith("pp 4 x dp 2 x tp 8, m 8") for row in rows[2:])


def case_picks(stdout: str) -> dict[str, str]:
    """Each case's "Pick: ..." sentence, by the case's name (the line that opens its table)."""
    names, picks, case = [name for name, _, _ in plan_cases.CASES], {}, None
    for line in stdout.splitlines():
        case = next((name for name in names if line.startswith(f"{name} (")), case)
        if line.startswith("Pick: "):
            picks[case] = line.removeprefix("Pick: ")
    return picks


def test_the_decision_matrix_cases():
    run = plan("--cases")
    assert run.returncode == 0, run.stderr
    picks = {case: pick.split(":")[0] for case, pick in case_picks(run.stdout).items()}
    assert picks == {
        # the most tokens/s a GPU; within 5% the simplest. GPT-2: ZeRO-1 and -2 gather and
        # reduce fp32 values, ZeRO-3 gathers bf16 ones (as FSDP does, as fast)
        "ResNet-50 on 8 GPUs": "DDP", "GPT-2 1.5B on 4 GPUs": "ZeRO-3",
        # ZeRO-1 keeps fp32 weights and gradients whole and autocast's bf16 copy: 99 GB
        "LLaMA-7B on 8 GPUs": "ZeRO-2",
        # ZeRO-3 alone needs 18.9 GB a GPU; offloaded, 6.7 (the case's offload line), faster
        # than the context-parallel layout, which sends K/V around a ring of 8 besides
        "LLaMA-7B on 8 16-GB GPUs": "ZeRO-3 + offload with activation checkpointing",
        # FSDP x CP (dp 32 x cp 2) fits without checkpointing but sends 412 GB a GPU across
        # nodes a step; TP inside the node and FSDP across, with checkpointing, is faster
        "LLaMA-70B on 64 GPUs": "FSDP x TP (dp 8 x tp 8) with activation checkpointing",
        # two stages of the whole model a node: its bubble costs less than TP's exposed bytes;
        # 1F1B's 16 micro-batches in flight, each with autocast's copy of the stage's experts,
        # fit only checkpointed
        "Qwen3-30B-A3B on 16 GPUs": "pipeline with activation checkpointing",
        # full training's state alone (16 bytes x 7B / 2) is over 24 GB a GPU; the frozen
        # model's 2 bytes a weight / 2 is 7 GB
        "Fine-tuning LLaMA-7B on 2 GPUs": "FSDP + LoRA with activation checkpointing"}


def test_plan_alone_shows_the_cases():
    """`make plan` with no ARGS: the worked cases, as --cases prints them, not an error."""
    alone = subprocess.run(["make", "--no-print-directory", "plan", f"PYTHON={sys.executable}"],
                           cwd=common.ROOT, capture_output=True, text=True, timeout=120)
    cases = plan("--cases")
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout == cases.stdout and "LLaMA-70B on 64 GPUs" in alone.stdout


def test_the_planned_ep_is_the_recorded_theory():
    """The planner's EP figures at optimized_moe_ep's recorded configuration are its theory:
    the state, the all-to-all for uniform routing (its by_dim "ep"), and the bytes a step with
    the all-to-all the routing really sent (comm_mb) less that for uniform routing."""
    runs = [r for r in records(FIXTURE) if r["script"] == "optimized_moe_ep"]
    assert runs, "no optimized_moe_ep record in the fixture"
    for rec in runs:
        figures, theory = planned(rec["strategy"], rec), rec["theory"]
        assert figures["state"] / 2**20 == pytest.approx(theory["state_mb"], abs=0.0015)
        assert figures["alltoall"] == figures["by_dim"]["ep"]
        assert figures["alltoall"] / 2**20 == pytest.approx(theory["alltoall_uniform_mb"],
                                                            abs=0.0015)
        routed = theory["comm_mb"] - theory["alltoall_mb"] + theory["alltoall_uniform_mb"]
        assert figures["sent"] / 2**20 == pytest.approx(routed, abs=0.0025)


MOE = {"experts": 64, "top_k": 4, "moe_layers": 32, "expert_params": 32 * 64 * 3 * 4096 * 1024,
       "params": 30e9, "gpus": 32}


@pytest.mark.parametrize("ep", [8, 32])
def test_the_crossover_is_where_the_all_to_all_meets_what_it_saves(ep):
    """At the crossover's tokens a GPU the all-to-all sends what EP saves (data parallelism's
    all-reduce of every expert's gradient less EP's over the replicas), by hand; under it EP
    sends fewer bytes than DDP (its own row, 01_ddp's formula), over it more."""
    g, n, h, w, k, e = 4, 32, 4096, 4, 4, 64
    per_token = 32 * 4 * k * (ep - 1) / ep * h * w  # 32 layers: 2 ways x (out + back) a slot
    counts = 32 * e * 8 * (ep - 1) / ep
    saved = 2 * (n - 1) / n * g * MOE["expert_params"] \
        - 2 * (n // ep - 1) / (n // ep) * g * MOE["expert_params"] / ep
    crossover = figure("EP", "crossover", ep=ep, **MOE)
    assert crossover == pytest.approx((saved - counts) / per_token)
    tokens = {"under": math.floor(crossover), "over": math.ceil(crossover)}
    routers = 2 * (n - 1) / n * 8 * 32 * e  # the routers' counts, which EP's row adds
    sent = {side: figure("EP", "sent", ep=ep, seq=seq, **MOE) - routers
            for side, seq in tokens.items()}
    ddp = figure("DDP", "sent", **MOE)
    assert sent["under"] < ddp < sent["over"]
    at = decoder(ep=ep, seq=tokens["over"], **MOE)
    assert ENTRIES["EP"]["figures"](at)["alltoall"] == pytest.approx(
        tokens["over"] * per_token + counts)


def test_a_dense_model_has_no_ep_row_and_a_moe_says_where_ep_stops_paying():
    dense = plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80")
    assert "| EP" not in dense.stdout and "crossover" not in dense.stdout
    moe = plan("--params", "30.5e9", "--gpus", "8", "--gpu-mem", "80", "--layers", "48",
               "--hidden", "2048", "--vocab", "151936", "--llama", "--experts", "128",
               "--top-k", "8", "--expert-ffn", "768")
    assert moe.returncode == 0, moe.stderr
    rows = [line for line in moe.stdout.splitlines() if line.startswith("| EP")]
    assert len(rows) == 4 and all("ep 8" in row for row in rows)
    # ep = 8 = the GPUs: every expert's gradient stays on its one GPU, and the all-to-all
    # (48 layers x 4 x 8 slots x 7/8 x 2,048 x 2 bytes a token, bf16) meets DDP's all-reduce of
    # the experts' fp32 gradients (2 x 7/8 x 4 bytes x 48 x 128 x 3 x 2,048 x 768) at
    # 128 x 3 x 768 / 8 tokens
    assert "meet at 36,864 tokens a GPU a step" in moe.stdout


@pytest.mark.parametrize("flags, hint", [
    (["--experts", "8"], "--top-k"),
    (["--experts", "8", "--top-k", "9", "--expert-ffn", "64"], "--top-k"),
    (["--experts", "8", "--top-k", "2", "--expert-ffn", "100000"], "--expert-ffn")])
def test_bad_moe_input_is_one_line(flags, hint):
    run = plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80", *flags)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert hint in run.stderr


# ---- Step times: the cost model on GPUs, against published runs (tests/fixtures) ------------
PUBLISHED = json.loads((common.ROOT / "tests" / "fixtures" / "published_steps.json").read_text())


def published_error(row: dict) -> float:
    """How far the model's prediction is from a published run: its tokens/s a GPU, or, for a
    row that publishes MFU only (Megatron-LM's), its MFU."""
    predicted = planner.predict_published(row)
    if row["tokens_per_gpu_s"] is None:
        return predicted["mfu"] / row["mfu"] - 1
    return predicted["tokens_per_gpu_s"] / row["tokens_per_gpu_s"] - 1


def test_the_achieved_fraction_gives_back_the_row_it_was_fitted_on():
    for run_as, tokens_per_s in gpus.FITTED_ON.items():
        args = planner.layout_args(gpus.LLAMA31["8B"], 8, 8192, 2, gpu="h100-96gb-500w",
                                   run_as=run_as)
        predicted = planner.predict_layout(args)["tokens_per_gpu_s"]
        assert predicted == pytest.approx(tokens_per_s, rel=1e-6)
    # compile and float8 make more of the peak than eager
    assert planner.achieved("eager") < planner.achieved("compiled") < planner.achieved("float8")


def test_published_runs_are_predicted_within_a_fifth():
    """torchtitan's H100 tables (8B and 70B; FSDP, FSDP x TP, with PP: 405B's) and Megatron-LM's
    70B MFU, none of them the rows the model was fitted on: at least 4 of 6 within 20%."""
    rows = PUBLISHED["rows"]
    layouts = {("FSDP" if r["tp"] == 1 else "FSDP x TP" if r["pp"] == 1 else "PP") for r in rows}
    assert len(rows) >= 6 and layouts == {"FSDP", "FSDP x TP", "PP"}
    assert {r["model"] for r in rows} >= {"8B", "70B"} and \
        any(r["source"] == "megatron-lm" for r in rows)
    errors = [published_error(r) for r in rows]
    near = sum(abs(e) <= 0.2 for e in errors)
    assert near / len(rows) >= 4 / 6, [f"{r['table']} {r['label']}: {e:+.0%}"
                                       for r, e in zip(rows, errors, strict=True)]


def test_the_order_of_strategies_in_each_published_table():
    """Within each table (one model and mesh, one change a row: compile, float8, async TP, the
    schedule), the faster row published is the faster row predicted."""
    tables = {}
    for row in PUBLISHED["rows"]:
        if row["tokens_per_gpu_s"] is not None:
            tables.setdefault(row["table"], []).append(row)
    assert len(tables) >= 4
    for name, rows in tables.items():
        published = sorted(rows, key=lambda r: r["tokens_per_gpu_s"])
        predicted = sorted(rows, key=lambda r: planner.predict_published(r)["tokens_per_gpu_s"])
        assert [r["label"] for r in predicted] == [r["label"] for r in published], name


def test_every_planned_row_has_a_step_time_mfu_and_what_binds_it():
    run = plan("--params", "7e9", "--gpus", "16", "--gpu-mem", "80", "--llama")
    assert run.returncode == 0, run.stderr
    assert "| step " in run.stdout and "tok/s/GPU" in run.stdout and "bound by" in run.stdout
    args = argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, "params": 7e9, "gpus": 16,
                                 "layers": 32, "hidden": 4096, "vocab": 32000,
                                 "seq_len": 4096, "llama": True})
    rows = planner.plan_strategies(args)
    assert rows and all(r["step_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert {r["bound_by"] for r in rows} <= {"compute", "NVLink", "network", "bubble",
                                             "optimizer", "memory", "host link",
                                             "host memory"}
    # a row that does not fit is bound by memory; checkpointing's recompute costs time
    assert all(r["bound_by"] == "memory" for r in rows if not r["fits"])
    ddp = {r["checkpointing"]: r for r in rows if r["strategy"] == "DDP"}
    assert ddp[True]["step_s"] > ddp[False]["step_s"]
    # a faster GPU, the same plan: a shorter step, but for offload's, whose host step hides
    # under the forward's compute, a shorter window on the faster GPU (the host is no faster)
    faster = planner.plan_strategies(argparse.Namespace(**{**vars(args), "gpu": "b200"}))
    assert all(f["step_s"] < r["step_s"] for f, r in zip(faster, rows, strict=True)
               if "offload" not in r["strategy"])


def test_the_cases_say_their_step_mfu_and_what_binds_it():
    """A table a case, one row a candidate (CASE_COLUMNS), then its pick in a sentence: a
    decoder's speed in tokens/s, the CNN's in images/s."""
    run = plan("--cases")
    headers = [line for line in run.stdout.splitlines() if line.startswith("| strategy ")]
    assert len(headers) == len(plan_cases.CASES)
    units = ["images" if flags.get("flops_per_item") else "tokens"
             for _, flags, _ in plan_cases.CASES]
    assert [[cell.strip() for cell in line.split("|")[1:-1]] for line in headers] == \
        [[c.format(unit=unit) for c in plan_print.CASE_COLUMNS] for unit in units]
    cases = list(case_picks(run.stdout).values())
    assert len(cases) == len(plan_cases.CASES)
    assert all(re.search(rf"[\d,]+ {unit}/s a GPU \(MFU \d+%, a step [\d.,]+ m?s, bound by "
                         r"(compute|NVLink|network|bubble|optimizer|host link|host memory)\)",
                         line) for line, unit in zip(cases, units, strict=True))


def test_resnet50s_flops_an_image_are_what_torch_counts():
    """The CNN case's FLOPs an image: torchvision's ResNet-50 at 224 x 224, forward and
    backward, as FlopCounterMode counts them (24.30 GFLOP)."""
    torchvision = pytest.importorskip("torchvision")
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.resnet50()
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, 224, 224)).sum().backward()
    assert counter.get_total_flops() == pytest.approx(plan_cases.RESNET50_TRAIN_FLOPS, rel=0.01)


def test_the_resnet_case_is_checked_against_its_published_run():
    """Its DDP row priced on the published run's GPUs, beside that run's images/s a GPU."""
    name, flags, _ = plan_cases.CASES[0]
    args = argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, **flags})
    line = plan_cases.published_resnet_line(args)
    per_gpu = plan_cases.RESNET50_PUBLISHED["images_per_s"] / 8
    assert name.startswith("ResNet-50") and f"{per_gpu:,.0f} images/s a GPU" in line
    at = argparse.Namespace(**{**vars(args), "gpu": "a100"})
    ddp = next(r for r in planner.plan_strategies(at) if r["strategy"] == "DDP")
    assert f"{ddp['per_gpu_s']:,.0f} ({ddp['per_gpu_s'] / per_gpu - 1:+.0%}" in line
    assert line in plan("--cases").stdout


def test_the_plan_as_json_is_what_the_tables_print():
    """`--json`: the same rows and pick for machines, a case each with --cases."""
    one = json.loads(plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80", "--json").stdout)
    text = plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80").stdout
    assert f"Pick: {one['why']}" in text and one["why"].startswith(one["pick"])
    assert [r["strategy"] for r in one["rows"]] == [
        line.split("|")[1].strip() for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| strategy")]
    cases = json.loads(plan("--cases", "--json").stdout)
    picks = case_picks(plan("--cases").stdout)
    assert [c["case"] for c in cases] == [name for name, _, _ in plan_cases.CASES]
    assert all(picks[c["case"]].startswith(c["why"]) for c in cases)
    assert cases[0]["rows"][0]["unit"] == "images"
