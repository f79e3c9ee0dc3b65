"""Launch tests: 03_fsdp under torchrun with CPU processes at `tiny`.

Each script launched once by torchrun (10-20 s of start-up each): the GPT under DDP and FULL_SHARD
(60 steps, so that a checkpointed run has room to be killed and resumed), FP8 with activation
checkpointing on the Llama at 4 ranks, and optimized_fsdp_checkpoint.py surviving a killed rank
(the GPT). The other runs, in spawned gloo processes that run one after another what torchrun
would (no launcher's start-up), shared through module-scoped fixtures: in a world of 2, the GPT in
the other strategy and wrap (8 steps, held to DDP's first 8) and a ResNet under FSDP and DDP,
then the README's "Use it in your trainer" lines on every tiny HuggingFace model of
tests/hf_models.py against DDP (three families, `sdpa` and `eager`, ranks seeded apart, and the
two with a feature some recipes do not implement) and on bf16 weights; in a world of 4, the
Llama under hybrid sharding (clipped by the global norm) and under DDP, checkpointing alone
(FP8 off), the hybrid run in two through a checkpoint and a resume, and the units on a
sub-group. In this process, FP8 never converting a head, tied or untied.
"""

import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import (
    TINY,
    as_rank,
    assert_bad_input_is_one_line,
    assert_skipped_with_why,
    assert_within_its_tolerance,
    finish,
    finish_all,
    load_recipe,
    only_record,
    readme_python_block,
    run_then_leave,
    torchrun,
)
from report import results_table

FOLDER = common.ROOT / "03_fsdp"
LONG = ["--steps", "58"]  # 60 steps with the 2 of warm-up
CLIP = ["--clip-grad-norm", "0.5"]  # under the tiny GPT's gradient norm (1.2 to 2.1): always clips
LLAMA = ["--model", "llama", *CLIP]  # at 4 ranks: the hybrid, its DDP, its checkpoints, FP8
HYBRID = [*LLAMA, "--hsdp", "2"]
RUNS = {  # name: (script, processes, flags)
    "ddp": ("baseline_fsdp", 2, LONG),
    "full_shard": ("optimized_fsdp", 2, LONG),
    # 8 steps: held to the first 8 of DDP's 60 (the same batches, no schedule on the steps)
    "shard_grad_op": ("optimized_fsdp", 2, ["--reshard-after-forward", "false"]),
    "root": ("optimized_fsdp", 2, ["--wrap", "root"]),
    "hybrid": ("optimized_fsdp", 4, HYBRID),
    "resnet": ("optimized_fsdp", 2, ["--model", "resnet"]),
}
DDP_OF = {  # the DDP run of the hybrid's and the ResNet's setups: the same batches, clipped alike
    "hybrid": ("baseline_fsdp", 4, LLAMA),
    "resnet": ("baseline_fsdp", 2, ["--model", "resnet"]),
}
CHECKPOINT = FOLDER / "optimized_fsdp_checkpoint.py"
# the FP8 + checkpointing run and checkpointing alone, the Llama at 4 processes, clipped as the
# hybrid run (8 steps each)
ABLATION = {"both": LLAMA, "checkpointing": [*LLAMA, "--no-fp8"]}
LAUNCHED = ["ddp", "full_shard"]  # by torchrun, with FP8's "both"
# the other runs, in a spawned world of their size: name -> (script, processes, flags)
SPAWNED = {**{name: run for name, run in RUNS.items() if name not in LAUNCHED},
           **{f"ddp_{name}": run for name, run in DDP_OF.items()},
           "checkpointing": ("optimized_fsdp_fp8", 4, ABLATION["checkpointing"])}


def run(rank: int, world: int, port: int, script: Path, results: str, flags: list[str]) -> None:
    """`script` as torchrun would run it on this rank of a spawned world, with a process group
    (and store) of its own."""
    as_rank(rank, world, port)
    sys.argv = [str(script), *TINY, "--results", results, *flags]
    common.run_main(load_recipe(script).main)


def run_spawned(rank: int, world: int, port: int, out: str) -> int:
    """Each run of SPAWNED at this world size in turn, from `port` on; the next port free."""
    mine = [(name, script, flags) for name, (script, nproc, flags) in SPAWNED.items()
            if nproc == world]
    for k, (name, script, flags) in enumerate(mine):
        run(rank, world, port + k, FOLDER / f"{script}.py", f"{out}/{name}.jsonl", flags)
    return port + len(mine)


