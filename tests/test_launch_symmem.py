"""Launch tests: 06_symmem under torchrun with 2 CPU processes: the two collectives sweeps (a
short one), the two data-parallel training runs and the three tensor-parallel ones at `tiny`,
shared through one module-scoped fixture, two launches in flight (the hand-written TP pair on the
Llama, against the data-parallel run of the same model)."""

import functools
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

import common
from helpers import (
    TINY,
    as_rank,
    assert_bad_input_is_one_line,
    assert_skipped_with_why,
    assert_within_its_tolerance,
    cpu_env,
    finish_all,
    load_recipe,
    only_record,
    run_then_leave,
    torchrun,
)
from report import results_table

FOLDER = common.ROOT / "06_symmem"
SWEEP = ["--sizes", "4K,64K,1M", "--iters", "3"]
# make all TRACE=1 passes --trace to every script; a sweep says it has nothing to trace
RUNS = {"baseline_symmem_allreduce": [*SWEEP, "--trace", "--warmup", "3"],
        "optimized_symmem_allreduce": SWEEP,
        "baseline_symmem_training": [], "optimized_symmem_training": [],
        # the hand-written TP pair on the Llama (KV groups, SwiGLU, untied head), DTensor on GPT
        "baseline_symmem_tp": ["--model", "llama"], "optimized_symmem_tp": ["--model", "llama"],
        "optimized_symmem_tp_pytorch": []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {script: tmp_path_factory.mktemp(script) / "results.jsonl" for script in RUNS}
    starts = {script: functools.partial(torchrun, FOLDER / f"{script}.py", results[script], *flags)
              for script, flags in RUNS.items()}
    sweeps, training = [s for s in RUNS if s in SWEPT], [s for s in RUNS if s not in SWEPT]
    # the sweeps alone, as they time calls; the training runs two in flight
    consoles = dict(zip(sweeps + training, [
        *finish_all([starts[s] for s in sweeps], in_flight=1),
        *finish_all([starts[s] for s in training])], strict=True))
    for script, flags in RUNS.items():
        if "--trace" in flags:
            assert "no trace written: a sweep has no training step" in consoles[script]
            assert not (results[script].parent / "traces").exists()
    return {script: only_record(results[script]) for script in RUNS}


def _data_parallel_run(rank: int, world: int, port: int, model: str, results: str) -> None:
    as_rank(rank, world, port)
    path = FOLDER / "baseline_symmem_training.py"
    sys.argv = [str(path), *TINY, "--results", results, "--model", model]
    common.run_main(load_recipe(path).main)


@pytest.fixture(scope="module")
def data_parallel(runs, tmp_path_factory):
    """model -> the data-parallel baseline's record on that model: the launch's where it trained
    it, else a run in 2 spawned processes (no torchrun launch added)."""
    found = {runs["baseline_symmem_training"]["model"]: runs["baseline_symmem_training"]}

    def of(model: str) -> dict:
        if model not in found:
            results = tmp_path_factory.mktemp(f"dp-{model}") / "results.jsonl"
            mp.spawn(functools.partial(run_then_leave, _data_parallel_run),
                     args=(2, common.free_port(), model, str(results)),
                     nprocs=2)
            found[model] = only_record(results)
        return found[model]
    return of


# what each sweep times by default: the all-to-all (08_moe's token exchange) through the process
# group only, symmetric memory having none
SWEPT = {"baseline_symmem_allreduce": ["all_reduce", "all_gather", "reduce_scatter", "sendrecv",
                                       "all_to_all"],
         "optimized_symmem_allreduce": ["all_reduce", "all_gather", "reduce_scatter", "sendrecv"]}


@pytest.mark.parametrize("script", ["baseline_symmem_allreduce", "optimized_symmem_allreduce"])
def test_a_sweep_records_every_op_and_size_checked_with_its_busbw(runs, script):
    rec = runs[script]
    assert rec["status"] == "ok" and "step_ms" not in rec  # a benchmark, no training fields
    assert rec.get("transport", "/dev/shm segment") == "/dev/shm segment"  # no GPU: not claimed
    assert [(row["op"], row["bytes"]) for row in rec["sweep"]] == [
        (op, size) for op in SWEPT[script] for size in (4096, 65536, 2**20)]
    # nccl-tests' bus factors at 2 ranks, as they print them: 2(N-1)/N, (N-1)/N, (N-1)/N, 1,
    # (N-1)/N
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "sendrecv": 1.0,
              "all_to_all": 0.5}
    for row in rec["sweep"]:
        assert row["busbw_gbps"] == pytest.approx(factor[row["op"]] * row["algbw_gbps"], rel=1e-3)
        # a call moves its bytes in its time: between a dial-up line and this host's memory
        assert 1e-5 < row["algbw_gbps"] < 100 and row["ms"] > 0
    by = {(row["op"], row["bytes"]): row for row in rec["sweep"]}
    # a call's fixed cost dominates 4 KB, not 1 MB: 256x the bytes in far less than 256x the time
    assert by["all_reduce", 2**20]["ms"] < 64 * by["all_reduce", 4096]["ms"]


