"""Launch tests: 03_fsdp under torchrun with CPU processes at `tiny`.

Six launches shared through one module-scoped fixture: DDP, FSDP in each strategy and wrap
(60 steps, so that checkpointed runs have room to be killed and resumed), hybrid sharding at 4
ranks (clipped by the global norm) and a ResNet, the last two validated step by step against a
DDP replica in the same process (clipped alike). Three more launches checkpoint, resume and
survive a killed rank.
"""

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import common
from helpers import (
    assert_bad_input_is_one_line,
    assert_within_its_tolerance,
    finish,
    load_recipe,
    only_record,
    torchrun,
)

FOLDER = common.ROOT / "03_fsdp"
LONG = ["--steps", "58"]  # 60 steps with the 2 of warm-up
CLIP = ["--clip-grad-norm", "0.5"]  # under the tiny GPT's gradient norm (1.2 to 2.1): always clips
RUNS = {  # name: (script, processes, flags)
    "ddp": ("baseline_fsdp", 2, LONG),
    "full_shard": ("optimized_fsdp", 2, LONG),
    "shard_grad_op": ("optimized_fsdp", 2, [*LONG, "--reshard-after-forward", "false"]),
    "root": ("optimized_fsdp", 2, [*LONG, "--wrap", "root"]),
    "hybrid": ("optimized_fsdp", 4, ["--hsdp", "2", "--validate", *CLIP]),
    "resnet": ("optimized_fsdp", 2, ["--model", "resnet", "--validate"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (script, nproc, flags) in RUNS.items():
        results = tmp_path_factory.mktemp(name) / "results.jsonl"
        console = finish(torchrun(FOLDER / f"{script}.py", results, *flags, nproc=nproc))
        out[name] = (only_record(results), console)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_each_run_records_state_and_bytes_as_its_theory_predicts(runs, name):
    rec, _ = runs[name]
    assert rec["status"] == "ok" and rec["world_size"] == RUNS[name][1]
    assert len(rec["losses"]) == (60 if LONG[1] in RUNS[name][2] else 8)
    assert all(math.isfinite(x) for x in rec["losses"]) and rec.get("resumed_from", 0) == 0
    # exact: counted from the tensors and from what was handed to the collectives
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.01)
    replica = common.ring_allreduce_mb(4 * rec["params"], rec["world_size"]) \
        if rec.get("validated") else 0  # a validated run also sends its DDP replica's bytes
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"] + replica, rel=1e-3)
    assert rec["peak_mem_mb"] > rec["state_mb"]


@pytest.mark.parametrize("name", ["full_shard", "shard_grad_op", "root"])
def test_fsdp_trains_like_ddp_to_float_rounding(runs, name):
    ddp, fsdp = runs["ddp"][0], runs[name][0]
    assert_within_its_tolerance(fsdp, ddp)
    assert max(abs(a - b) / b for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) <= 1e-5
    assert fsdp["state_mb"] == pytest.approx(ddp["state_mb"] / 2, rel=0.01)  # 16/N bytes


def test_the_memory_measure_sees_ddps_bucket_and_fsdps_gathered_weights(runs):
    ddp, full, grad_op = (runs[n][0] for n in ("ddp", "full_shard", "shard_grad_op"))
    assert ddp["memory"]["grads"] == pytest.approx(4 * ddp["params"] / 2**20, rel=0.01)
    assert grad_op["memory"]["params"] > 1.4 * grad_op["state_mb"] / 4  # more than the shards


def test_strategies_trade_bytes_for_memory(runs):
    ddp, full, grad_op = (runs[n][0] for n in ("ddp", "full_shard", "shard_grad_op"))
    assert full["strategy"] == "full_shard" and grad_op["strategy"] == "shard_grad_op"
    assert full["comm_mb"] > grad_op["comm_mb"] == pytest.approx(ddp["comm_mb"], rel=0.01)
    assert full["memory"]["params"] < grad_op["memory"]["params"]  # blocks freed after forward


def test_one_unit_for_the_whole_model_peaks_higher_than_one_per_block(runs):
    block, root = runs["full_shard"][0], runs["root"][0]
    assert root["wrap"] == "root" and root["variant"] == "--wrap root"
    assert root["strategy"] == "shard_grad_op" and not root["prefetch"]  # one unit, kept
    assert root["peak_mem_mb"] > block["peak_mem_mb"]


@pytest.mark.parametrize("name, mesh", [("hybrid", [2, 2]), ("resnet", [2])])
def test_validated_runs_match_a_ddp_replica_every_step(runs, name, mesh):
    rec, console = runs[name]
    assert rec["validated"] and rec["mesh"] == mesh
    assert "validate: losses equal DDP's every step" in console
    if name == "hybrid":  # clipped too: clip_grad_norm_ on 2-D DTensors, like DDP's
        assert rec["clip_grad_norm"] == float(CLIP[1]) and "--clip-grad-norm" in rec["variant"]
        assert rec["strategy"] == "hybrid_full_shard"
        assert rec["state_mb"] == pytest.approx(runs["full_shard"][0]["state_mb"], rel=0.01)


@pytest.mark.parametrize("flags, world, hint", [
    (["--hsdp", "3"], "4", "--hsdp"),
    (["--clip-grad-norm", "0"], "2", "--clip-grad-norm"),
    (["--clip-grad-norm", "1", "--cpu-offload"], "2", "--clip-grad-norm with --cpu-offload"),
    pytest.param(["--cpu-offload"], "1", "--cpu-offload", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="--cpu-offload is refused only without CUDA")),
])
def test_bad_input_exits_2_with_one_line(flags, world, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / "optimized_fsdp.py", flags, hint, tmp_path,
                                 WORLD_SIZE=world)


@pytest.mark.parametrize("script", ["baseline_fsdp", "optimized_fsdp_fp8"])
def test_the_other_scripts_refuse_a_clip_norm_not_above_zero_in_one_line(script, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", ["--clip-grad-norm", "-1"],
                                 "--clip-grad-norm", tmp_path)


def test_k_steps_then_a_resumed_run_give_the_losses_of_one_uninterrupted_run(runs, tmp_path):
    results, checkpoints = tmp_path / "results.jsonl", tmp_path / "checkpoints"
    script = FOLDER / "optimized_fsdp.py"
    finish(torchrun(script, results, "--steps", "2", "--checkpoint-dir", str(checkpoints),
                    "--checkpoint-every", "4"))  # steps 1-4, saved after step 4
    (checkpoints / ".step-000008.partial").mkdir()  # what a save killed midway leaves
    finish(torchrun(script, results, *LONG, "--checkpoint-dir", str(checkpoints), "--resume"))
    first, resumed = common.load_results(results)
    uninterrupted = runs["full_shard"][0]["losses"]
    assert first["losses"] == uninterrupted[:4]
    assert resumed["resumed_from"] == 4 and resumed["losses"] == uninterrupted[4:]


def worker_pids(agent_pid: int) -> dict[int, int]:
    """Local rank -> pid of the processes a torchrun agent started."""
    workers = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        rank = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"LOCAL_RANK=")]
        if ppid == agent_pid and rank:
            workers[int(rank[0])] = int(stat.parent.name)
    return workers