def in_a_world_of_2(rank: int, world: int, port: int, out: str) -> None:
    """The spawned 2-rank runs, then the README's lines."""
    _readme_lines_against_ddp(rank, world, run_spawned(rank, world, port, out),
                              f"{out}/readme.pt")


def in_a_world_of_4(rank: int, world: int, port: int, out: str) -> None:
    """The spawned 4-rank runs; the hybrid run in two (4 steps saved after the 4th, into the
    default folder beside the results; what a save killed midway after the 8th leaves; the
    remaining 4 steps resumed from that folder, saving after the 6th); the units on ranks 0
    and 1."""
    port = run_spawned(rank, world, port, out)
    resumed = Path(out) / "resumed" / "results.jsonl"
    checkpoints = resumed.parent / "checkpoints"
    resumed.parent.mkdir(exist_ok=True)
    run(rank, world, port, CHECKPOINT, str(resumed),
        [*HYBRID, "--steps", "2", "--checkpoint-every", "4"])
    if rank == 0:  # before it joins the resumed run's group, which the others wait in
        (Path(out) / "saved.json").write_text(json.dumps(sorted(
            p.name for p in checkpoints.iterdir())))
        (checkpoints / ".step-000008.partial").mkdir()
    run(rank, world, port + 1, CHECKPOINT, str(resumed),
        [*HYBRID, "--checkpoint-every", "3", "--checkpoint-dir", str(checkpoints), "--resume"])
    _on_ranks_0_and_1(rank, world, port + 2, out)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> record of the torchrun launches: DDP, FULL_SHARD and FP8 with checkpointing."""
    results = {name: tmp_path_factory.mktemp(name) / "results.jsonl" for name in
               [*LAUNCHED, "both"]}
    finish_all([*(functools.partial(torchrun, FOLDER / f"{RUNS[name][0]}.py", results[name],
                                    *RUNS[name][2], nproc=RUNS[name][1]) for name in LAUNCHED),
                functools.partial(torchrun, FOLDER / "optimized_fsdp_fp8.py", results["both"],
                                  *ABLATION["both"], nproc=4)])
    return {name: only_record(path) for name, path in results.items()}


def spawned_world(world: int, worker, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"world{world}")
    mp.spawn(functools.partial(run_then_leave, worker),
             args=(world, common.free_port(block=11), str(out)), nprocs=world)
    return out


@pytest.fixture(scope="module")
def world_of_2(tmp_path_factory):
    return spawned_world(2, in_a_world_of_2, tmp_path_factory)


@pytest.fixture(scope="module")
def world_of_4(tmp_path_factory):
    return spawned_world(4, in_a_world_of_4, tmp_path_factory)


def record_of(name: str, request: pytest.FixtureRequest) -> dict:
    """RUNS' `name`'s record, from the one fixture that runs it (a test of one run waits for
    that fixture alone)."""
    if name in LAUNCHED:
        return request.getfixturevalue("launched")[name]
    return only_record(request.getfixturevalue(f"world_of_{RUNS[name][1]}") / f"{name}.jsonl")


@pytest.fixture(scope="module")
def runs(request):
    return {name: record_of(name, request) for name in RUNS}


@pytest.fixture(scope="module")
def ddp_of(world_of_2, world_of_4):
    return {name: only_record({2: world_of_2, 4: world_of_4}[nproc] / f"ddp_{name}.jsonl")
            for name, (_, nproc, _) in DDP_OF.items()}


def assert_records_state_and_bytes_as_its_theory_predicts(rec: dict) -> None:
    # exact: counted from the tensors and from what was handed to the collectives
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.01)
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    assert rec["peak_mem_mb"] > rec["state_mb"]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_run_records_state_and_bytes_as_its_theory_predicts(request, name):
    rec = record_of(name, request)
    assert rec["status"] == "ok" and rec["world_size"] == RUNS[name][1]
    assert len(rec["losses"]) == (60 if LONG[1] in RUNS[name][2] else 8)
    assert all(math.isfinite(x) for x in rec["losses"])
    assert_records_state_and_bytes_as_its_theory_predicts(rec)


@pytest.mark.parametrize("name", ["full_shard", "shard_grad_op", "root"])
def test_fsdp_trains_like_ddp_to_float_rounding(runs, name):
    ddp, fsdp = runs["ddp"], runs[name]
    ddp = {**ddp, "losses": ddp["losses"][:len(fsdp["losses"])]}  # its first 8 for the 8-step
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
        assert rec["strategy"] == "hybrid_full_shard" and rec["model"] == "llama"
        assert rec["state_mb"] == pytest.approx(ddp["state_mb"] / 2, rel=0.01)  # shards of 2


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
@pytest.fixture(scope="module")
def resumed(world_of_4):
    """The hybrid Llama's run in two (in_a_world_of_4): both records, and the checkpoints the
    first left."""
    return (common.load_results(world_of_4 / "resumed" / "results.jsonl"),
            json.loads((world_of_4 / "saved.json").read_text()))


def test_a_checkpointing_run_records_its_saves_and_trains_like_optimized_fsdp(runs, ddp_of,
                                                                             resumed):
    (first, again), saved = resumed
    assert saved == ["step-000004"]  # renamed into place: no partial folder left
    assert first["status"] == "ok" and first["baseline"] == "baseline_fsdp"
    assert first["model"] == "llama" and first["mesh"] == [2, 2]
    assert first["resumed_from"] == 0 and first["checkpoint_every"] == 4
    assert len(first["checkpoint_ms"]) == 1 and first["checkpoint_ms"][0] > 0
    assert first["strategy"] == runs["hybrid"]["strategy"] == "hybrid_full_shard"
    assert_records_state_and_bytes_as_its_theory_predicts(first)  # no save in the counted step
    assert first["loss_tolerance"] == runs["hybrid"]["loss_tolerance"]
    assert results_table.max_loss_diff(first["losses"], ddp_of["hybrid"]["losses"][:4]) <= \
        first["loss_tolerance"]  # against DDP, as its report row is
    assert again["checkpoint_every"] == 3 and len(again["checkpoint_ms"]) == 1  # after the 6th


def test_k_steps_then_a_resumed_run_give_the_losses_of_one_uninterrupted_run(runs, resumed):
    """Bit for bit up to the save; resumed, to float rounding: restored onto a (2, 2) mesh, a
    hybrid run's last step differed in the 7th digit (the GPT's 1-D run below: bit for bit)."""
    (first, again), _ = resumed
    uninterrupted = runs["hybrid"]["losses"]
    assert first["losses"] == uninterrupted[:4]
    assert again["resumed_from"] == 4
    assert max(abs(a - b) / b for a, b in zip(again["losses"], uninterrupted[4:], strict=True)) \
        <= 1e-5


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


@pytest.mark.parametrize("shape, converted", [((64, 192), True), ((64, 24), False),
                                              ((40, 64), False)])
def test_fp8_takes_linears_of_multiples_of_16(shape, converted):
    linear = torch.nn.Linear(*shape)
    assert fp8_recipe.fp8_eligible(linear, set()) == converted
    assert not fp8_recipe.fp8_eligible(linear, {id(linear.weight)})  # kept whole, by identity


@pytest.mark.parametrize("name, keep_head", [("gpt", True), ("gpt", False), ("llama", True)])
def test_fp8_never_converts_the_head_and_a_tied_head_stays_tied(name, keep_head):
    """The GPT's head is tied to the embedding (kept even when not named: torchao's new
    Parameter would untie it), the Llama's lm_head is not; neither is found by its name."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    size = common.SIZES["tiny"]
    model = common.GPT(size, 32) if name == "gpt" else common.Llama(size)
    head, embedding = common.output_head(model), common.input_embedding(model)
    tied = name == "gpt"
    assert (head.weight is embedding.weight) == tied
    converted, _ = fp8_recipe.convert_to_fp8(model, [head] if keep_head else [], 2)
    assert common.output_head(model) is head and type(head) is torch.nn.Linear
    assert (head.weight is common.input_embedding(model).weight) == tied
    assert converted == [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == size.n_layers * {"gpt": 4, "llama": 7}[name]


def test_fp8_would_convert_an_untied_head_of_float8_shapes_not_kept():
    """What `keep` is for: the Llama's lm_head (vocab x d_model, multiples of 16) is otherwise
    a float8 linear like any other."""
    pytest.importorskip("torchao")
    model = common.Llama(common.SIZES["tiny"])
    converted, _ = fp8_recipe.convert_to_fp8(model, [], 2)
    assert "lm_head" in converted


def test_fp8_says_in_its_record_when_the_world_gathers_no_weight_in_float8():
    """At 3 ranks most of the tiny GPT's float8 weights (64 and 256 rows) split unevenly: FSDP
    gathers them all in --dtype, and the run's `note` (its summary line, the report) says why."""
    rows = {"blocks.0.attn.qkv": 192, "blocks.0.attn.proj": 64, "blocks.0.fc": 256}
    assert fp8_recipe.float8_gather_note(rows, 2) is None
    assert fp8_recipe.float8_gather_note(rows, 4) is None
    assert fp8_recipe.float8_gather_note(rows, 3, "fp32") == (
        "no weight gathered in float8: 2 of 3 float8 weights (e.g. blocks.0.attn.proj, 64 rows) "
        "do not split evenly over 3 ranks (torchao pads no float8 shard), so all travel in "
        "fp32; a world that divides 64 gathers float8")
    assert fp8_recipe.float8_gather_note({"fc": 96, "proj": 64}, 3).startswith(
        "no weight gathered in float8: 1 of 2 float8 weights (e.g. proj, 64 rows)")
    assert fp8_recipe.float8_gather_note({}, 3) is None  # --no-fp8: nothing converted
    pytest.importorskip("torchao")
    for world, in_float8 in [(2, True), (3, False)]:  # the same rule decides what is gathered
        model = common.GPT(common.SIZES["tiny"], 32)
        converted, gathered = fp8_recipe.convert_to_fp8(model, [common.output_head(model)], world)
        note = fp8_recipe.float8_gather_note(fp8_recipe.rows_of(model, converted), world)
        assert gathered is in_float8 and (note is None) == in_float8


@pytest.fixture(scope="module")
def ablation(launched, world_of_4):
    """The FP8 + checkpointing run (launched) and checkpointing alone (in_a_world_of_4)."""
    return {"both": launched["both"],
            "checkpointing": only_record(world_of_4 / "checkpointing.jsonl")}


def test_checkpointing_alone_keeps_fsdps_losses_and_cuts_the_activations(runs, ablation):
    rec, fsdp = ablation["checkpointing"], runs["hybrid"]  # the same Llama, batches and clip
    assert rec["checkpointing"] and rec["fp8"] is None and rec["baseline"] == "optimized_fsdp"
    assert rec["model"] == fsdp["model"] == "llama" and rec["world_size"] == fsdp["world_size"]
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], fsdp["losses"], strict=True)) <= 1e-5
    assert rec["memory"]["activations"] < 0.5 * fsdp["memory"]["activations"]
    assert rec["theory"]["activation_mb"] < rec["theory"]["activation_mb_without_checkpointing"]
    assert rec["memory"]["activations"] == pytest.approx(rec["theory"]["activation_mb"], rel=0.3)
    assert fsdp["memory"]["activations"] == pytest.approx(
        rec["theory"]["activation_mb_without_checkpointing"], rel=0.3)


