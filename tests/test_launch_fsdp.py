"""Launch tests: 03_fsdp under torchrun with CPU processes at `tiny`.

Six launches shared through one module-scoped fixture: DDP, FSDP in each strategy and wrap
(60 steps, so that checkpointed runs have room to be killed and resumed), hybrid sharding at 4
ranks (clipped by the global norm) and a ResNet; two more run DDP in the last two's setups, to
hold their losses to. Three launches of optimized_fsdp_checkpoint.py checkpoint, resume and
survive a killed rank; two run optimized_fsdp_fp8.py.
"""

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import common
import report
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
    "hybrid": ("optimized_fsdp", 4, ["--hsdp", "2", *CLIP]),
    "resnet": ("optimized_fsdp", 2, ["--model", "resnet"]),
}
DDP_OF = {  # the DDP run of the hybrid's and the ResNet's setups: the same batches, clipped alike
    "hybrid": ("baseline_fsdp", 4, CLIP),
    "resnet": ("baseline_fsdp", 2, ["--model", "resnet"]),
}


def launch_each(runs: dict, tmp_path_factory) -> dict:
    out = {}
    for name, (script, nproc, flags) in runs.items():
        results = tmp_path_factory.mktemp(name) / "results.jsonl"
        finish(torchrun(FOLDER / f"{script}.py", results, *flags, nproc=nproc))
        out[name] = only_record(results)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_each(RUNS, tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_of(tmp_path_factory):
    return launch_each(DDP_OF, tmp_path_factory)


def assert_records_state_and_bytes_as_its_theory_predicts(rec: dict) -> None:
    # exact: counted from the tensors and from what was handed to the collectives
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.01)
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    assert rec["peak_mem_mb"] > rec["state_mb"]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_run_records_state_and_bytes_as_its_theory_predicts(runs, name):
    rec = runs[name]
    assert rec["status"] == "ok" and rec["world_size"] == RUNS[name][1]
    assert len(rec["losses"]) == (60 if LONG[1] in RUNS[name][2] else 8)
    assert all(math.isfinite(x) for x in rec["losses"])
    assert_records_state_and_bytes_as_its_theory_predicts(rec)


@pytest.mark.parametrize("name", ["full_shard", "shard_grad_op", "root"])
def test_fsdp_trains_like_ddp_to_float_rounding(runs, name):
    ddp, fsdp = runs["ddp"], runs[name]
    assert_within_its_tolerance(fsdp, ddp)
    assert max(abs(a - b) / b for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) <= 1e-5
    assert fsdp["state_mb"] == pytest.approx(ddp["state_mb"] / 2, rel=0.01)  # 16/N bytes


def test_the_memory_measure_sees_ddps_bucket_and_fsdps_gathered_weights(runs):
    ddp, full, grad_op = (runs[n] for n in ("ddp", "full_shard", "shard_grad_op"))
    assert ddp["memory"]["grads"] == pytest.approx(4 * ddp["params"] / 2**20, rel=0.01)
    assert grad_op["memory"]["params"] > 1.4 * grad_op["state_mb"] / 4  # more than the shards


def test_strategies_trade_bytes_for_memory(runs):
    ddp, full, grad_op = (runs[n] for n in ("ddp", "full_shard", "shard_grad_op"))
    assert full["strategy"] == "full_shard" and grad_op["strategy"] == "shard_grad_op"
    assert full["comm_mb"] > grad_op["comm_mb"] == pytest.approx(ddp["comm_mb"], rel=0.01)
    assert full["memory"]["params"] < grad_op["memory"]["params"]  # blocks freed after forward


def test_one_unit_for_the_whole_model_peaks_higher_than_one_per_block(runs):
    block, root = runs["full_shard"], runs["root"]
    assert root["wrap"] == "root" and root["variant"] == "--wrap root"
    assert root["strategy"] == "shard_grad_op" and not root["prefetch"]  # one unit, kept
    assert root["peak_mem_mb"] > block["peak_mem_mb"]


@pytest.mark.parametrize("name, mesh", [("hybrid", [2, 2]), ("resnet", [2])])
def test_hybrid_and_resnet_runs_match_ddp_on_the_same_batches_every_step(runs, ddp_of, name,
                                                                          mesh):
    rec, ddp = runs[name], ddp_of[name]
    assert ddp["status"] == "ok" and ddp["world_size"] == DDP_OF[name][1]
    assert rec["mesh"] == mesh and rec["world_size"] == ddp["world_size"]
    assert rec["model"] == ddp["model"] and rec["clip_grad_norm"] == ddp["clip_grad_norm"]
    assert_within_its_tolerance(rec, ddp)
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], ddp["losses"], strict=True)) <= 1e-5
    if name == "hybrid":  # clipped too: clip_grad_norm_ on 2-D DTensors, like DDP's
        assert rec["clip_grad_norm"] == float(CLIP[1]) and "--clip-grad-norm" in rec["variant"]
        assert rec["strategy"] == "hybrid_full_shard"
        assert rec["state_mb"] == pytest.approx(runs["full_shard"]["state_mb"], rel=0.01)


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


