"""Launch tests: the 02_compression scripts under torchrun with CPU processes at `tiny`.

Each script once under torchrun (10-20 s of start-up each), two in flight: the baseline, INT8,
the hand-written PowerSGD and DiLoCo on the Llama at 2 processes (held to the Llama's
baseline), and PyTorch's hook (optimized_compression_powersgd_pytorch) on the GPT. The other
runs, in spawned gloo processes that run one after another what torchrun would (no launcher's
start-up): in a world of 2, PowerSGD's `--long-run` on the Llama with the steps given (its
record's tolerance kind), the hand-written PowerSGD on the GPT compressing every matrix beside
PyTorch's hook, and PyTorch's hook where it cannot run; in a world of 3, both hand-written hooks
with several buckets. All of it shared through one module-scoped fixture. PowerSGD runs at
rank 8, the hand-written default's share of the model width (32 of `small`'s 256, 8 of `tiny`'s
64): the defaults (32, and PyTorch's script's 64) would compress nothing at `tiny`, which one
more run, a world of one at the hand-written default (in this process), says in its log and its
record.
"""

import functools
import math
import os
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

import common
import helpers
from helpers import (
    LAUNCH_TIMEOUT,
    TINY,
    as_rank,
    assert_bad_input_is_one_line,
    assert_within_its_tolerance,
    finish,
    finish_all,
    load_recipe,
    only_record,
    run_then_leave,
    torchrun,
    world_of_one,
)
from report import results_table

FOLDER = common.ROOT / "02_compression"
POWERSGD = load_recipe(FOLDER / "optimized_compression_powersgd.py")
SEVERAL_BUCKETS = ["--bucket-mb", "0.05"]  # tiny's 0.4 MB of gradients in 7 buckets
# PowerSGD: 2 plain steps, then 2 compressed before the timed ones: the same 8 steps, 4 untimed
WARMUP = ["--warmup", "4", "--steps", "4"]
RANK = [*WARMUP, "--rank", "8"]
EVERY_MATRIX = [*RANK, "--uncompressed"]  # as PyTorch's hook, which has no per-tensor choice
LLAMA = ["--model", "llama"]
RUNS = {  # name: (script, processes, flags); the first run of each script is its launch
    "baseline": ("baseline_compression", 2, [*WARMUP, *LLAMA]),
    "int8": ("optimized_compression_int8", 2, [*WARMUP, *LLAMA]),
    "powersgd": ("optimized_compression_powersgd", 2, [*RANK, *LLAMA]),
    "powersgd_torch": ("optimized_compression_powersgd_pytorch", 2, RANK),
    "diloco": ("optimized_compression_diloco", 2, [*WARMUP, *LLAMA, "--sync-every", "2"]),
    "powersgd_long": ("optimized_compression_powersgd", 2, [*RANK, *LLAMA, "--long-run"]),
    "powersgd_every_matrix": ("optimized_compression_powersgd", 2, EVERY_MATRIX),
    "powersgd_torch_buckets": ("optimized_compression_powersgd_pytorch", 2,
                               [*RANK, *SEVERAL_BUCKETS]),
    "int8_3ranks_buckets": ("optimized_compression_int8", 3, SEVERAL_BUCKETS),
    "powersgd_3ranks_buckets": ("optimized_compression_powersgd", 3, [*RANK, *SEVERAL_BUCKETS]),
}


def run_in_turn(rank: int, world: int, port: int, runs: list[tuple[str, str, list[str]]]) -> None:
    """A spawned rank: each of `runs` (script, results file, flags) in turn, as torchrun would
    run it on this rank, each with a process group (and store) of its own."""
    as_rank(rank, world)
    for k, (script, results, flags) in enumerate(runs):
        os.environ["MASTER_PORT"] = str(port + k)
        sys.argv = [str(FOLDER / f"{script}.py"), *TINY, "--results", results, *flags]
        common.run_main(load_recipe(FOLDER / f"{script}.py").main)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {name: tmp_path_factory.mktemp(name) / "results.jsonl" for name in RUNS}
    launched, by_world = set(), {}
    for name, (script, nproc, flags) in RUNS.items():
        if script not in launched:
            launched.add(script)
            by_world.setdefault("torchrun", []).append(functools.partial(
                torchrun, FOLDER / f"{script}.py", results[name], *flags, nproc=nproc))
        else:
            by_world.setdefault(nproc, []).append((script, str(results[name]), flags))
    finish_all(by_world.pop("torchrun"))
    for world, spawned in by_world.items():
        mp.spawn(functools.partial(run_then_leave, run_in_turn),
                 args=(world, common.free_port(block=len(spawned)), spawned), nprocs=world)
    return {name: only_record(results[name]) for name in RUNS}


