"""Launch tests: 03_fsdp/optimized_fsdp_lora.py, fine-tuning a checkpoint under torchrun with CPU
processes at `tiny`.

From one module-scoped fixture: in 2 spawned gloo processes that run one after another what
torchrun would (no launcher's start-up), a pretraining run of optimized_fsdp_checkpoint.py (40
steps, saved after the last), full fine-tuning from its checkpoint (optimized_fsdp.py
--init-from), then the README's LoRA lines on every tiny HuggingFace model of
tests/hf_models.py, ranks seeded apart, against PyTorch's DDP; from the checkpoint, LoRA
launched at 2 and at 4 processes (4 and 2 sequences a rank: one global batch of 8) and, in this
process meanwhile, LoRA as a world of one with the batch of 8 from the checkpoint and from random
weights.
"""

import copy
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import (
    TINY,
    as_rank,
    finish,
    load_recipe,
    only_record,
    readme_python_block,
    run_then_leave,
    torchrun,
    world_of_one,
)
from report import results_table

FOLDER = common.ROOT / "03_fsdp"
LORA = FOLDER / "optimized_fsdp_lora.py"
README_HEADING = "### Use it in your trainer, with LoRA"


def pretrain_fine_tune_then_readme(rank: int, world: int, port: int, root: str) -> None:
    """A spawned world of 2: the pretraining run and full fine-tuning from its checkpoint, as
    torchrun would run them on this rank, then the README's LoRA lines."""
    as_rank(rank, world)
    pretrained = f"{root}/pretrained"
    for k, (script, name, flags) in enumerate([
            ("optimized_fsdp_checkpoint", "pretrain", ["--steps", "38", "--checkpoint-every", "40",
                                                       "--checkpoint-dir", pretrained]),
            ("optimized_fsdp", "full_2", ["--init-from", pretrained])]):
        os.environ["MASTER_PORT"] = str(port + k)
        sys.argv = [str(FOLDER / f"{script}.py"), *TINY, "--results", f"{root}/{name}.jsonl",
                    *flags]
        common.run_main(load_recipe(FOLDER / f"{script}.py").main)
    _readme_lines_against_ddp(rank, world, port + 2, f"{root}/readme.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    mp.spawn(functools.partial(run_then_leave, pretrain_fine_tune_then_readme),
             args=(2, common.free_port(block=3), str(root)), nprocs=2)
    pretrained = root / "pretrained"
    start = ["--init-from", str(pretrained)]
    launches = {"lora_2": torchrun(LORA, root / "lora_2.jsonl", *start),
                "lora_4": torchrun(LORA, root / "lora_4.jsonl", *start, "--batch-size", "2",
                                   nproc=4)}
    singles = {"lora_1": start, "scratch_1": ["--init-from", "scratch"]}
    try:
        for name, flags in singles.items():  # while the launches run
            world_of_one(LORA, *TINY, "--batch-size", "8", "--results",
                         str(root / f"{name}.jsonl"), *flags)
    finally:
        for launch in launches.values():
            finish(launch)
    out = {name: only_record(root / f"{name}.jsonl") for name in
           ["pretrain", "full_2", *launches, *singles]}
    out["checkpoint"] = sorted(p.name for p in pretrained.iterdir())
    out["readme"] = torch.load(root / "readme.pt")
    return out


@pytest.mark.parametrize("name", ["lora_2", "lora_4"])
def test_lora_at_2_and_4_processes_trains_as_lora_in_one(runs, name):
    rec, one = runs[name], runs["lora_1"]
    assert rec["status"] == "ok" and one["status"] == "ok" and one["world_size"] == 1
    assert rec["started_from"].endswith("step-000040") and rec["init_from"]
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], one["losses"], strict=True)) <= 1e-5


@pytest.mark.parametrize("name", ["lora_2", "lora_4"])
def test_lora_state_and_bytes_by_kind_equal_their_theory(runs, name):
    rec = runs[name]
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], abs=0.005)  # 2 decimals
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    for kind in ("allgather", "reduce_scatter"):
        assert rec["comm_by_kind_mb"][kind] == pytest.approx(
            rec["theory"]["comm_by_kind_mb"][kind], rel=1e-3), kind
    assert rec["trainable_params"] == rec["theory"]["trainable_params"]
    assert rec["adapted"] == [f"blocks.{i}.attn.{n}" for i in range(2) for n in ("qkv", "proj")]


def test_loras_gradient_bytes_are_full_fine_tunings_times_the_adapters_share(runs):
    lora, full = runs["lora_2"], runs["full_2"]
    assert full["status"] == "ok" and full["init_from"] == lora["init_from"]
    full_reduced = full["comm_by_op"]["reduce_scatter/2"][0]
    assert lora["theory"]["full_finetune_reduce_scatter_mb"] == pytest.approx(full_reduced,
                                                                           rel=1e-3)
    # at `tiny` (d_model 64) the rank-8 adapters are 5.6% of the weights; at `small`, 1.4%
    # (tests/test_fsdp_lora.py)
    assert lora["comm_by_kind_mb"]["reduce_scatter"] == pytest.approx(
        lora["trainable_params"] / full["params"] * full_reduced, rel=0.01)
    # the frozen base is gathered as in full fine-tuning (the adapters with it): what sharding
    # it costs
    gathered = full["comm_by_op"]["allgather/2"][0]
    assert gathered < lora["comm_by_kind_mb"]["allgather"] <= 1.1 * gathered
    # a frozen weight holds 4 bytes a rank, not full fine-tuning's 16
    assert lora["state_mb"] < 0.35 * full["state_mb"]


