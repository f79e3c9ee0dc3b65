"""Composed parallelism at `tiny`: 03_fsdp/optimized_fsdp_tp.py on a (dp 2, tp 2) mesh of 4 CPU
processes and 05_pipeline/optimized_pipeline_3d.py on (pp 2, dp 2, tp 2) of 8, each against DDP
on the same global batch, GPT and Llama, clipping the gradient; a DCP checkpoint saved at (dp 2,
tp 2) resumed at (dp 1, tp 4) and as plain FSDP over 4 ranks with the uninterrupted run's losses.

The runs of a world are forked from one Python (`report.py smoke`, as `make smoke` runs them):
torch imported once, not once a rank, which on 2 cores is most of a launch's time."""

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import common
import report
from helpers import (
    assert_bad_input_is_one_line,
    assert_within_its_tolerance,
    cpu_env,
    load_recipe,
    readme_python_block,
)

FSDP_TP = common.ROOT / "03_fsdp" / "optimized_fsdp_tp.py"
PIPELINE_3D = common.ROOT / "05_pipeline" / "optimized_pipeline_3d.py"
CLIP = "--clip-grad-norm 0.5"
SAVED_AT = 3  # the 2-D run saves after step 3 of its 5 (3 timed after 2 warm-up)


def forked_runs(runs: list[str], nproc: int, out) -> list[dict]:
    """Each run (a script and its flags) at `nproc` ranks, tiny, 3 timed steps after 2 warm-up
    unless its flags say otherwise; their records, in order."""
    done = subprocess.run(
        [sys.executable, str(common.ROOT / "report.py"), "--out", str(out / "report.md"),
         "smoke", "--nproc", str(nproc), "--timeout", "300",
         "--flags", "--size tiny --steps 3 --warmup 2 --timeout 120", "--", *runs],
        cwd=common.ROOT, capture_output=True, text=True, timeout=900, env=cpu_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = common.load_results(out / "smoke" / "results.jsonl")
    assert [r["status"] for r in records] == ["ok"] * len(runs), done.stdout
    return records


@pytest.fixture(scope="module")
def on_4_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("compose4")
    saved = f"--checkpoint-dir {out / 'checkpoints'}"
    # the script's own flags in its parser's order, as its record's variant names them
    runs = [f"03_fsdp/baseline_fsdp.py {CLIP}",
            f"03_fsdp/optimized_fsdp_tp.py {CLIP} {saved} --checkpoint-every {SAVED_AT}",
            f"03_fsdp/optimized_fsdp_tp.py --tp 4 {CLIP} {saved} --resume --steps 4 --warmup 1",
            f"03_fsdp/optimized_fsdp_tp.py --tp 1 {CLIP} {saved} --resume --steps 4 --warmup 1",
            f"03_fsdp/baseline_fsdp.py --model llama {CLIP}",
            f"03_fsdp/optimized_fsdp_tp.py --model llama {CLIP}"]
    return dict(zip(["ddp", "2d", "tp4", "fsdp", "ddp llama", "2d llama"],
                    forked_runs(runs, 4, out), strict=True))


@pytest.fixture(scope="module")
def on_8_ranks(tmp_path_factory):
    # two sequences a rank: the global batch of the 4-rank DDP runs (4 x 4), so the 3-D Llama
    # is held to the 4-rank Llama DDP run as well
    flags = f"{CLIP} --batch-size 2"
    runs = [f"05_pipeline/baseline_pipeline_3d.py {flags}",
            f"05_pipeline/optimized_pipeline_3d.py {flags}",
            f"05_pipeline/optimized_pipeline_3d.py --model llama {flags}"]
    return dict(zip(["ddp", "3d", "3d llama"],
                    forked_runs(runs, 8, tmp_path_factory.mktemp("compose8")), strict=True))


def assert_measured_is_theory(rec: dict) -> None:
    """State within 5% of its theory, and every mesh dim's bytes equal to its own."""
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.05)
    assert rec["comm_mb_by_dim"].keys() == rec["mesh"].keys()
    for dim, predicted in rec["theory"]["comm_mb_by_dim"].items():
        assert rec["comm_mb_by_dim"][dim] == pytest.approx(predicted, rel=0.01, abs=2e-3), dim


@pytest.mark.parametrize("model", ["", " llama"])
def test_fsdp_x_tp_trains_like_ddp_with_the_state_and_bytes_of_its_theory(on_4_ranks, model):
    rec, ddp = on_4_ranks[f"2d{model}"], on_4_ranks[f"ddp{model}"]
    assert rec["mesh"] == {"dp": 2, "tp": 2} and rec["clip_grad_norm"] == 0.5
    assert_within_its_tolerance(rec, ddp)
    assert_measured_is_theory(rec)
    assert rec["comm_mb_by_dim"]["dp"] > 0 and rec["comm_mb_by_dim"]["tp"] > 0
    # each rank holds about a quarter of DDP's state: what TP replicates (the norms) aside
    assert rec["state_mb"] == pytest.approx(ddp["state_mb"] / 4, rel=0.05)