@pytest.mark.parametrize("name", [n for n in RUNS if n != "powersgd_torch_buckets"])
def test_each_run_records_sane_figures_and_the_bytes_its_theory_predicts(runs, name):
    rec = runs[name]
    script, nproc, _ = RUNS[name]
    assert (rec["status"], rec["script"], rec["folder"]) == ("ok", script, "02_compression")
    assert (rec["world_size"], rec["backend"], rec["link"]) == (nproc, "gloo", None)
    assert len(rec["losses"]) == 8 and all(math.isfinite(x) for x in rec["losses"])
    assert rec["losses"][-1] < rec["losses"][0]
    assert rec["model"] == ("llama" if "--model" in RUNS[name][2] else "gpt")
    assert rec["params"] == (helpers.llama_param_count(common.SIZES["tiny"]) if rec["model"] ==
                             "llama" else helpers.gpt_param_count(common.SIZES["tiny"], 32))
    # int8 pads every bucket to whole blocks per rank; PowerSGD and fp32 send exact shapes
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"],
                                           rel=0.05 if "int8" in name else 1e-3)
    if "compression" in rec["theory"]:
        assert rec["compression"] == pytest.approx(rec["theory"]["compression"], rel=0.05)


def test_diloco_sends_ddps_bytes_once_in_h_steps_and_ends_near_ddps_loss(runs):
    base, rec = runs["baseline"], runs["diloco"]
    assert rec["baseline"] == "baseline_compression"
    assert rec["exchanges_timed"] == rec["outer_steps"] - 2 == 2  # steps 6 and 8 of 5..8
    assert base["comm_mb"] / rec["comm_mb"] == pytest.approx(2, rel=0.01)  # H 2; MB to 3 places
    assert rec["largest_exchange_mb"] == pytest.approx(base["comm_mb"], rel=0.01)
    assert "loss_tolerance_final_rel" not in rec  # a short run: its losses shown, not judged
    assert abs(rec["losses"][-1] / base["losses"][-1] - 1) < 0.05  # four syncs in 8 steps


def test_int8_sends_a_quarter_and_trains_like_fp32(runs):
    base, rec = runs["baseline"], runs["int8"]
    assert base["comm_mb"] / rec["comm_mb"] >= 3.8
    assert_within_its_tolerance(rec, base)


def test_powersgd_with_the_llamas_embedding_and_head_sent_whole_holds_its_tolerance(runs):
    base, rec = runs["baseline"], runs["powersgd"]
    assert rec["uncompressed"] == ["model.embed_tokens.weight", "lm_head.weight"]  # untied
    assert rec["start_iter"] == 2  # --warmup 4
    assert_within_its_tolerance(rec, base)
    every_matrix = POWERSGD.compression_theory(common.Llama(common.SIZES["tiny"]), 8, [])
    assert rec["compression"] > 2 and rec["theory"]["compression"] < every_matrix


def test_powersgd_records_how_many_matrices_it_compressed(runs):
    layers = common.SIZES["tiny"].n_layers
    # the Llama's 7 matrices a layer (its embedding and head sent whole); the GPT's 4 a block
    # and its two embeddings, the token one tied to the head (PyTorch's hook: every matrix too)
    for name, matrices in [("powersgd", 7 * layers), ("powersgd_every_matrix", 4 * layers + 2),
                           ("powersgd_torch", 4 * layers + 2)]:
        rec = runs[name]
        assert rec["compressed_matrices"] == matrices, name
        assert "compressed_matrices_reason" not in rec, name


def test_powersgd_at_a_rank_too_high_for_the_model_says_so_once_and_in_its_record(tmp_path):
    """The default rank 32 at `tiny` (hidden size 64, widest matrix 192 x 64): nothing is
    compressed; a world of one, whose DDP still calls the hook."""
    results, script = tmp_path / "results.jsonl", FOLDER / "optimized_compression_powersgd.py"
    printed = world_of_one(script, *TINY, *LLAMA, "--warmup", "4", "--steps", "1", "--results",
                           str(results))
    rec = only_record(results)
    said = POWERSGD.no_matrix_compressed(32)
    assert (rec["status"], rec["compressed_matrices"]) == ("ok", 0)
    assert rec["compressed_matrices_reason"] == said
    assert printed.splitlines().count(said) == 1