def test_a_killed_rank_restarts_the_job_which_resumes_from_its_last_checkpoint(runs, tmp_path):
    results, checkpoints = tmp_path / "results.jsonl", tmp_path / "checkpoints"
    job = torchrun(FOLDER / "optimized_fsdp.py", results, *LONG, "--checkpoint-dir",
                   str(checkpoints), "--checkpoint-every", "10", "--resume",
                   extra_torchrun=("--standalone", "--max-restarts=1"))
    deadline = time.monotonic() + 120
    while not (checkpoints / "step-000010").exists():
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.01)
    os.kill(worker_pids(job.pid)[1], signal.SIGKILL)
    finish(job)
    final = common.load_results(results)[-1]  # the killed group's rank 0 may record `failed`
    assert final["status"] == "ok" and final["resumed_from"] >= 10
    uninterrupted = runs["full_shard"][0]["losses"]
    assert final["losses"] == uninterrupted[final["resumed_from"]:]


# --- FP8 and activation checkpointing (optimized_fsdp_fp8.py) ----------------------------------
fp8_recipe = load_recipe(FOLDER / "optimized_fsdp_fp8.py")


@pytest.mark.parametrize("shape, fqn, converted", [((64, 192), "blocks.0.attn.qkv", True),
                                                   ((64, 24), "blocks.0.fc", False),
                                                   ((40, 64), "blocks.0.fc_proj", False),
                                                   ((64, 128), "head", False)])
def test_fp8_takes_linears_of_multiples_of_16_but_not_the_tied_head(shape, fqn, converted):
    assert fp8_recipe.fp8_eligible(torch.nn.Linear(*shape), fqn) == converted


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """The FP8 + checkpointing run and checkpointing alone, at 2 processes (8 steps each)."""
    out = {}
    for name, flags in {"both": [], "checkpointing": ["--no-fp8"]}.items():
        results = tmp_path_factory.mktemp(name) / "results.jsonl"
        finish(torchrun(FOLDER / "optimized_fsdp_fp8.py", results, *flags))
        out[name] = only_record(results)
    return out


def test_checkpointing_alone_keeps_fsdps_losses_and_cuts_the_activations(runs, ablation):
    rec, fsdp = ablation["checkpointing"], runs["full_shard"][0]
    assert rec["checkpointing"] and rec["fp8"] is None and rec["baseline"] == "optimized_fsdp"
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], fsdp["losses"], strict=False)) <= 1e-5
    assert rec["memory"]["activations"] < 0.5 * fsdp["memory"]["activations"]
    assert rec["theory"]["activation_mb"] < rec["theory"]["activation_mb_without_checkpointing"]


def test_fp8_trains_within_its_tolerance_and_gathers_fewer_bytes(ablation):
    both, exact = ablation["both"], ablation["checkpointing"]
    assert both["fp8"]["scaling"] == "tensorwise" and len(both["fp8"]["layers"]) == 8
    assert_within_its_tolerance(both, exact)  # FSDP's losses (the test above)
    assert common.max_loss_diff(both["losses"], exact["losses"]) > 0  # it did cast to float8
    assert both["gathered_mb"]["uint8"] > 0  # float8 weights travel as bytes
    assert sum(both["gathered_mb"].values()) < 0.6 * sum(exact["gathered_mb"].values())


def test_fp8_bad_input_is_one_line(tmp_path):
    assert_bad_input_is_one_line(FOLDER / "optimized_fsdp_fp8.py", ["--model", "resnet"],
                                 "--model", tmp_path)
