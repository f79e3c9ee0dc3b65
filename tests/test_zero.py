"""Unit tests for 04_zero's pure parts (units, the flat partitioner, flattening, sharding), and
every stage against the DDP baseline at odd world sizes, 3 and 1, and clipped by the global
norm (--clip-grad-norm) at 2 and 3 ranks.

Those run each script's own `main()` in spawned gloo processes (cheaper than torchrun
launches), one spawn per world size; rank 0 writes the records and the tests compare them here.
"""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

import common
import report
from helpers import TINY, assert_within_its_tolerance, load_recipe

FOLDER = common.ROOT / "04_zero"
STAGES = {stage: load_recipe(FOLDER / f"optimized_zero{stage}.py") for stage in (1, 2, 3)}
SIZE = common.SIZES["tiny"]


def tiny_gpt() -> common.GPT:
    torch.manual_seed(0)
    return common.GPT(SIZE, SIZE.seq_len)


def topology(rank: int, world: int) -> common.Topology:
    return common.Topology(rank, rank, world, world, 1, "gloo", torch.device("cpu"))


# --- units and the partitioner (each stage has its own copy: all are checked) ----------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_units_hold_every_parameter_once_blocks_in_gradient_order(stage):
    model = tiny_gpt()
    units = STAGES[stage].units_in_gradient_order(model)
    flat = [p for unit in units for p in unit]
    assert len(flat) == len({id(p) for p in flat}) == len(list(model.parameters()))
    ids = [[id(p) for p in unit] for unit in units]
    assert ids[0] == [id(p) for p in model.blocks[-1].parameters()]  # backward reaches it first
    assert id(model.tok_emb.weight) in ids[-1] and id(model.ln_f.weight) in ids[-1]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_buckets_are_contiguous_and_padded_to_a_multiple_of_n_by_less_than_n(stage, world):
    recipe = STAGES[stage]
    buckets = recipe.partition(recipe.units_in_gradient_order(tiny_gpt()), world)
    offset = 0
    for bucket in buckets:
        assert bucket.offset == offset and bucket.numel % world == 0
        assert 0 <= bucket.numel - sum(p.numel() for p in bucket.params) < world
        offset += bucket.numel


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_element_is_owned_by_exactly_one_rank(stage, world):
    recipe = STAGES[stage]
    buckets = recipe.partition(recipe.units_in_gradient_order(tiny_gpt()), world)
    index = torch.arange(sum(b.numel for b in buckets))
    covered = torch.zeros_like(index)
    for rank in range(world):
        for bucket in buckets:
            mine = bucket.owned(index, rank, world)
            assert len(mine) == bucket.numel // world
            covered[mine] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ranks_owned_gradients_hold_every_value_once_and_no_padding(stage, world):
    """What clip_grad_norm_ sums: each value of the gradient, counted by exactly one rank."""
    recipe = STAGES[stage]
    buckets = recipe.partition(recipe.units_in_gradient_order(tiny_gpt()), world)
    values = sum(p.numel() for b in buckets for p in b.params)
    index = torch.full((sum(b.numel for b in buckets),), -1.0)  # -1: padding
    for b in buckets:
        used = sum(p.numel() for p in b.params)
        index[b.offset:b.offset + used] = torch.arange(used) + b.offset
    seen = []
    for rank in range(world):
        shards = []
        for b in buckets:
            shard = torch.nn.Parameter(torch.empty(b.numel // world))
            start = b.offset + rank * b.numel // world
            shard.grad = index[start:start + b.numel // world]
            shards.append(shard)
        seen += recipe.owned_grads(buckets, shards, rank)
    seen = torch.cat(seen)
    assert seen.numel() == values and (seen >= 0).all() and seen.unique().numel() == values
    if world == 3:  # here the blocks' buckets are padded
        assert sum(b.numel for b in buckets) > values


def test_the_shard_buffer_holds_each_bucket_slice_in_bucket_order():
    recipe = STAGES[3]
    buckets = recipe.partition(recipe.units_in_gradient_order(tiny_gpt()), 3)
    shards = torch.arange(sum(b.numel for b in buckets) // 3)
    pieces = [b.shard(shards, 3) for b in buckets]
    assert torch.equal(torch.cat(pieces), shards)  # contiguous, in order, no overlap


# --- flattening: parameters become views, values kept ---------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_flatten_makes_parameters_and_gradients_views_of_the_flat_buffers(stage):
    recipe, model = STAGES[stage], tiny_gpt()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    buckets = recipe.partition(recipe.units_in_gradient_order(model), 3)
    flat = recipe.flatten(buckets, torch.device("cpu"))
    flat_params = flat[0] if stage == 1 else flat
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == flat_params.untyped_storage().data_ptr()
        if stage == 1:
            assert p.grad.untyped_storage().data_ptr() == flat[1].untyped_storage().data_ptr()
    flat_params.add_(1.0)  # an update of the flat buffer is an update of the model
    assert torch.equal(model.tok_emb.weight, before["tok_emb.weight"] + 1)
    assert model.head.weight is model.tok_emb.weight  # still tied
    shards = recipe.owned_shards(buckets, *flat, topology(1, 3)) if stage == 1 else \
        recipe.owned_shards(buckets, flat, topology(1, 3))
    assert sum(s.numel() for s in shards) == flat_params.numel() // 3
    assert all(s.untyped_storage().data_ptr() == flat_params.untyped_storage().data_ptr()
               for s in shards)


def test_zero3_keeps_one_slice_per_rank_and_frees_the_full_parameters():
    recipe, world = STAGES[3], 2
    full = {}
    for rank in range(world):
        model = tiny_gpt()
        buckets = recipe.partition(recipe.units_in_gradient_order(model), world)
        values = [torch.cat([p.detach().flatten() for p in b.params]) for b in buckets]
        param_shards, unsharded = recipe.shard_params(buckets, topology(rank, world))
        assert param_shards.numel() == sum(b.numel for b in buckets) // world
        assert all(u.untyped_storage().nbytes() == 0 for u in unsharded)  # freed until gathered
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        full[rank] = (param_shards, values, buckets)
    for i in range(len(full[0][2])):  # the ranks' slices, put back together, are the bucket
        joined = torch.cat([full[r][2][i].shard(full[r][0], world) for r in range(world)])
        used = full[0][1][i].numel()
        assert torch.equal(joined[:used], full[0][1][i]) and not joined[used:].any()


# --- every stage at an odd world size, and clipped, in spawned processes --------------------
SCRIPTS = ["baseline_zero", "optimized_zero1", "optimized_zero2", "optimized_zero3"]
CLIP = ["--clip-grad-norm", "0.5"]  # under the tiny GPT's gradient norm (1.2 to 2.1): always clips
PYTORCH = [("optimized_zero_pytorch", CLIP), ("optimized_zero_pytorch", [*CLIP, "--stage", "3"])]
RUNS = {  # world size: the runs of its one spawn, (script, flags)
    3: [(name, flags) for flags in ([], CLIP) for name in SCRIPTS],
    2: [("baseline_zero", []), *((name, CLIP) for name in SCRIPTS), *PYTORCH],
    1: [(name, []) for name in SCRIPTS],
}


def _run_every_script(rank: int, world: int, port: int, results: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    for k, (name, flags) in enumerate(RUNS[world]):
        os.environ["MASTER_PORT"] = str(port + k)  # a fresh store for each run's group
        path = FOLDER / f"{name}.py"
        sys.argv = [str(path), *TINY, *flags, "--results", results]
        common.run_main(load_recipe(path).main)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world size -> {(script, stage, clip_grad_norm): record}, each world's runs spawned once,
    when a test first asks for them."""
    done = {}

    def at(world: int) -> dict:
        if world not in done:
            results = tmp_path_factory.mktemp(f"world{world}") / "results.jsonl"
            mp.spawn(_run_every_script, args=(world, common.free_port(), str(results)),
                     nprocs=world)
            done[world] = {(rec["script"], rec["stage"], rec["clip_grad_norm"]): rec
                           for rec in common.load_results(results)}
            assert len(done[world]) == len(RUNS[world])
        return done[world]

    return at


@pytest.fixture(scope="module", params=[3, 1], ids=["3 ranks", "a world of one"])
def world(request, spawned):
    return request.param, {script: rec for (script, _, clip), rec in
                           spawned(request.param).items() if clip is None}


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_each_stage_trains_like_ddp_at_an_odd_world_size(world, script):
    n, runs = world
    base, rec = runs["baseline_zero"], runs[script]
    assert rec["status"] == "ok" and rec["world_size"] == n
    assert relative_diff(rec["losses"], base["losses"]) <= 1e-5
    for key in ("state_mb", "params_mb", "grads_mb", "optim_mb", "comm_mb"):
        assert rec[key] == pytest.approx(rec["theory"][key], rel=0.05), key


# at 3 ranks the blocks' buckets are padded (the last rank's slices end in padding)
CLIPPED = [(world, name, stage) for world in (2, 3) for name, stage in
           zip(SCRIPTS[1:], (1, 2, 3), strict=True)]
CLIPPED += [(2, "optimized_zero_pytorch", 1), (2, "optimized_zero_pytorch", 3)]


@pytest.mark.parametrize("world, script, stage", CLIPPED)
def test_each_stage_clips_by_the_global_norm_like_ddp(spawned, world, script, stage):
    """The hand-written norm (each rank's owned values, padding left out, all-reduced) clips
    like torch.nn.utils.clip_grad_norm_ under DDP, and so does PyTorch's own ZeRO (on DDP's
    full gradients beside ZeroRedundancyOptimizer, on FSDP2's DTensor shards)."""
    runs, clip = spawned(world), float(CLIP[1])
    rec, base = runs[(script, stage, clip)], runs[("baseline_zero", 0, clip)]
    assert rec["status"] == base["status"] == "ok" and rec["world_size"] == world
    assert relative_diff(rec["losses"], base["losses"]) <= 1e-5
    assert_within_its_tolerance(rec, base)
    # clipping did change the training: the unclipped baseline's losses are elsewhere
    unclipped = runs[("baseline_zero", 0, None)]["losses"]
    assert report.max_loss_diff(base["losses"], unclipped) > 10 * rec["loss_tolerance"]