def test_fine_tuning_from_the_checkpoint_ends_lower_than_from_random_weights(runs):
    pretrain, tuned, scratch = runs["pretrain"], runs["lora_1"], runs["scratch_1"]
    assert runs["checkpoint"] == ["step-000040"]
    assert pretrain["losses"][-1] < 0.8 * pretrain["losses"][0]  # the base learnt its task
    assert scratch["init_from"] == "scratch" and scratch["started_from"] is None
    assert tuned["losses"][-1] < 0.8 * scratch["losses"][-1]
    assert scratch["loss_tolerance"] is None and "loss_tolerance_final_rel" not in scratch


def test_the_report_holds_lora_to_full_fine_tuning_from_the_same_checkpoint(runs):
    lora, full = runs["lora_2"], runs["full_2"]
    assert lora["baseline"] == "optimized_fsdp" and lora["loss_tolerance_final_rel"] == 0.10
    by_key = {i: run for i, run in enumerate([full, runs["scratch_1"]])}
    assert results_table.baseline_run(lora, by_key) is full
    assert results_table.why_not_compared(lora, full) is None


# --- The README's lines ---------------------------------------------------------------------
def _join(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _readme_lines_against_ddp(rank: int, world: int, port: int, out_file: str) -> None:
    """The README's LoRA lines as they are on every case of hf_models.CASES and the two models
    with a feature some recipes do not implement, ranks seeded apart, beside PyTorch's DDP on a
    copy of the model with the same adapters (A drawn from the same generator state) and the
    same global batch: `shard` must start every rank from rank 0's base and adapters, as DDP."""
    import hf_models  # here: `transformers` costs every process that imports it seconds

    torch.set_num_threads(1)  # 2 processes on 2 cores: more threads only fight
    _join(rank, world, port)
    snippet = readme_python_block(FOLDER / "README.md", README_HEADING)
    recipe = vars(load_recipe(LORA))
    batches = hf_models.token_batches(4, rank, world)
    models = {str(case): dict(family=case.family, attn_implementation=case.attn, tied=case.tied)
              for case in hf_models.CASES}
    models.update({name: dict(family=name) for name in hf_models.UNSUPPORTED})
    models.update({f"{family} bf16": dict(family=family, dtype=torch.bfloat16)
                   for family in hf_models.FAMILIES})  # bf16 weights, the base kept bf16
    found = {}
    for name, model_args in models.items():
        torch.manual_seed(rank)
        model = hf_models.tiny_model(**model_args)
        seeded_apart = hf_models.seeded_apart(model)
        reference, draws = copy.deepcopy(model), torch.get_rng_state()
        recipe["apply_lora"](reference, recipe["ATTENTION"], rank=8, alpha=16)  # the README's
        ddp = hf_models.ddp_losses(reference, batches)
        torch.set_rng_state(draws)  # the README's apply_lora draws the reference's A
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
        namespace = {**recipe, "model": model, "batches": batches}
        exec(snippet, namespace)
        base = {n.replace(".base", ""): p.full_tensor()  # a collective: every rank, every one
                for n, p in model.named_parameters() if not p.requires_grad}
        found[name] = {
            "readme": _group_mean(namespace["losses"]), "ddp": ddp, "seeded_apart": seeded_apart,
            "adapted": sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                               if isinstance(m, recipe["LoRALinear"])}),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            # on rank 0, the one that saves: the base every rank holds, which never moved
            "frozen_kept": all(torch.equal(p, frozen[n]) for n, p in base.items()),
            "base_dtypes": {p.dtype for p in base.values()}}
    if rank == 0:
        torch.save(found, out_file)
    dist.destroy_process_group()


def _group_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the ranks: what hf_models.ddp_losses returns."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def test_the_readmes_lora_lines_fine_tune_every_model_seeded_apart_like_ddp(runs):
    snippet = readme_python_block(FOLDER / "README.md", README_HEADING)
    assert "apply_lora(model" in snippet and "shard(model, blocks, mesh)" in snippet
    found = runs["readme"]  # in the spawned world of 2 (pretrain_fine_tune_then_readme)
    assert {name.split("-")[0].removesuffix(" bf16") for name in found} == {
        "llama", "qwen2", "mistral", "fused", "rope scaling"}
    assert len(found) == 11
    for name, run in found.items():
        readme, ddp, bf16 = run["readme"], run["ddp"], name.endswith("bf16")
        assert run["seeded_apart"] and run["frozen_kept"], name  # the base never moved
        assert run["base_dtypes"] == {torch.bfloat16 if bf16 else torch.float32}, name
        # bf16 against DDP in bf16 on the same adapted model: the shards' sums round apart
        assert max(abs(a - b) / b for a, b in zip(readme, ddp, strict=True)) <= (
            1e-2 if bf16 else 1e-5), name
        assert readme[-1] < readme[0], name
        # the attention's projections, a fused one adapted whole (Phi-3's qkv_proj)
        adapted = ["o_proj", "qkv_proj"] if name == "fused" else ["k_proj", "o_proj", "q_proj",
                                                                   "v_proj"]
        assert run["adapted"] == adapted, name
        assert run["trainable"] > 0, name