@pytest.mark.parametrize("layout, mesh", [("tp4", {"dp": 1, "tp": 4}),
                                          ("fsdp", {"dp": 4, "tp": 1})])
def test_a_checkpoint_saved_at_dp2_tp2_resumes_at_another_layout(on_4_ranks, layout, mesh):
    """DCP reshards on load: the (dp 2, tp 2) run's shards, read at (dp 1, tp 4) or as plain
    FSDP over 4 ranks, continue with the losses of the run that was never stopped."""
    saver, resumed = on_4_ranks["2d"], on_4_ranks[layout]
    assert resumed["mesh"] == mesh and resumed["resumed_from"] == SAVED_AT
    uninterrupted = saver["losses"][SAVED_AT:]
    assert len(resumed["losses"]) == len(uninterrupted) == 2
    assert report.max_loss_diff(resumed["losses"], uninterrupted) <= resumed["loss_tolerance"]
    assert_measured_is_theory(resumed)


@pytest.mark.parametrize("model", ["", " llama"])
def test_pipeline_x_fsdp_x_tp_trains_like_ddp(on_8_ranks, on_4_ranks, model):
    rec = on_8_ranks[f"3d{model}"]
    assert rec["mesh"] == {"pp": 2, "dp": 2, "tp": 2} and rec["microbatches"] == 4
    assert_within_its_tolerance(rec, on_8_ranks["ddp"] if not model else on_4_ranks["ddp llama"])
    assert_measured_is_theory(rec)
    assert all(rec["comm_mb_by_dim"][dim] > 0 for dim in ("pp", "dp", "tp"))
    assert rec["theory"]["bubble_uniform"] == pytest.approx(1 / 5)
    # against DDP's 16 bytes a parameter on every rank: about an eighth, the embedding's stage
    assert rec["state_mb"] < on_8_ranks["ddp"]["state_mb"] / 6


def test_the_ddp_baseline_of_the_3d_run_is_ddp(on_8_ranks, on_4_ranks):
    """05's baseline_pipeline_3d at 8 ranks x 2 sequences trains as 03's baseline_fsdp at 4 x 4:
    the same global batch."""
    assert report.max_loss_diff(on_8_ranks["ddp"]["losses"], on_4_ranks["ddp"]["losses"]) <= 1e-5


@pytest.mark.parametrize("script, flags, world, hint", [
    (FSDP_TP, ["--tp", "3"], "4", "does not divide the 4 processes"),
    (FSDP_TP, ["--tp", "4", "--model", "llama"], "4", "2 KV heads"),
    (FSDP_TP, ["--tp", "4", "--seq-len", "30"], "4", "30 sequence positions"),
    (PIPELINE_3D, ["--pp", "5"], "20", "more stages than"),
    (PIPELINE_3D, ["--pp", "2", "--tp", "3"], "16", "= 6 does not divide the 16 processes"),
    (PIPELINE_3D, ["--microbatches", "3"], "8", "do not split into --microbatches 3"),
])
def test_a_mesh_that_cannot_be_built_is_refused_in_one_line(script, flags, world, hint,
                                                            tmp_path):
    assert_bad_input_is_one_line(script, ["--size", "tiny", *flags], hint, tmp_path,
                                 WORLD_SIZE=world)


def _readme_lines_on_a_2d_mesh(rank: int, world: int, port: int, snippet: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    common.setup(timeout_s=60)
    size, dp_rank, dp = common.SIZES["tiny"], rank // 2, world // 2  # tp 2, the inner dim
    whole = [common.global_token_batch(size, size.seq_len, 8, step, 0) for step in range(3)]
    batches = [(common.rank_slice(t[:, :-1], dp_rank, dp), common.rank_slice(t[:, 1:], dp_rank, dp))
               for t in whole]
    torch.manual_seed(rank)  # ranks seeded apart: the lines start them from rank 0's weights
    namespace = {**vars(load_recipe(FSDP_TP)), "model": common.Llama(size), "batches": batches}
    exec(snippet, namespace)
    torch.manual_seed(0)  # the reference: rank 0's model, one process, the whole batch
    model = common.Llama(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = []
    for tokens in whole:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        reference.append(loss.item())
    losses = torch.tensor(namespace["losses"])  # each dp rank's batch: their mean is the batch's
    dist.all_reduce(losses)
    assert (losses / world - torch.tensor(reference)).abs().max() <= 1e-5, (losses, reference)
    dist.destroy_process_group()


def test_the_readmes_2d_lines_train_a_llama_seeded_apart_like_one_process():
    snippet = readme_python_block(common.ROOT / "03_fsdp" / "README.md",
                                  "### Use it in your trainer, on a 2-D mesh")
    assert 'mesh_dim_names=("dp", "tp")' in snippet and "list(model.model.layers)" in snippet
    port, fork = common.free_port(), multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_readme_lines_on_a_2d_mesh, args=(r, 4, port, snippet))
             for r in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=240)
    assert [p.exitcode for p in ranks] == [0] * 4