def test_the_report_sets_the_two_sweeps_side_by_side(runs):
    text = results_table.render_report([runs["baseline_symmem_allreduce"],
                                        runs["optimized_symmem_allreduce"]],
                                       wide=True)  # every row names its scripts
    rows = [line for line in text.splitlines() if line.startswith("| all_reduce")]
    assert len(rows) == 3 and all("baseline_symmem_allreduce" in r and r.rstrip(" |").endswith("x")
                                  for r in rows)
    # the all-to-all, swept by the baseline alone: its figures shown, nothing to compare with
    swept = {row["bytes"]: row for row in runs["baseline_symmem_allreduce"]["sweep"]
             if row["op"] == "all_to_all"}
    rows = [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in text.splitlines() if line.startswith("| all_to_all")]
    assert [int(row[1].replace(",", "")) for row in rows] == [4096, 65536, 2**20]
    for row in rows:  # tabulate reprints the figures: compared as numbers, to half the last
        # printed digit (0.1655 prints 0.166), and a hair more for the float's own rounding
        base = swept[int(row[1].replace(",", ""))]
        assert row[4].startswith("baseline_symmem_allreduce") and row[8:] == ["", "", ""]
        assert float(row[5].replace(",", "")) == pytest.approx(base["ms"], abs=5.001e-4)
        assert float(row[6].replace(",", "")) == pytest.approx(base["busbw_gbps"], abs=5.001e-3)


def test_symmetric_memory_training_matches_the_baseline_with_half_the_optimizer_state(runs):
    base, rec = runs["baseline_symmem_training"], runs["optimized_symmem_training"]
    assert rec["status"] == "ok" and rec["baseline"] == "baseline_symmem_training"
    assert rec["transport"] == "/dev/shm segment"  # CPU ranks: the CUDA path is not claimed
    assert_within_its_tolerance(rec, base)
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], base["losses"], strict=True)) <= 1e-5
    assert rec["optim_mb"] == pytest.approx(base["optim_mb"] / 2, rel=0.01)
    assert rec["optim_mb"] == pytest.approx(rec["theory"]["optim_mb"], rel=0.01)
    assert rec["process_group_mb"] == 0  # all of it through the segment, counted there
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=1e-3)  # MB, 3 decimals
    assert rec["comm_mb"] == pytest.approx(base["comm_mb"] / 2, abs=1e-3)  # one shot of two
    assert base["comm_mb"] == pytest.approx(base["theory"]["comm_mb"], rel=1e-3)


def test_tensor_parallelism_trains_the_data_parallel_model_with_its_bytes_and_state(
        runs, data_parallel):
    base, by_hand = runs["baseline_symmem_tp"], runs["optimized_symmem_tp"]
    dtensor = runs["optimized_symmem_tp_pytorch"]
    assert base["model"] == by_hand["model"] == "llama" and dtensor["model"] == "gpt"
    for rec in (base, by_hand, dtensor):
        dp = data_parallel(rec["model"])  # the same model's data-parallel run
        assert rec["batch_size"] == 2 * dp["batch_size"]  # one global batch of N x 4 sequences
        assert rec["status"] == "ok" and rec["params"] == dp["params"]  # the unsplit model's
        assert_within_its_tolerance(rec, dp)  # the data-parallel model, step by step
        assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=2e-3)
        assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.05)
        assert rec["state_mb"] < 0.6 * dp["state_mb"]  # the blocks, most of it, halved
    assert_within_its_tolerance(by_hand, base)
    assert by_hand["baseline"] == dtensor["baseline"] == "baseline_symmem_tp"
    assert by_hand["transport"] == "/dev/shm segment" and base["overlap"] == 0
    assert 0 < by_hand["overlap"] <= 1  # some of the peers' arrival hidden under matmuls
    # through the segment, counted where it is read; the process group carries the replicated
    # parameters' gradients only (the Llama's embedding, untied head and RMSNorms), in one piece
    size = common.SIZES["tiny"]
    d = size.d_model
    replicated = 2 * size.vocab_size * d + d + size.n_layers * 2 * d
    assert by_hand["process_group_mb"] == pytest.approx(common.ring_allreduce_mb(4 * replicated, 2),
                                                        abs=1e-3)
    assert by_hand["comm_mb"] == pytest.approx(base["comm_mb"], abs=1e-3)
    assert dtensor["async_tp"] is False and "CUDA" in dtensor["async_tp_off"]  # said why
    kinds = dtensor["comm_mb_by_kind"]  # DTensor's own collectives, counted as they are issued
    assert kinds["all_gather_into_tensor float32"] == kinds["reduce_scatter_tensor float32"] > 0


@pytest.mark.parametrize("script, flags, hint", [
    ("optimized_symmem_allreduce", ["--sizes", "0"], "--sizes"),
    ("optimized_symmem_allreduce", ["--sizes", "4K,4098"], "multiple of 4"),
    ("baseline_symmem_allreduce", ["--sizes", "4Q"], "--sizes"),
    ("optimized_symmem_allreduce", ["--ops", "all_reduce,broadcast"], "--ops broadcast"),
])
def test_bad_input_exits_2_with_one_line(script, flags, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", flags, hint, tmp_path)


@pytest.mark.parametrize("script", ["baseline_symmem_tp", "optimized_symmem_tp",
                                    "optimized_symmem_tp_pytorch"])
def test_tensor_parallelism_skips_a_model_it_cannot_split(script, tmp_path):
    assert_skipped_with_why(FOLDER / f"{script}.py", ["--model", "resnet"],
                            "a ResNet has no attention heads", tmp_path)


@pytest.mark.parametrize("script", ["baseline_symmem_allreduce", "optimized_symmem_allreduce"])
def test_a_world_of_one_sweeps_all_but_the_send_it_has_no_peer_for(script, tmp_path):
    """One GPU (or `python script.py`): gloo cannot send a rank to itself, nor can NCCL."""
    results = tmp_path / "r.jsonl"
    run = subprocess.run([sys.executable, str(FOLDER / f"{script}.py"), "--sizes", "4K",
                          "--iters", "2", "--results", str(results)], cwd=common.ROOT,
                         capture_output=True, text=True, timeout=120, env=cpu_env())
    assert run.returncode == 0, run.stderr[-2000:]
    rec = only_record(results)
    assert [row["op"] for row in rec["sweep"]] == [op for op in SWEPT[script] if op != "sendrecv"]