# --- Checkpoint and resume (optimized_fsdp_checkpoint.py) -----------------------------------
CHECKPOINT = FOLDER / "optimized_fsdp_checkpoint.py"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """4 steps saved after the 4th (into the default folder, beside the results), what a save
    killed midway after the 8th leaves, then a 60-step run resumed from that folder."""
    results = tmp_path_factory.mktemp("resumed") / "results.jsonl"
    checkpoints = results.parent / "checkpoints"
    finish(torchrun(CHECKPOINT, results, "--steps", "2", "--checkpoint-every", "4"))
    saved = sorted(p.name for p in checkpoints.iterdir())
    (checkpoints / ".step-000008.partial").mkdir()
    finish(torchrun(CHECKPOINT, results, *LONG, "--checkpoint-dir", str(checkpoints), "--resume"))
    return common.load_results(results), saved


def test_a_checkpointing_run_records_its_saves_and_trains_like_optimized_fsdp(runs, resumed):
    (first, again), saved = resumed
    assert saved == ["step-000004"]  # renamed into place: no partial folder left
    assert first["status"] == "ok" and first["baseline"] == "baseline_fsdp"
    assert first["resumed_from"] == 0 and first["checkpoint_every"] == 4
    assert len(first["checkpoint_ms"]) == 1 and first["checkpoint_ms"][0] > 0
    assert first["strategy"] == runs["full_shard"]["strategy"] == "full_shard"
    assert_records_state_and_bytes_as_its_theory_predicts(first)  # no save in the counted step
    assert first["loss_tolerance"] == runs["full_shard"]["loss_tolerance"]
    assert report.max_loss_diff(first["losses"], runs["ddp"]["losses"][:4]) <= \
        first["loss_tolerance"]  # against DDP, as its report row is
    assert again["checkpoint_every"] == 10 and len(again["checkpoint_ms"]) == 6  # 10, 20, .. 60


def test_k_steps_then_a_resumed_run_give_the_losses_of_one_uninterrupted_run(runs, resumed):
    (first, again), _ = resumed
    uninterrupted = runs["full_shard"]["losses"]
    assert first["losses"] == uninterrupted[:4]
    assert again["resumed_from"] == 4 and again["losses"] == uninterrupted[4:]


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
    job = torchrun(CHECKPOINT, results, *LONG, "--checkpoint-dir", str(checkpoints),
                   "--checkpoint-every", "10", "--resume",
                   extra_torchrun=("--standalone", "--max-restarts=1"))
    deadline = time.monotonic() + 120
    while not (checkpoints / "step-000010").exists():
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.01)
    os.kill(worker_pids(job.pid)[1], signal.SIGKILL)
    finish(job)
    final = common.load_results(results)[-1]  # the killed group's rank 0 may record `failed`
    assert final["status"] == "ok" and final["resumed_from"] >= 10
    uninterrupted = runs["full_shard"]["losses"]
    assert final["losses"] == uninterrupted[final["resumed_from"]:]


@pytest.mark.parametrize("flags, world, hint", [
    (["--checkpoint-every", "0"], "2", "--checkpoint-every"),
    (["--hsdp", "3"], "4", "--hsdp"),
])
def test_the_checkpointing_script_refuses_bad_input_in_one_line(flags, world, hint, tmp_path):
    assert_bad_input_is_one_line(CHECKPOINT, flags, hint, tmp_path, WORLD_SIZE=world)


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
    rec, fsdp = ablation["checkpointing"], runs["full_shard"]
    assert rec["checkpointing"] and rec["fp8"] is None and rec["baseline"] == "optimized_fsdp"
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], fsdp["losses"], strict=False)) <= 1e-5
    assert rec["memory"]["activations"] < 0.5 * fsdp["memory"]["activations"]
    assert rec["theory"]["activation_mb"] < rec["theory"]["activation_mb_without_checkpointing"]


def test_fp8_trains_within_its_tolerance_and_gathers_fewer_bytes(ablation):
    both, exact = ablation["both"], ablation["checkpointing"]
    assert both["fp8"]["scaling"] == "tensorwise" and len(both["fp8"]["layers"]) == 8
    assert_within_its_tolerance(both, exact)  # FSDP's losses (the test above)
    assert report.max_loss_diff(both["losses"], exact["losses"]) > 0  # it did cast to float8
    assert both["gathered_mb"]["uint8"] > 0  # float8 weights travel as bytes
    assert sum(both["gathered_mb"].values()) < 0.6 * sum(exact["gathered_mb"].values())


def test_fp8_bad_input_is_one_line(tmp_path):
    assert_bad_input_is_one_line(FOLDER / "optimized_fsdp_fp8.py", ["--model", "resnet"],
                                 "--model", tmp_path)
