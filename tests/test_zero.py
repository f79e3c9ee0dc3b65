"""Unit tests for 04_zero's pure parts (units, the flat partitioner, flattening, sharding), and
every stage against the DDP baseline at odd world sizes, 3 and 1, and clipped by the global
norm (--clip-grad-norm) at 2 and 3 ranks; ZeRO-3 with its optimizer offloaded against ZeRO-3
at 3 ranks, and clipped at 2 and 3.

Those run each script's own `main()` in spawned gloo processes (cheaper than torchrun
launches), one spawn per world size; rank 0 writes the records and the tests compare them here.
Then the ZeRO1/2/3 objects as a user's trainer calls them, in-process on the tiny Llama (in the
same spawns of 2 and 3 ranks): a plain zero_grad/backward/step loop and 2-micro-batch
accumulation against DDP (with no_sync), ranks seeded apart, a bf16 model staying bf16, ranks
{0, 1} of 3 as a sub-group against a world of 2, the model's own zero_grad(), an evaluation
forward between backward and step, the ResNet's BatchNorm buffers; PyTorch's own ZeRO
(optimized_zero_pytorch.py's units) on ranks seeded apart; ZeRO-3 under bf16 autocast against
its theory (bytes by dtype, the peak's parameters, what forward keeps for backward); and the
README's "Use it in your trainer" lines as written, with each stage's class and ZeRO3Offload,
on tiny transformers models (tests/hf_models.py: Llama, Qwen2 and Mistral, sdpa and eager, each
family in bf16 too, Phi-3's fused projections and a scaled rotary) seeded apart, against
PyTorch's DDP on the same model.
"""

import copy
import dataclasses
import functools
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

import common
from helpers import TINY, as_rank, assert_within_its_tolerance, load_recipe, readme_python_block
from report import results_table

FOLDER = common.ROOT / "04_zero"
STAGES = {stage: load_recipe(FOLDER / f"optimized_zero{stage}.py") for stage in (1, 2, 3)}
PYTORCH_ZERO = load_recipe(FOLDER / "optimized_zero_pytorch.py")
SIZE = common.SIZES["tiny"]


def tiny_gpt() -> common.GPT:
    torch.manual_seed(0)
    return common.GPT(SIZE, SIZE.seq_len)


def tiny_llama(seed: int = 0, dtype: torch.dtype | None = None) -> common.Llama:
    torch.manual_seed(seed)
    model = common.Llama(SIZE)
    return model if dtype is None else model.to(dtype)