def test_powersgds_long_run_states_a_final_loss_tolerance_instead_of_a_per_step_one(runs):
    base, rec, short = runs["baseline"], runs["powersgd_long"], runs["powersgd"]
    assert rec["variant"] == "--rank 8 --long-run"  # its row's name, apart from the 25-step one
    assert (rec["warmup"], rec["steps"]) == (4, 4)  # given on the command line: they win
    assert rec["loss_tolerance"] is None
    assert rec["loss_tolerance_final_rel"] == POWERSGD.FINAL_LOSS_TOLERANCE == 0.05
    assert "loss_tolerance_final_rel" not in short and short["loss_tolerance"] == 0.2
    assert rec["losses"] == short["losses"]  # the flag changes the steps and the judging only
    assert not results_table.over_tolerance(rec, base)


def test_hand_written_powersgd_gives_pytorchs_losses_and_bytes(runs):
    hand, torch_hook = runs["powersgd_every_matrix"], runs["powersgd_torch"]
    assert (hand["impl"], torch_hook["impl"]) == ("hand", "torch")
    assert hand["uncompressed"] == torch_hook["uncompressed"] == []
    assert results_table.max_loss_diff(hand["losses"], torch_hook["losses"]) <= 1e-5
    assert hand["comm_mb"] == pytest.approx(torch_hook["comm_mb"], rel=1e-6)
    assert hand["collectives_per_step"] == 2 and torch_hook["collectives_per_step"] == 3


@pytest.mark.parametrize("name", ["int8_3ranks_buckets", "powersgd_3ranks_buckets"])
def test_hand_written_hooks_run_several_buckets_on_gloo_at_an_odd_world_size(runs, name):
    rec = runs[name]
    assert rec["collectives_per_step"] == 2 * 7


def test_pytorchs_hook_with_several_buckets_on_gloo_is_skipped_with_the_reason(runs):
    rec = runs["powersgd_torch_buckets"]
    assert rec["status"] == "skipped" and "several buckets" in rec["reason"]
    assert "--bucket-mb" in rec["reason"] and "optimized_compression_powersgd.py" in rec["reason"]


def test_srun_without_torchrun_builds_the_same_two_rank_world(runs, tmp_path):
    """Two plain `python` tasks with the variables srun sets: the same run as torchrun's."""
    results = tmp_path / "results.jsonl"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                       "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env.update(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_NODEID="0",
               SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(common.free_port()),
               OMP_NUM_THREADS="1")
    tasks = [subprocess.Popen([sys.executable, str(FOLDER / "baseline_compression.py"), *TINY,
                               *WARMUP, *LLAMA, "--results", str(results)], cwd=common.ROOT,
                              env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    for task in tasks:
        finish(task)
    rec = only_record(results)
    assert (rec["status"], rec["world_size"], rec["nnodes"]) == ("ok", 2, 1)
    assert rec["losses"] == runs["baseline"]["losses"]


@pytest.mark.parametrize("script, flags, hint", [
    ("optimized_compression_powersgd", ["--rank", "0"], "--rank"),
    ("optimized_compression_powersgd", ["--start-iter", "1"], "--start-iter"),
    ("optimized_compression_powersgd", ["--start-iter", "5", "--warmup", "5"], "--start-iter"),
    ("optimized_compression_powersgd", ["--warmup", "3"], "--warmup"),
    ("optimized_compression_powersgd_pytorch", ["--uncompressed", "tok_emb.weight"],
     "--uncompressed"),  # PyTorch's hook has no per-tensor choice
    ("optimized_compression_powersgd_pytorch", ["--warmup", "3"], "--warmup"),
    ("optimized_compression_int8", ["--start-iter", "4", "--warmup", "3"], "--start-iter"),
    ("optimized_compression_int8", ["--block", "3"], "--block"),
])
def test_bad_input_exits_2_with_one_line(script, flags, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", flags, hint, tmp_path)


def test_a_rate_tc_does_not_accept_is_one_line():
    run = subprocess.run(["make", "--no-print-directory", "compression", "LINK=fast",
                          f"PYTHON={sys.executable}"],
                         cwd=common.ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert run.returncode != 0
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and "LINK=fast" in lines[0], lines
