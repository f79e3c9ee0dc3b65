"""Launch tests: every 01_ddp script under torchrun with 2 CPU processes at `tiny`.

Each launch costs 10-20 s of start-up on a 2-core machine, so every script runs once (a
module-scoped fixture, two launches in flight) and the assertions share those runs; the
attention pair runs the Llama. The other runs skip the launcher's start-up: the worlds of one
(`python script.py`) run in this process, and accumulation with small buckets runs in the 2
spawned gloo processes that then run the README's "Use it in your trainer" lines as they are, on
every tiny HuggingFace model of tests/hf_models.py (three families, sdpa and eager, bf16, and the
two with a feature some recipes do not implement) against PyTorch's DDP.
"""

import copy
import functools
import json
import math
import os
import sys

import hf_models
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
import helpers
from helpers import TINY as STEPS
from helpers import (
    as_rank,
    assert_bad_input_is_one_line,
    assert_skipped_with_why,
    assert_within_its_tolerance,
    finish_all,
    load_recipe,
    only_record,
    readme_python_block,
    run_then_leave,
    world_of_one,
)
from helpers import torchrun as torchrun_script
from report import results_table, traces

DDP = common.ROOT / "01_ddp"
LLAMA = ["--model", "llama"]
FLAGS = {"baseline_ddp_flash": LLAMA, "optimized_ddp_flash": LLAMA}  # the others: the GPT


def torchrun(script, results, *flags, **kwargs):
    return torchrun_script(DDP / script, results, *flags, **kwargs)


def node(rank: int, port: int, script, results, *flags):
    """Node `rank` of two torchrun invocations of one process each, rendezvous on 127.0.0.1."""
    return torchrun(script, results, *flags, nproc=1,
                    extra_torchrun=("--nnodes=2", f"--node_rank={rank}",
                                    "--master_addr=127.0.0.1", f"--master_port={port}"))