# --- units and the partitioner (each stage has its own copy: all are checked) ----------------
def units(stage: int, model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    return STAGES[stage].units_in_gradient_order(model, common.transformer_blocks(model))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_units_hold_every_parameter_once_blocks_in_gradient_order(stage, family):
    model = tiny_gpt() if family == "gpt" else tiny_llama()
    found = units(stage, model)
    flat = [p for unit in found for p in unit]
    assert len(flat) == len({id(p) for p in flat}) == len(list(model.parameters()))
    ids = [[id(p) for p in unit] for unit in found]
    blocks = common.transformer_blocks(model)
    assert ids[0] == [id(p) for p in blocks[-1].parameters()]  # backward reaches it first
    embedding, head = common.input_embedding(model), common.output_head(model)
    assert id(embedding.weight) in ids[-1] and id(head.weight) in ids[-1]  # the root unit


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_blocks_that_share_a_weight_are_refused_in_one_line(stage):
    model = tiny_llama()
    blocks = common.transformer_blocks(model)
    blocks[1].mlp.up_proj.weight = blocks[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match="in another block too"):
        STAGES[stage].units_in_gradient_order(model, blocks)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_buckets_are_contiguous_and_padded_to_a_multiple_of_n_by_less_than_n(stage, world):
    recipe = STAGES[stage]
    buckets = recipe.partition(units(stage, tiny_gpt()), world)
    offset = 0
    for bucket in buckets:
        assert bucket.offset == offset and bucket.numel % world == 0
        assert 0 <= bucket.numel - sum(p.numel() for p in bucket.params) < world
        offset += bucket.numel


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_element_is_owned_by_exactly_one_rank(stage, world):
    recipe = STAGES[stage]
    buckets = recipe.partition(units(stage, tiny_gpt()), world)
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
    buckets = recipe.partition(units(stage, tiny_gpt()), world)
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
    buckets = recipe.partition(units(3, tiny_gpt()), 3)
    shards = torch.arange(sum(b.numel for b in buckets) // 3)
    pieces = [b.shard(shards, 3) for b in buckets]
    assert torch.equal(torch.cat(pieces), shards)  # contiguous, in order, no overlap


# --- flattening: parameters become views, values kept ---------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_flatten_makes_parameters_and_gradients_views_of_the_flat_buffers(stage):
    recipe, model = STAGES[stage], tiny_gpt()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    buckets = recipe.partition(units(stage, model), 3)
    flat = recipe.flatten(buckets)
    flat_params = flat[0] if stage == 1 else flat
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == flat_params.untyped_storage().data_ptr()
        if stage == 1:
            assert p.grad.untyped_storage().data_ptr() == flat[1].untyped_storage().data_ptr()
    flat_params.add_(1.0)  # an update of the flat buffer is an update of the model
    assert torch.equal(model.tok_emb.weight, before["tok_emb.weight"] + 1)
    assert model.head.weight is model.tok_emb.weight  # still tied
    shards = recipe.owned_shards(buckets, *flat, 1, 3) if stage == 1 else \
        recipe.owned_shards(buckets, flat, 1, 3)
    assert sum(s.numel() for s in shards) == flat_params.numel() // 3
    assert all(s.untyped_storage().data_ptr() == flat_params.untyped_storage().data_ptr()
               for s in shards)


@pytest.mark.parametrize("stage", [1, 2])
def test_flat_buffers_keep_the_parameters_dtype_and_refuse_a_mix(stage):
    recipe, model = STAGES[stage], tiny_llama(dtype=torch.bfloat16)
    flat = recipe.flatten(recipe.partition(units(stage, model), 2))
    assert all(t.dtype == torch.bfloat16 for t in (flat if stage == 1 else [flat]))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model = tiny_llama()
    common.transformer_blocks(model)[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="several dtypes"):
        recipe.flatten(recipe.partition(units(stage, model), 2))


# --- every stage at an odd world size, and clipped, in spawned processes --------------------
SCRIPTS = ["baseline_zero", "optimized_zero1", "optimized_zero2", "optimized_zero3"]
OFFLOAD = "optimized_zero3_offload"  # ZeRO-3's state in host memory: held to ZeRO-3's losses
CLIP = ["--clip-grad-norm", "0.5"]  # under the tiny GPT's gradient norm (1.2 to 2.1): always clips
PYTORCH = [("optimized_zero_pytorch", CLIP), ("optimized_zero_pytorch", [*CLIP, "--stage", "3"])]
RUNS = {  # world size: the runs of its one spawn, (script, flags)
    3: [(name, flags) for flags in ([], CLIP) for name in [*SCRIPTS, OFFLOAD]],
    2: [("baseline_zero", []), *((name, CLIP) for name in [*SCRIPTS, OFFLOAD]), *PYTORCH],
    1: [(name, []) for name in SCRIPTS],
}


def _run_every_script(rank: int, world: int, port: int, results: str) -> None:
    as_rank(rank, world)
    for k, (name, flags) in enumerate(RUNS[world]):
        os.environ["MASTER_PORT"] = str(port + k)  # a fresh store for each run's group
        path = FOLDER / f"{name}.py"
        sys.argv = [str(path), *TINY, *flags, "--results", results]
        common.run_main(load_recipe(path).main)


def _run_the_world(rank: int, world: int, port: int, out: str) -> None:
    """One spawn a world size (a spawn's start-up costs seconds): its scripts' runs, then, at 2
    and 3 ranks, the ZeRO objects' scenarios below, on ports of their own."""
    _run_every_script(rank, world, port, f"{out}/results.jsonl")
    if world in (2, 3):
        _run_units(rank, world, port + len(RUNS[world]), out)
    # as run_main ends a script: no interpreter teardown, where gloo's ranks have aborted in
    # C++ after a good run ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def spawned_world(tmp_path_factory):
    """world size -> its one spawn's folder (the scripts' records, each rank's scenarios), the
    spawn run when a test first asks for the world."""
    done = {}

    def at(world: int):
        if world not in done:
            out = tmp_path_factory.mktemp(f"world{world}")
            port = common.free_port(block=len(RUNS[world]) + 1)  # each run's store, then the units'
            mp.spawn(_run_the_world, args=(world, port, str(out)), nprocs=world)
            done[world] = out
        return done[world]

    return at


@pytest.fixture(scope="module")
def spawned(spawned_world):
    """world size -> {(script, stage, clip_grad_norm): record}."""
    def at(world: int) -> dict:
        runs = {(rec["script"], rec["stage"], rec["clip_grad_norm"]): rec
                for rec in common.load_results(spawned_world(world) / "results.jsonl")}
        assert len(runs) == len(RUNS[world])
        return runs

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
    assert results_table.max_loss_diff(base["losses"], unclipped) > 10 * rec["loss_tolerance"]


@pytest.mark.parametrize("world, clip", [(3, None), (3, float(CLIP[1])), (2, float(CLIP[1]))])
def test_offloaded_zero3_trains_like_zero3_and_keeps_its_state_where_its_theory_says(
        spawned, world, clip):
    """At 3 ranks (the blocks' buckets padded) and clipped at 2 and 3: ZeRO-3's losses, the
    compute shards alone on the "device", the fp32 masters and AdamW's moments in host memory,
    and the bytes sent and copied across the host link, each its formula."""
    runs = spawned(world)
    rec, zero3 = runs[(OFFLOAD, 3, clip)], runs[("optimized_zero3", 3, clip)]
    assert rec["status"] == "ok" and rec["world_size"] == world
    assert relative_diff(rec["losses"], zero3["losses"]) <= 1e-5
    assert rec["baseline"] == "optimized_zero3"
    assert_within_its_tolerance(rec, zero3)
    for key in ("device_state_mb", "host_state_mb", "host_link_mb", "comm_mb"):
        assert rec[key] == pytest.approx(rec["theory"][key], abs=0.002), key
    assert rec["comm_mb"] == zero3["comm_mb"]  # the network's bytes are ZeRO-3's
    assert rec["host_state_mb"] == pytest.approx(3 * rec["device_state_mb"], abs=0.002)  # fp32
    assert rec["state_mb"] == rec["device_state_mb"] == pytest.approx(zero3["state_mb"] / 4,
                                                                      abs=0.01)
    assert rec["device_state_mb"] + rec["host_state_mb"] == pytest.approx(  # moved, not made
        zero3["state_mb"], abs=0.02)
    assert "CPU-only" in rec["offloaded_to"]


# --- the ZeRO objects in a trainer's loop, in spawned processes ----------------------------
# Each scenario trains the tiny Llama for a few steps through one object and returns its losses
# and the loss after training (which the final weights make); one spawn per world size runs
# them all, on the world or on a sub-group, and rank 0 of each group writes what it saw.
LR, STEPS = 3e-3, 3
ZERO = {stage: getattr(STAGES[stage], f"ZeRO{stage}") for stage in (1, 2, 3)}
# what a trainer passes the README's lines as `ZeRO`
ZERO_CLASSES = {**ZERO, "offload": load_recipe(FOLDER / f"{OFFLOAD}.py").ZeRO3Offload}
README = FOLDER / "README.md"


def group_batches(group, images: bool = False, steps: int = STEPS
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of each step's global batch, split among the ranks of `group`: token
    sequences, or with `images` the ResNet's images and labels."""
    rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    out = []
    for step in range(steps + 1):  # the last one: the evaluation batch
        if images:
            inputs, targets = common.global_image_batch(SIZE, world * 4, step, seed=0)
        else:
            tokens = common.global_token_batch(SIZE, SIZE.seq_len, world * 4, step, seed=0)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        out.append((common.rank_slice(inputs, rank, world),
                    common.rank_slice(targets, rank, world)))
    return out


def tiny_resnet(seed: int = 0) -> common.Classifier:
    torch.manual_seed(seed)
    return common.Classifier(SIZE.resnet, common.NUM_CLASSES)


def train(kind, group=None, accum: int = 1, seed: int = 0, dtype=None,
          model_zero_grad: str | None = None, resnet: bool = False,
          evaluate_before_step: bool = False) -> dict:
    """kind: "ddp", a ZeRO stage, or "pytorch1"/"pytorch3" (optimized_zero_pytorch.py's units),
    on the tiny Llama (`resnet`: the ResNet, whose BatchNorm buffers are returned too).
    model_zero_grad: "also" calls model.zero_grad() after the optimizer's, "only" instead of
    it. evaluate_before_step: a no_grad forward (as for logging) between backward and step."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_resnet(seed) if resnet else tiny_llama(seed, dtype)
    if kind == "ddp":
        net = DDP(model, process_group=group)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    elif kind == "pytorch1":
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        topo = common.Topology(rank, rank, world, world, 1, "gloo", torch.device("cpu"))
        net, opt, _ = PYTORCH_ZERO.pytorch_zero1(model, topo, LR, group=group)
    elif kind == "pytorch3":
        net, opt, _ = PYTORCH_ZERO.pytorch_zero3(model, common.transformer_blocks(model), LR,
                                                 group=group)
    else:
        net, opt = model, ZERO[kind](model, common.transformer_blocks(model), lr=LR, group=group)
    *batches, (eval_x, eval_y) = group_batches(group, images=resnet)
    losses = []
    for inputs, targets in batches:
        if model_zero_grad != "only":
            opt.zero_grad()
        if model_zero_grad:
            model.zero_grad()
        total = 0.0
        micro = list(zip(inputs.chunk(accum), targets.chunk(accum), strict=True))
        for m, (x, y) in enumerate(micro):
            last = m == accum - 1
            with nullcontext() if kind != "ddp" or last else net.no_sync():
                loss = net(x, y) / accum
                loss.backward()
            total += loss.item()
        if evaluate_before_step:
            with torch.no_grad():
                net(eval_x, eval_y)
        opt.step()
        losses.append(total)
    with torch.no_grad():
        final = net(eval_x, eval_y).item()
    state = [v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"]
    dtypes = {p.dtype for p in model.parameters()} | set(state)
    if isinstance(kind, int):
        dtypes |= {p.dtype for p in opt.shards}
    return {"losses": losses, "final": final, "dtypes": sorted(map(str, dtypes)),
            "buffers": [b.detach().double().sum().item() for b in model.buffers()]}


def zero3_shards(group=None) -> dict:
    """ZeRO-3's sharding of the tiny GPT: this rank's slices, the buckets' values before, and
    whether the full parameters' storage is freed."""
    model, world = tiny_gpt(), torch.distributed.get_world_size(group)
    buckets = STAGES[3].partition(units(3, model), world)
    values = [torch.cat([p.detach().flatten() for p in b.params]) for b in buckets]
    param_shards, unsharded = STAGES[3].shard_params(buckets, group)
    freed = all(u.untyped_storage().nbytes() == 0 for u in unsharded) and \
        all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    return {"shards": [b.shard(param_shards, world).clone() for b in buckets],
            "values": values, "freed": freed,
            "per_rank": param_shards.numel() == sum(b.numel for b in buckets) // world}




def kept_for_backward(forward, *tracked) -> tuple[torch.Tensor, int]:
    """forward()'s result and the bytes of live tensors it leaves behind, for backward: counted
    by PyTorch's MemTracker, as common.peak_tensor_memory counts (every op's outputs, storages
    as resized). `tracked`: the modules, optimizers and tensors that live before, whose storages
    forward may view or resize (a view of an untracked one would count as new)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)

    def live() -> int:
        return tracker.get_tracker_snapshot().get(torch.device("cpu"), {}).get("Total", 0)

    with tracker:
        before = live()
        out = forward()
        return out, live() - before


def zero3_under_bf16_autocast() -> dict:
    """ZeRO-3 gathering in bf16 (param_dtype) on a tiny Llama of 4 blocks under bf16 autocast,
    one sequence of 8 tokens a rank (bf16 is slow on this CPU): after a first step, one step's
    bytes sent by collective and dtype, what its forward leaves for backward, and a step's peak
    split; beside them the theory, and what the same forward on a plain bf16 copy of the model
    leaves (its activations: its weights were live before)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = common.Llama(dataclasses.replace(SIZE, n_layers=4), autocast_dtype=torch.bfloat16)
    plain = copy.deepcopy(model).to(torch.bfloat16)
    opt = ZERO[3](model, common.transformer_blocks(model), lr=LR, param_dtype=torch.bfloat16)
    tokens = common.global_token_batch(SIZE, 8, world, 0, seed=0)
    x, y = (common.rank_slice(t, rank, world) for t in (tokens[:, :-1], tokens[:, 1:]))

    def step():
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()

    step()  # AdamW's state exists from here on
    opt.zero_grad()
    with common.CollectiveBytes() as sent:
        loss, kept = kept_for_backward(lambda: model(x, y), model, opt, opt.param_shards,
                                       *opt.unsharded)
        loss.backward()
    opt.step()
    _, peak = common.peak_tensor_memory(step, (model, opt), torch.device("cpu"))
    return {"kept": kept, "kept_by_plain_bf16": kept_for_backward(lambda: plain(x, y), plain)[1],
            "root_numel": opt.buckets[-1].numel, "sent": sent.by_kind, "peak": peak,
            "params_mb": common.state_split_mb(model, opt)["params_mb"],
            "theory": STAGES[3].theory(opt.buckets, world, 4, 2, 0.0),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "shard_dtypes": sorted({str(p.dtype) for p in opt.shards})}


def on_a_hf_model(kind, model_args: dict) -> dict:
    """The README's lines as written, `ZeRO` the class of `kind` (a stage, or "offload"), or
    PyTorch's DDP (kind "ddp": the reference), on hf_models.tiny_model(**model_args) seeded by
    rank: each step's loss and the loss after training, averaged over the ranks, the dtypes of
    the weights and of the optimizer's parameters and state, and whether the ranks' weights
    differed before (else matching DDP, which starts from the first rank's, would prove
    nothing)."""
    import hf_models

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(rank)
    model = hf_models.tiny_model(**model_args)
    *batches, (eval_x, eval_y) = hf_models.token_batches(STEPS + 1, rank, world)
    if kind == "ddp":  # the loss before a step is the one after the last: the evaluation
        *losses, final = hf_models.ddp_losses(model, [*batches, (eval_x, eval_y)], lr=LR)
        return {"losses": losses, "final": final}
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    every_rank = [torch.empty_like(sums) for _ in range(world)]
    torch.distributed.all_gather(every_rank, sums)
    scope, losses = {"model": model, "ZeRO": ZERO_CLASSES[kind]}, []

    def each_step():  # the loop's batches; each step's loss read once the step is done
        for batch in batches:
            yield batch
            losses.append(scope["loss"].item())

    scope["batches"] = each_step()
    exec(readme_python_block(README), scope)
    opt = scope["opt"]
    if kind != 3:  # as the README says: ZeRO3 has nothing in flight after its step
        opt.wait_for_params()
    with torch.no_grad():
        losses.append(hf_models.hf_loss(model, eval_x, eval_y).item())
    mean = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    dtypes = {p.dtype for p in model.parameters()} | {
        t.dtype for g in opt.param_groups for t in g["params"]} | {
        v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    return {"losses": (mean[:-1] / world).tolist(), "final": (mean[-1] / world).item(),
            "dtypes": sorted(map(str, dtypes)),
            "seeded_apart": not torch.equal(every_rank[0], every_rank[1])}


def readme_scenarios() -> dict:
    """The README's lines with each class on each of hf_models.readme_models(), beside DDP's
    run of the same model: one reference a model, shared by the four classes."""
    import hf_models  # transformers: imported by the processes that use it, not every spawn

    return {f"readme {kind} {name}": functools.partial(on_a_hf_model, kind, model_args)
            for name, model_args in hf_models.readme_models().items()
            for kind in ("ddp", 1, 2, 3, "offload")}


def scenarios(world: int, rank: int) -> dict:
    """name -> a call returning this rank's result; every rank calls them in the same order."""
    calls = {"ddp": lambda: train("ddp"), "ddp accum": lambda: train("ddp", accum=2)}
    for k in (1, 2, 3):
        calls[f"zero{k}"] = lambda k=k: train(k)
        calls[f"zero{k} accum"] = lambda k=k: train(k, accum=2)
        calls[f"zero{k} seeded by rank"] = lambda k=k: train(k, seed=rank)
    if world == 2:
        calls["ddp bf16"] = lambda: train("ddp", dtype=torch.bfloat16)
        calls["ddp resnet"] = lambda: train("ddp", resnet=True)
        for k in (1, 2, 3):
            calls[f"zero{k} bf16"] = lambda k=k: train(k, dtype=torch.bfloat16)
            calls[f"zero{k} resnet"] = lambda k=k: train(k, seed=rank, resnet=True)
            calls[f"zero{k} model.zero_grad also"] = lambda k=k: train(k, model_zero_grad="also")
            calls[f"zero{k} model.zero_grad only"] = lambda k=k: train(k, model_zero_grad="only")
            calls[f"zero{k} evaluated before step"] = lambda k=k: train(
                k, evaluate_before_step=True)
        for k in (1, 3):
            calls[f"pytorch{k} seeded by rank"] = lambda k=k: train(f"pytorch{k}", seed=rank)
        calls["zero3 shards"] = zero3_shards
        calls["zero3 bf16 autocast"] = zero3_under_bf16_autocast
        calls.update(readme_scenarios())
    return calls


def _run_units(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world,
                                         timeout=__import__("datetime").timedelta(seconds=60))
    torch.set_num_threads(1)
    results = {}

    def attempt(name, call):
        try:
            results[name] = call()
        except Exception as error:  # recorded: the test that asked for it fails with it
            results[name] = {"error": f"{type(error).__name__}: {error}"}

    for name, call in scenarios(world, rank).items():
        attempt(name, call)
    if world == 3:  # ranks {0, 1} as a group of their own, rank 2 alone in another
        pair, alone = torch.distributed.new_group([0, 1]), torch.distributed.new_group([2])
        for k in (1, 2, 3):
            attempt(f"zero{k} on a sub-group", lambda k=k: train(k, group=pair if rank < 2
                                                                 else alone))
    torch.save(results, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def units_run(spawned_world):
    """world size -> [each rank's {scenario: result}], from the world's one spawn."""
    done = {}

    def at(world: int) -> list[dict]:
        if world not in done:
            out = spawned_world(world)
            done[world] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
        return done[world]

    return at


def result(runs: list[dict], name: str, rank: int = 0) -> dict:
    got = runs[rank][name]
    assert "error" not in got, f"{name}: {got['error']}"
    return got


def assert_trains_like(got: dict, want: dict, rel: float = 1e-5, what: str = "") -> None:
    assert relative_diff(got["losses"], want["losses"]) <= rel, what
    assert relative_diff([got["final"]], [want["final"]]) <= rel, what


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("loop", ["", " accum", " seeded by rank"])
def test_each_zero_object_trains_like_ddp_in_a_plain_loop(units_run, world, stage, loop):
    """opt.zero_grad(); loss.backward(); opt.step() (" accum": two backward passes a step,
    against DDP under no_sync; " seeded by rank": every rank's model initialised apart)."""
    runs = units_run(world)
    want = result(runs, "ddp accum" if loop == " accum" else "ddp")
    assert_trains_like(result(runs, f"zero{stage}{loop}"), want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_model_stays_bf16_and_trains_like_ddp_in_bf16(units_run, stage):
    runs = units_run(2)
    got, want = result(runs, f"zero{stage} bf16"), result(runs, "ddp bf16")
    assert got["dtypes"] == want["dtypes"] == ["torch.bfloat16"]  # weights, shards, moments
    assert_trains_like(got, want, rel=2e-2)  # bf16 sums in another order


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_resnet_trains_like_ddp_its_batchnorm_buffers_kept_in_step(units_run, stage):
    """The ResNet's four stages as the blocks, its ranks seeded apart; the buffers broadcast
    from the first rank before each forward, as DDP does, so every rank's running statistics
    end as DDP's."""
    runs = units_run(2)
    for rank in (0, 1):
        got, want = result(runs, f"zero{stage} resnet", rank), result(runs, "ddp resnet", rank)
        assert_trains_like(got, want)
        assert len(got["buffers"]) == len(want["buffers"]) > 0
        assert torch.allclose(torch.tensor(got["buffers"]), torch.tensor(want["buffers"]),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_a_sub_group_each_object_trains_like_on_a_world_of_two(units_run, stage):
    sub, pair = units_run(3), units_run(2)
    for rank in (0, 1):
        got = result(sub, f"zero{stage} on a sub-group", rank)
        want = result(pair, f"zero{stage}", rank)
        assert got["losses"] == want["losses"] and got["final"] == want["final"]
    alone = result(sub, f"zero{stage} on a sub-group", rank=2)  # a group of one beside them
    assert len(alone["losses"]) == STEPS


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_models_own_zero_grad_works_or_raises(units_run, stage):
    """Called beside the optimizer's, model.zero_grad() changes nothing; called instead of it,
    the next backward raises rather than train on the last step's gradient."""
    runs = units_run(2)
    assert_trains_like(result(runs, f"zero{stage} model.zero_grad also"), result(runs, "ddp"))
    for rank in (0, 1):
        error = runs[rank][f"zero{stage} model.zero_grad only"].get("error", "")
        assert error.startswith("RuntimeError") and "zero_grad()" in error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_no_grad_forward_between_backward_and_step_changes_nothing(units_run, stage):
    """An evaluation (as for logging) after backward gathers the weights as they were before the
    step: the step must not leave them for the next forward to reuse."""
    runs = units_run(2)
    assert_trains_like(result(runs, f"zero{stage} evaluated before step"), result(runs, "ddp"))


@pytest.mark.parametrize("stage", [1, 3])
def test_pytorchs_zero_on_ranks_seeded_apart_trains_like_ddp(units_run, stage):
    """fully_shard keeps each rank's slice of its own weights: pytorch_zero3 first broadcasts
    the first rank's (pytorch_zero1's DDP does so itself)."""
    runs = units_run(2)
    for rank in (0, 1):
        assert_trains_like(result(runs, f"pytorch{stage} seeded by rank", rank),
                           result(runs, "ddp", rank))


def test_zero3_keeps_one_slice_per_rank_and_frees_the_full_parameters(units_run):
    ranks = [result(units_run(2), "zero3 shards", r) for r in (0, 1)]
    assert all(r["freed"] and r["per_rank"] for r in ranks)
    for i, values in enumerate(ranks[0]["values"]):  # the slices, put together, are the bucket
        joined = torch.cat([r["shards"][i] for r in ranks])
        assert torch.equal(joined[:values.numel()], values) and not joined[values.numel():].any()


@pytest.mark.parametrize("stage", [1, 2, 3, "offload"])
def test_the_readmes_lines_train_every_hf_family_like_ddp_from_the_first_ranks_weights(
        units_run, stage):
    """The README's "Use it in your trainer" block as written, `ZeRO` the stage's class, on 2
    ranks whose models were seeded apart: on each of hf_models.CASES (Llama, Qwen2, Mistral;
    sdpa and eager) and on Phi-3's fused projections and a Llama with a scaled rotary, each
    step's loss and the loss after training are DDP's, to 1e-5: every rank started from the
    first rank's weights, as DDP's do."""
    import hf_models

    runs = units_run(2)
    for name in [*map(str, hf_models.CASES), *hf_models.UNSUPPORTED]:
        got, want = result(runs, f"readme {stage} {name}"), result(runs, f"readme ddp {name}")
        assert got["seeded_apart"], name
        assert len(got["losses"]) == STEPS and got["dtypes"] == ["torch.float32"], name
        assert_trains_like(got, want, what=name)


@pytest.mark.parametrize("stage", [1, 2, 3, "offload"])
def test_the_readmes_lines_keep_a_bf16_model_of_each_family_bf16(units_run, stage):
    import hf_models

    runs = units_run(2)
    for case in (case for case in hf_models.CASES if case.attn == "sdpa"):
        name = f"{case} bf16"
        got, want = result(runs, f"readme {stage} {name}"), result(runs, f"readme ddp {name}")
        assert got["dtypes"] == ["torch.bfloat16"], name  # weights, shards, AdamW's moments
        assert_trains_like(got, want, rel=2e-2, what=name)  # bf16 sums in another order


def test_zero3_under_bf16_autocast_holds_and_sends_what_its_theory_says(units_run):
    """Gathered in bf16 (param_dtype), the weights forward uses are the gathered ones: what
    forward leaves for backward is the root unit, in bf16, and the activations a plain bf16 model
    keeps, no bf16 copy of any weight (with fp32 gathers autocast saved one of every Linear
    weight, which freeing the gathered blocks did not free); the peak holds the shards and at
    most the root and two blocks in bf16; the all-gathers send bf16, the reduce-scatters fp32,
    as the theory's bytes."""
    for rank in (0, 1):
        got = result(units_run(2), "zero3 bf16 autocast", rank)
        assert got["kept"] == got["kept_by_plain_bf16"] + 2 * got["root_numel"]
        theory = got["theory"]
        # the gathered weights at the step's peak: at most the root and two blocks in bf16 (fp32
        # gathers held twice that); which of them are still live when the peak falls depends on
        # when gloo's reduce-scatters complete, so the bound is the theory, not each run's value
        gathered = got["peak"]["params"] - got["params_mb"]
        root_mb = 2 * got["root_numel"] / 2**20
        assert root_mb <= gathered <= theory["gathered_mb"] * (1 + 1e-6), (gathered, theory)
        # on gloo the reduce-scatter is an all-to-all (common.reduce_scatter)
        assert set(got["sent"]) == {"allgather bfloat16", "alltoall float32"}
        assert sum(got["sent"].values()) / 2**20 == pytest.approx(theory["comm_mb"])
        assert got["dtypes"] == ["torch.bfloat16"] and got["shard_dtypes"] == ["torch.float32"]