def test_fp8_trains_within_its_tolerance_and_gathers_fewer_bytes(ablation):
    both, exact = ablation["both"], ablation["checkpointing"]
    assert both["fp8"]["scaling"] == "tensorwise" and len(both["fp8"]["layers"]) == 14
    assert not any("lm_head" in name for name in both["fp8"]["layers"])  # the untied head
    assert_within_its_tolerance(both, exact)  # FSDP's losses (the test above)
    assert results_table.max_loss_diff(both["losses"], exact["losses"]) > 0  # it did cast to float8
    assert both["gathered_mb"]["uint8"] > 0  # float8 weights travel as bytes
    assert sum(both["gathered_mb"].values()) < 0.6 * sum(exact["gathered_mb"].values())


def test_fp8_skips_a_model_without_linears_to_convert(tmp_path):
    assert_skipped_with_why(FOLDER / "optimized_fsdp_fp8.py", ["--model", "resnet"],
                            "a ResNet has no float8 linears", tmp_path)


# --- The units in a trainer of one's own, in spawned gloo processes ----------------------------


def _join(rank: int, world: int, port: int) -> None:
    as_rank(rank, world, port)
    common.setup(timeout_s=60)


def _llama_batches(rank: int, world: int, steps: int) -> list:
    size = common.SIZES["tiny"]
    batches = []
    for step in range(steps):
        tokens = common.global_token_batch(size, size.seq_len, world * size.batch_size, step, 0)
        batches.append((common.rank_slice(tokens[:, :-1], rank, world),
                        common.rank_slice(tokens[:, 1:], rank, world)))
    return batches