TWO_NODES = {"baseline_ddp"}  # launched as two nodes of one process: the same world of 2
SCRIPTS = ["baseline_ddp", "optimized_ddp", "baseline_ddp_flash", "optimized_ddp_flash"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """script name -> (record, console output) for each 01_ddp script at 2 processes (the
    baseline as two nodes of one, which every comparison with it then covers too: node 0's
    console, as it holds rank 0)."""
    results = {script: tmp_path_factory.mktemp(script) / "results.jsonl" for script in SCRIPTS}
    starts, port = {}, common.free_port()
    for script in SCRIPTS:
        args = (f"{script}.py", results[script], *FLAGS.get(script, []))
        if script in TWO_NODES:  # both nodes in flight together, node 0 first
            starts.update({(script, rank): functools.partial(node, rank, port, *args)
                           for rank in (0, 1)})
        else:
            starts[script, 0] = functools.partial(torchrun, *args)
    consoles = dict(zip(starts, finish_all(list(starts.values())), strict=True))
    return {script: (only_record(results[script]), consoles[script, 0]) for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_records_a_sane_two_rank_run(runs, script):
    rec, console = runs[script]
    assert rec["status"] == "ok" and rec["script"] == script and rec["folder"] == "01_ddp"
    nnodes = 2 if script in TWO_NODES else 1
    assert (rec["world_size"], rec["nnodes"], rec["backend"], rec["device"]) == (2, nnodes,
                                                                                "gloo", "cpu")
    assert len(rec["losses"]) == 8 and all(math.isfinite(x) for x in rec["losses"])
    assert 0 < rec["step_ms"] <= rec["step_ms_p90"]
    assert rec["tokens_per_s"] > 0
    # peak live tensor bytes in the last warm-up step, split by kind; RSS (PyTorch too) beside
    assert rec["memory"]["params"] == pytest.approx(rec["params"] * 4 / 2**20, rel=0.01)
    assert rec["peak_mem_mb"] == pytest.approx(sum(rec["memory"].values()), abs=0.1)
    assert rec["peak_rss_mb"] > rec["peak_mem_mb"]
    if script in FLAGS:
        assert rec["model"] == "llama"
        assert rec["params"] == helpers.llama_param_count(common.SIZES["tiny"])
    else:
        assert rec["model"] == "gpt"
        assert rec["params"] == helpers.gpt_param_count(common.SIZES["tiny"], 32)
    # AdamW after a step: params, grads and two moments, all fp32
    assert rec["state_mb"] == pytest.approx(4 * rec["params"] * 4 / 2**20, rel=0.01)
    # what was counted on the wire matches the ring all-reduce formula
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    assert "step    8/8" in console and f"{script}: " in console


def test_baseline_all_reduces_every_parameter_tensor_and_ddp_buckets_them(runs):
    baseline, optimized = runs["baseline_ddp"][0], runs["optimized_ddp"][0]
    tensors = 4 + 12 * common.SIZES["tiny"].n_layers  # embeddings, final norm, 12 per block
    assert baseline["collectives_per_step"] == tensors
    assert optimized["collectives_per_step"] == 1  # the whole tiny model fits in one bucket


def test_ddp_pair_losses_match_to_float_rounding(runs):
    optimized, base = runs["optimized_ddp"][0], runs["baseline_ddp"][0]
    assert_within_its_tolerance(optimized, base)
    assert results_table.max_loss_diff(optimized["losses"], base["losses"]) <= 1e-5


def test_attention_pair_losses_match_within_stated_tolerance(runs):
    optimized = runs["optimized_ddp_flash"][0]
    assert_within_its_tolerance(optimized, runs["baseline_ddp_flash"][0])
    assert optimized["loss_tolerance"] == 1e-3
    assert runs["baseline_ddp_flash"][0]["theory"]["attn_saved_mb"] > \
        optimized["theory"]["attn_saved_mb"]


def test_attention_pair_wraps_ddp_alike_so_it_differs_in_the_attention_alone(runs):
    base, optimized = runs["baseline_ddp_flash"][0], runs["optimized_ddp_flash"][0]
    size = common.SIZES["tiny"]
    d, kv = size.d_model, size.n_kv_heads * size.d_model // size.n_heads
    # one Llama decoder layer's gradients: q, o; k, v for the KV heads; gate, up, down; 2 norms
    block_mb = (2 * d * d + 2 * d * kv + 3 * d * common.llama_ffn_dim(d) + 2 * d) * 4 / 2**20
    assert base["bucket_mb"] == optimized["bucket_mb"] == round(block_mb, 2)
    assert base["collectives_per_step"] == optimized["collectives_per_step"] > 1


def test_accumulation_with_small_buckets_trains_like_the_full_batch(runs, spawned):
    rec = only_record(spawned / "accum.jsonl")  # run in the README's spawned world of 2
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["accum"] == 2
    assert results_table.max_loss_diff(rec["losses"], runs["baseline_ddp"][0]["losses"]) <= 1e-4
    assert rec["theory"]["comm_mb_without_no_sync"] == pytest.approx(2 * rec["comm_mb"],
                                                                     rel=1e-3)
    # 0.4 MB of gradients in 0.05 MiB buckets: the buckets DDP rebuilt and sends, not its one
    # provisional bucket; fewer than bytes/cap because it never splits a tensor.
    assert 1 < rec["collectives_per_step"] <= rec["theory"]["collectives"]
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)


def test_two_ranks_train_like_one_rank_with_twice_the_batch(runs, tmp_path):
    """Plain `python script.py` (a world of one) with batch 2b against 2 ranks with batch b;
    its --trace shows the baseline's one all-reduce per gradient tensor, and report/traces.py's
    breakdown of each traced step adds up to it."""
    results = tmp_path / "results.jsonl"
    world_of_one(DDP / "baseline_ddp.py", *STEPS, "--results", str(results), "--trace",
                 "--warmup", "3", "--steps", "5",  # the same 8 batches, 3 untimed
                 "--batch-size", str(2 * common.SIZES["tiny"].batch_size))
    rec = only_record(results)
    assert rec["world_size"] == 1 and rec["comm_mb"] == 0
    assert results_table.max_loss_diff(rec["losses"], runs["baseline_ddp"][0]["losses"]) <= 1e-4
    assert rec["variant"] == "--batch-size 8"  # another workload than the 2-rank run's
    (trace_file,) = (tmp_path / "traces").glob("01_ddp_baseline_ddp*_rank0.json")
    trace = json.loads(trace_file.read_text())
    all_reduces = [e for e in trace["traceEvents"] if e.get("name") == "gloo:all_reduce"]
    assert len(all_reduces) == 2 * rec["collectives_per_step"]  # two traced warm-up steps
    steps = traces.step_breakdown(trace)
    assert len(steps) == 2
    for step in steps:  # the four parts cover the step: nothing counted twice or lost
        parts = [step[k] for k in ("compute", "exposed", "hidden", "idle")]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(step["wall"], rel=0.02)
        # both kinds of time were found; their sizes depend on the machine's load, so no ratio
        assert step["compute"] > 0 and step["exposed"] > 0
    assert traces.comm_pattern(trace)["all_reduce"]["count"] == 2 * rec["collectives_per_step"]


@pytest.mark.parametrize("flags, model, dtype", [(["--model", "resnet"], "resnet", "fp32"),
                                                 ([*LLAMA, "--dtype", "bf16"], "llama", "bf16")])
def test_resnet_and_bf16_as_a_world_of_one(flags, model, dtype, tmp_path):
    results = tmp_path / "results.jsonl"
    world_of_one(DDP / "optimized_ddp.py", *STEPS, *flags, "--results", str(results))
    rec = only_record(results)
    assert (rec["status"], rec["model"], rec["dtype"], rec["world_size"]) == ("ok", model,
                                                                             dtype, 1)
    throughput = "samples_per_s" if model == "resnet" else "tokens_per_s"
    assert rec[throughput] > 0 and len(rec["losses"]) == 8
    assert rec["loss_tolerance"] == (1e-4 if dtype == "fp32" else 1e-2)


def test_two_nodes_on_localhost(runs):
    """Two torchrun invocations, node ranks 0 and 1, rendezvous on 127.0.0.1: the fixture's
    baseline run, which the optimized pair's losses above are held to."""
    rec, console = runs["baseline_ddp"]
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["nnodes"] == 2
    assert rec["params"] == helpers.gpt_param_count(common.SIZES["tiny"], 32)
    assert "step    8/8" in console  # node 0 holds rank 0, which prints


@pytest.mark.parametrize("script, flags, hint", [
    ("baseline_ddp.py", ["--size", "huge"], "--size"),
    ("baseline_ddp.py", ["--steps", "-1"], "--steps"),
    ("optimized_ddp.py", ["--size", "tiny", "--accum", "3"], "--accum"),
    ("optimized_ddp.py", ["--bucket-mb", "0"], "--bucket-mb"),
])
def test_bad_input_exits_nonzero_with_one_line(script, flags, hint, tmp_path):
    assert_bad_input_is_one_line(DDP / script, flags, hint, tmp_path)


@pytest.mark.parametrize("script", ["baseline_ddp_flash.py", "optimized_ddp_flash.py"])
def test_the_attention_pair_skips_a_model_without_attention(script, tmp_path):
    assert_skipped_with_why(DDP / script, ["--model", "resnet"], "a ResNet has no attention",
                            tmp_path)


# --- The README's "Use it in your trainer", on HuggingFace models -------------------------------
TRAINER_STEPS = 4
BF16_STEPS = 2  # enough to step bf16 weights with bf16 gradients


def group_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the ranks: what hf_models.ddp_losses returns."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def train_with_the_readme_lines(rank: int, world: int, ports: list[int], out_file: str) -> None:
    """Trainers of one's own: for each of hf_models.readme_models(), each joins the group (the
    README's `common.setup()`), runs the README's lines as they are on the model its ranks seeded
    differently, beside PyTorch's DDP on the same model and global batch, and leaves."""
    as_rank(rank, world)
    sys.path.insert(0, str(DDP))  # where the trainer copied the recipe
    block = readme_python_block(DDP / "README.md")
    found = {}
    for (name, model_args), port in zip(hf_models.readme_models().items(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        torch.manual_seed(rank)
        model = hf_models.tiny_model(**model_args)
        bf16 = model_args.get("dtype") == torch.bfloat16
        batches = hf_models.token_batches(BF16_STEPS if bf16 else TRAINER_STEPS, rank, world)
        reference = copy.deepcopy(model)
        lines = {"model": model, "batches": batches}
        exec(block, lines)  # joins the group
        found[name] = {"readme": group_mean(lines["losses"]),
                       "ddp": hf_models.ddp_losses(reference, batches),
                       "seeded_apart": hf_models.seeded_apart(reference),
                       "buckets": len(common.ddp_bucket_bytes(lines["model"])),
                       "dtypes": {str(t.dtype) for p in lines["model"].parameters()
                                  for t in (p, p.grad)}}
        dist.destroy_process_group()
    if rank == 0:
        torch.save(found, out_file)


def accumulate_then_train_with_the_readme_lines(rank: int, world: int, ports: list[int],
                                                out: str) -> None:
    """A spawned world of 2: optimized_ddp.py with 2 micro-batches a step and 0.05 MiB buckets,
    as torchrun would run it on this rank, then the README's lines (train_with_the_readme_lines)."""
    as_rank(rank, world, ports[0])
    sys.argv = [str(DDP / "optimized_ddp.py"), *STEPS, "--accum", "2", "--bucket-mb", "0.05",
                "--results", f"{out}/accum.jsonl"]
    common.run_main(load_recipe(DDP / "optimized_ddp.py").main)
    train_with_the_readme_lines(rank, world, ports[1:], f"{out}/found.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The folder where the spawned world of 2 left the accumulation run's record and what the
    README's lines found."""
    out = tmp_path_factory.mktemp("spawned")
    ports = [common.free_port() for _ in range(1 + len(hf_models.readme_models()))]
    mp.spawn(functools.partial(run_then_leave, accumulate_then_train_with_the_readme_lines),
             args=(2, ports, str(out)), nprocs=2)
    return out


def test_the_readme_lines_train_every_model_like_ddp_and_keep_bf16_weights(spawned):
    models = hf_models.readme_models()
    found = torch.load(spawned / "found.pt")
    assert set(found) == set(models)
    for name, run in found.items():
        readme, ddp = run["readme"], run["ddp"]
        assert run["seeded_apart"], name
        assert max(abs(a - b) / b for a, b in zip(readme, ddp, strict=True)) <= 1e-5, name
        assert readme[-1] < readme[0], name
        bf16 = models[name].get("dtype") == torch.bfloat16
        assert run["dtypes"] == {"torch.bfloat16" if bf16 else "torch.float32"}, name
        # buckets of one decoder layer's gradients: DDP reports those it rebuilt from the third
        # step on, which the bf16 runs' two do not reach
        assert bf16 or run["buckets"] > 1, name


def test_the_top_readmes_loop_is_the_one_the_ddp_compression_and_fsdp_blocks_end_in():
    """The front door's loop is run by the tests of the folder blocks that end in it."""
    loop = readme_python_block(common.ROOT / "README.md", "## Use a recipe in your own trainer")
    assert "model(input_ids=inputs).logits" in loop and "labels=" not in loop
    trainer, int8 = "## Use it in your trainer", "## Use INT8 in your trainer"
    for folder, heading in [("01_ddp", trainer), ("02_compression", trainer),
                            ("02_compression", int8), ("03_fsdp", trainer)]:
        block = readme_python_block(common.ROOT / folder / "README.md", heading)
        assert block.endswith(loop), (folder, heading)