def _ddp_losses(batches: list, group=None, seed: int = 0) -> list[float]:
    """The reference: DDP (from the group's first rank's weights) with the snippet's AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(common.Llama(common.SIZES["tiny"]),
                                                      process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _readme_lines_against_ddp(rank: int, world: int, port: int, out_file: str) -> None:
    """A trainer of one's own runs the README's lines as they are on each of
    hf_models.readme_models(), its ranks seeded differently: beside PyTorch's DDP on the same
    model and global batch, or, in bf16, for a step that shows which dtypes it keeps; rank 0
    saves what it found."""
    import hf_models  # here: `transformers` costs every process that imports it seconds

    torch.set_num_threads(1)  # 2 processes on 2 cores: more threads only fight
    _join(rank, world, port)
    snippet = readme_python_block(FOLDER / "README.md")
    recipe = vars(load_recipe(FOLDER / "optimized_fsdp.py"))
    batches = hf_models.token_batches(4, rank, world)
    found = {}
    for name, model_args in hf_models.readme_models().items():
        torch.manual_seed(rank)  # ranks seeded apart: shard starts them from rank 0's weights
        model = hf_models.tiny_model(**model_args)
        if model_args.get("dtype") == torch.bfloat16:  # sharded, gathered, stepped in bf16
            namespace = {**recipe, "model": model, "batches": batches[:1]}
            exec(snippet, namespace)
            found[name] = {str(t.dtype) for p in model.parameters() for t in (p, p.grad)}
            continue
        ddp = hf_models.ddp_losses(model, batches)  # on a copy: `model` stays untrained
        seeded_apart = hf_models.seeded_apart(model)
        namespace = {**recipe, "model": model, "batches": batches}
        exec(snippet, namespace)
        found[name] = {"readme": _group_mean(namespace["losses"]), "ddp": ddp,
                       "seeded_apart": seeded_apart}
    if rank == 0:
        torch.save(found, out_file)
    dist.destroy_process_group()


def _group_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the ranks: what hf_models.ddp_losses returns."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def test_the_readmes_lines_shard_every_model_seeded_apart_train_like_ddp_and_keep_bf16(
        world_of_2):
    snippet = readme_python_block(FOLDER / "README.md")
    assert "shard(model, blocks, mesh)" in snippet and "list(model.model.layers)" in snippet
    found = torch.load(world_of_2 / "readme.pt")  # in_a_world_of_2
    assert {name.split("-")[0] for name in found} == {"llama", "qwen2", "mistral", "fused",
                                                        "rope scaling"}
    for name, run in found.items():
        if name.endswith("bf16"):
            assert run == {"torch.bfloat16"}, name
            continue
        readme, ddp = run["readme"], run["ddp"]
        assert run["seeded_apart"], name
        assert max(abs(a - b) / b for a, b in zip(readme, ddp, strict=True)) <= 1e-5, name
        assert readme[-1] < readme[0], name
    assert sum(name.endswith("bf16") for name in found) == 3 and len(found) == 11


def _on_ranks_0_and_1(rank: int, world: int, port: int, out: str) -> None:
    """The units on a sub-group, ranks {0, 1} of the world, each beside DDP on the pair: ranks 0
    and 1 save their losses."""
    _join(rank, world, port)
    pair = dist.new_group([0, 1])
    if rank < 2:  # the other ranks idle: nothing of the units may wait for them
        recipe = load_recipe(FOLDER / "optimized_fsdp.py")
        batches = _llama_batches(rank, 2, 3)
        torch.manual_seed(rank)
        model = common.Llama(common.SIZES["tiny"])
        blocks = common.transformer_blocks(model)
        mesh = recipe.shard(model, blocks, pair)
        sharded_over = dist.get_process_group_ranks(mesh.get_group())
        recipe.prefetch_one_ahead(blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for inputs, targets in batches:
            opt.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        (Path(out) / f"sub-group-rank{rank}.json").write_text(json.dumps(
            {"sharded_over": sharded_over, "losses": losses,
             "ddp": _ddp_losses(batches, pair, seed=rank)}))
    dist.barrier()
    dist.destroy_process_group()


def test_shard_on_a_sub_group_trains_like_ddp_on_it(world_of_4):
    for rank in (0, 1):  # of 4 (in_a_world_of_4)
        found = json.loads((world_of_4 / f"sub-group-rank{rank}.json").read_text())
        assert found["sharded_over"] == [0, 1]
        assert max(abs(a - b) / b for a, b in zip(found["losses"], found["ddp"], strict=True)) \
            <= 1e-5
