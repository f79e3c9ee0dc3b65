"""04_zero's Muon scripts: the pure parts in-process (Newton-Schulz, the learning-rate scale and
the momentum against torch.optim.Muon's own; the FLOPs formula against FlopCounterMode; matrices
dealt out to owners; the flat layout by owner; FSDP2's row split; the planner's rows), bad input
in one line, and in spawned gloo processes at 2, 3 and 4 ranks (odd worlds: uneven ownership):
baseline_muon, optimized_zero1_muon and optimized_fsdp_muon's own main() on the tiny GPT and
Llama, each run's losses the baseline's to 1e-5 and its state and bytes its theory; then, in the
spawn of 2, the README's lines with DistributedMuon and with ShardedMuon on tiny transformers
Llama, Qwen2 and Mistral models (sdpa and eager, tied and untied heads), Phi-3 (fused
projections) and a Llama with a scaled rotary, seeded apart, against DDP with torch.optim.Muon
on the same model."""

import argparse
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.utils.flop_counter import FlopCounterMode

import common
from helpers import TINY, as_rank, load_recipe, readme_python_block
from report import plan_input, planner

FOLDER = common.ROOT / "04_zero"
BASELINE = load_recipe(FOLDER / "baseline_muon.py")
ZERO1 = load_recipe(FOLDER / "optimized_zero1_muon.py")
FSDP = load_recipe(FOLDER / "optimized_fsdp_muon.py")
SIZE = common.SIZES["tiny"]
README = FOLDER / "README.md"


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return common.GPT(SIZE, SIZE.seq_len) if family == "gpt" else common.Llama(SIZE)


# --- the update, op for op torch.optim.Muon's ------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 64), (192, 64), (64, 176), (1, 64)])
def test_newton_schulz_is_torchs_to_the_bit(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    theirs = _zeropower_via_newtonschulz(x, FSDP.NS_COEFFICIENTS, 5, FSDP.NS_EPS)
    ours = FSDP.newton_schulz(x, 5)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    if shape[0] > 1:  # it orthogonalizes: most singular values near 1 (Keller Jordan's post:
        # roughly 0.7 to 1.2), none above; a random matrix's smallest stay below
        singular = torch.linalg.svdvals(ours.float())
        assert singular.median() > 0.7 and singular.max() < 1.3


@pytest.mark.parametrize("shape", [(64, 64), (192, 64), (64, 176)])
def test_the_learning_rate_scale_is_torchs_match_rms_adamw(shape):
    assert FSDP.muon_lr(3e-3, torch.Size(shape)) == \
        pytest.approx(_adjust_lr(3e-3, "match_rms_adamw", torch.Size(shape)), rel=1e-15)


def test_the_owners_update_is_torch_optim_muons_step_to_the_bit():
    """ShardedMuon.update and the weight decay, applied as step() applies them, against
    torch.optim.Muon with the folder's settings, three steps on one matrix."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 64))
    ours = weight.detach().clone()
    theirs = torch.optim.Muon([weight], lr=3e-3, **BASELINE.MUON)
    opt = FSDP.ShardedMuon.__new__(FSDP.ShardedMuon)  # the update alone, no process group
    opt.momentum = {weight: torch.zeros_like(weight)}
    for _ in range(3):
        grad = torch.randn(48, 64)
        weight.grad = grad
        theirs.step()
        update = opt.update(weight, grad)
        ours.mul_(1 - 3e-3 * BASELINE.MUON["weight_decay"])
        ours.add_(update, alpha=-FSDP.muon_lr(3e-3, weight.shape))
    assert torch.equal(ours, weight.detach())


@pytest.mark.parametrize("shape", [(64, 64), (192, 64), (64, 176)])
def test_the_newton_schulz_flops_are_what_flop_counter_mode_counts(shape):
    with FlopCounterMode(display=False) as counted:
        _zeropower_via_newtonschulz(torch.randn(shape), FSDP.NS_COEFFICIENTS, 5, FSDP.NS_EPS)
    assert counted.get_total_flops() == BASELINE.newton_schulz_flops(shape, 5)


# --- the matrices, their owners and the flat layout -------------------------------------------
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(family):
    model = tiny(family)
    matrices = BASELINE.hidden_matrices(model, common.transformer_blocks(model))
    in_blocks = {p for b in common.transformer_blocks(model) for p in b.parameters()}
    assert matrices and all(p.ndim == 2 and p in in_blocks for p in matrices)
    assert {id(p) for p in matrices} == {id(p) for p in in_blocks if p.ndim == 2}
    for table in (common.input_embedding(model), common.output_head(model)):
        assert all(p is not table.weight for p in matrices)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_matrix_has_one_owner_and_the_newton_schulz_work_is_balanced(family, world):
    model = tiny(family)
    matrices = BASELINE.hidden_matrices(model, common.transformer_blocks(model))
    owned = ZERO1.deal_out(matrices, world)
    flat = [p for params in owned for p in params]
    assert sorted(map(id, flat)) == sorted(map(id, matrices))
    flops = [sum(BASELINE.newton_schulz_flops(p.shape, 5) for p in params) for params in owned]
    assert min(flops) > 0  # every rank owns a matrix
    # longest-processing-time-first's bound: at most 4/3 of the best split's busiest rank
    assert max(flops) <= 4 / 3 * max(sum(flops) / world, max(
        BASELINE.newton_schulz_flops(p.shape, 5) for p in matrices))


@pytest.mark.parametrize("world", [9, 40])
def test_a_world_larger_than_the_matrices_is_refused_in_one_line(world):
    model = tiny("gpt")
    matrices = BASELINE.hidden_matrices(model, common.transformer_blocks(model))  # 8
    for deal_out in (ZERO1.deal_out, FSDP.deal_out):  # the FSDP script's copy
        with pytest.raises(ValueError, match=f"^8 Muon matrices for {world} ranks: a rank would "
                                             "own none; run at most 8 ranks$"):
            deal_out(matrices, world)


def test_the_scripts_refuse_a_world_larger_than_the_matrices_in_one_line(tmp_path):
    """A dry run of 16 ranks of the tiny GPT's 8 matrices: exit 2 and the one line, each
    script, a `failed` record with the reason."""
    for script in ("optimized_zero1_muon", "optimized_fsdp_muon"):
        proc = run_script(script, ["--dry-run", "16"], tmp_path / f"{script}.jsonl")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip() == f"{script}.py: error: 8 Muon matrices for 16 ranks: a " \
            "rank would own none; run at most 8 ranks"
        rec, = common.load_results(tmp_path / f"{script}.jsonl")
        assert rec["status"] == "failed" and "run at most 8 ranks" in rec["reason"]


def run_script(script: str, flags: list[str], results) -> subprocess.CompletedProcess:
    """`script` at `tiny` with `flags`, in a fresh Python on the CPU."""
    return subprocess.run([sys.executable, str(FOLDER / f"{script}.py"), "--size", "tiny",
                           *flags, "--results", str(results)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("cls", ["DistributedMuon", "ShardedMuon"])
def test_a_muon_parameter_that_is_not_a_matrix_is_refused_in_one_line(cls):
    model = tiny("llama")
    norm = common.transformer_blocks(model)[0].input_layernorm.weight
    recipe = ZERO1 if cls == "DistributedMuon" else FSDP
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.input_layernorm\.weight has shape "
                                         r"\(64,\): Muon orthogonalizes matrices; give it only "
                                         r"2-D weights$"):
        getattr(recipe, cls)(model, common.transformer_blocks(model), matrices=[norm])


@pytest.mark.parametrize("world", [2, 3])
def test_the_flat_layout_holds_each_owners_matrices_then_zero1s_slices_of_the_rest(world):
    model = tiny("gpt")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    matrices = BASELINE.hidden_matrices(model, common.transformer_blocks(model))
    owned = ZERO1.deal_out(matrices, world)
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    flat_params, flat_grads, mine, others = ZERO1.flatten_by_owner(owned, rest)
    assert mine.per_rank == max(sum(p.numel() for p in params) for params in owned)
    assert others.offset == world * mine.per_rank and others.per_rank * world - \
        sum(p.numel() for p in rest) in range(world)  # padded by under N values
    assert flat_params.numel() == others.offset + world * others.per_rank

    def where(p):  # p's first and last value in the flat buffer
        start = (p.data_ptr() - flat_params.data_ptr()) // p.element_size()
        return start, start + p.numel() - 1

    for rank, params in enumerate(owned):  # inside the owner's slice, whole
        first, last = mine.offset + rank * mine.per_rank, mine.offset + (rank + 1) * mine.per_rank
        assert all(first <= where(p)[0] and where(p)[1] < first + mine.per_rank
                   for p in params) and last == first + mine.per_rank
    assert all(where(p)[0] >= others.offset for p in rest)
    for p in model.parameters():  # each gradient where its parameter is, in the other buffer
        assert p.grad.data_ptr() - flat_grads.data_ptr() == p.data_ptr() - flat_params.data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    assert model.head.weight is model.tok_emb.weight  # still tied


@pytest.mark.parametrize("rows", [1, 5, 64, 65, 192])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_row_counts_are_fsdp2s_shard0_chunks(rows, world):
    chunks = [len(c) for c in torch.arange(rows).chunk(world)]
    assert FSDP.row_counts(rows, world) == chunks + [0] * (world - len(chunks))


# --- the planner's Muon rows ------------------------------------------------------------------
def plan_args(**flags) -> argparse.Namespace:
    """The planner's flags for a 7B Llama on 8 GPUs of 80 GB (test_plan.py's case)."""
    return argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, "params": 7e9, "gpus": 8,
                                 "layers": 32, "hidden": 4096, "vocab": 32000, "seq_len": 4096,
                                 "llama": True, **flags})


def test_the_planner_has_muon_rows_only_with_muon_and_they_divide_the_newton_schulz_work():
    adamw = {r["strategy"] for r in planner.plan_strategies(plan_args())}
    muon_rows = planner.plan_strategies(plan_args(muon=True))
    assert {r["strategy"] for r in muon_rows} == {"DDP + Muon", "ZeRO-1 + Muon", "FSDP + Muon"}
    assert not adamw & {r["strategy"] for r in muon_rows}
    entries = {e["strategy"]: e for e in planner.planned_strategies()}
    plan = plan_input.plan_input(plan_args(muon=True), 1, 1)
    ddp, zero1, fsdp = (entries[s]["figures"](plan) for s in
                        ("DDP + Muon", "ZeRO-1 + Muon", "FSDP + Muon"))
    assert zero1["optimizer_flops"] == pytest.approx(ddp["optimizer_flops"] / 8)
    assert fsdp["optimizer_flops"] == pytest.approx(ddp["optimizer_flops"] / 8)
    assert fsdp["state"] < zero1["state"] < ddp["state"]
    shapes = BASELINE.planned_matrix_shapes(plan)  # a Llama's 7 matrices a layer
    assert len(shapes) == 7 * plan.layers and (plan.ffn, plan.hidden) in shapes
    # the Newton-Schulz FLOPs are priced: every GPU repeating all of them is the slowest step
    step = {r["strategy"]: r["step_s"] for r in muon_rows if not r["checkpointing"]}
    assert step["DDP + Muon"] > step["ZeRO-1 + Muon"]


def test_the_planners_matrices_are_the_models():
    """At the tiny Llama's and GPT's shapes, planned_matrix_shapes lists what hidden_matrices
    finds (the GPT's fused qkv as three)."""
    for family in ("gpt", "llama"):
        model = tiny(family)
        found = sorted(tuple(p.shape) for p in
                       BASELINE.hidden_matrices(model, common.transformer_blocks(model)))
        plan = plan_input.plan_input(plan_args(
            params=sum(p.numel() for p in model.parameters()), layers=SIZE.n_layers,
            hidden=SIZE.d_model, vocab=SIZE.vocab_size, seq_len=SIZE.seq_len,
            llama=family == "llama", heads=SIZE.n_heads,
            kv_heads=SIZE.n_kv_heads if family == "llama" else SIZE.n_heads), 1, 1)
        planned = sorted(BASELINE.planned_matrix_shapes(plan))
        if family == "gpt":  # each layer's fused qkv as q, k and v
            h = SIZE.d_model
            found = sorted([s for s in found if s != (3 * h, h)] + [(h, h)] * 3 * SIZE.n_layers)
        # as Newton-Schulz sees them: a down projection (h x ffn) costs an up one's
        assert sorted(tuple(sorted(s)) for s in planned) == \
            sorted(tuple(sorted(s)) for s in found), family


# --- the three scripts at 2, 3 and 4 ranks, and the README's lines, in spawned processes -----
SCRIPTS = ("baseline_muon", "optimized_zero1_muon", "optimized_fsdp_muon")
RUNS = [(script, family) for family in ("gpt", "llama") for script in SCRIPTS]
WORLDS = (2, 3, 4)


def _run_the_world(rank: int, world: int, port: int, out: str) -> None:
    as_rank(rank, world)
    for k, (script, family) in enumerate(RUNS):
        os.environ["MASTER_PORT"] = str(port + k)  # a fresh store for each run's group
        path = FOLDER / f"{script}.py"
        sys.argv = [str(path), *TINY, "--model", family, "--results", f"{out}/results.jsonl"]
        common.run_main(load_recipe(path).main)
    if world == 2:
        _readme_scenarios(rank, world, port + len(RUNS), out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world size -> {(script, model): record}, and at 2 the README scenarios' results."""
    done = {}

    def at(world: int) -> tuple[dict, dict]:
        if world not in done:
            out = tmp_path_factory.mktemp(f"muon{world}")
            port = common.free_port(block=len(RUNS) + 1)
            mp.spawn(_run_the_world, args=(world, port, str(out)), nprocs=world)
            runs = {(r["script"], r["model"]): r
                    for r in common.load_results(out / "results.jsonl")}
            assert len(runs) == len(RUNS)
            scenarios = torch.load(out / "readme.pt") if world == 2 else {}
            done[world] = runs, scenarios
        return done[world]

    return at


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_ownership_trains_like_ddp_with_torchs_muon_and_holds_its_theory(spawned, world, family,
                                                                         script):
    runs, _ = spawned(world)
    base, rec = runs[("baseline_muon", family)], runs[(script, family)]
    assert base["status"] == rec["status"] == "ok" and rec["world_size"] == world
    assert rec["baseline"] == "baseline_muon" and rec["loss_tolerance"] == 1e-5
    assert relative_diff(rec["losses"], base["losses"]) <= 1e-5
    for key in ("state_mb", "params_mb", "grads_mb", "optim_mb"):
        assert rec[key] == pytest.approx(rec["theory"][key], abs=0.01), key
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=0.002)
    theory, every = rec["theory"], base["theory"]["ns_gflop_rank"]
    assert theory["ns_gflop_all"] == pytest.approx(every, abs=0.002)  # the baseline's, each rank
    assert sum(theory["ns_gflop_by_rank"]) == pytest.approx(every, abs=0.002)
    assert theory["ns_gflop_rank"] < every / world * 4 / 3 + 0.002
    assert rec["optimizer_ms"] > 0 and base["optimizer_ms"] > 0
    # Muon's momentum for the owned matrices only, Adam's moments for the owned rest
    assert rec["optim_mb"] < base["optim_mb"] * (0.75 if world == 2 else 0.6)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_baseline_holds_its_theory_and_runs_every_matrix_on_every_rank(spawned, family):
    runs, _ = spawned(2)
    rec = runs[("baseline_muon", family)]
    for key in ("state_mb", "params_mb", "grads_mb", "optim_mb", "comm_mb"):
        assert rec[key] == pytest.approx(rec["theory"][key], abs=0.01), key
    model = tiny(family)
    matrices = BASELINE.hidden_matrices(model, common.transformer_blocks(model))
    assert rec["theory"]["ns_gflop_rank"] == pytest.approx(
        sum(BASELINE.newton_schulz_flops(p.shape, 5) for p in matrices) / 1e9, abs=0.001)


def test_fsdp_muons_all_to_alls_send_less_than_gathering_every_gradient_to_everyone(spawned):
    runs, _ = spawned(4)
    theory = runs[("optimized_fsdp_muon", "llama")]["theory"]
    assert theory["comm_mb"] == pytest.approx(theory["fsdp_comm_mb"] + theory["muon_comm_mb"],
                                              abs=0.002)
    assert theory["muon_comm_mb"] < theory["allgather_comm_mb_avoided"]


# The README's lines: each class on each fp32 model of hf_models.readme_models(), beside DDP
# with torch.optim.Muon
LR, STEPS = 3e-3, 3


def _on_a_hf_model(kind: str, model_args: dict) -> dict:
    """The README's lines for `kind` ("zero1": DistributedMuon, "fsdp": ShardedMuon), or the
    reference (DDP + torch.optim.Muon, "ddp"), on a tiny transformers model seeded by rank:
    each step's loss and the loss after, averaged over the ranks, and whether the ranks'
    weights differed before."""
    import hf_models

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = hf_models.tiny_model(**model_args)
    apart = hf_models.seeded_apart(model)
    *batches, (eval_x, eval_y) = hf_models.token_batches(STEPS + 1, rank, world)
    losses = []
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = BASELINE.MuonWithAdamW(model, BASELINE.hidden_matrices(
            model, list(model.model.layers)), LR)
        for inputs, targets in batches:
            opt.zero_grad()
            loss = hf_models.hf_loss(ddp, inputs, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    else:
        scope = {"model": model, "DistributedMuon": ZERO1.DistributedMuon,
                 "ShardedMuon": FSDP.ShardedMuon}

        def each_step():  # the loop's batches; each step's loss read once the step is done
            for batch in batches:
                yield batch
                losses.append(scope["loss"].item())

        scope["batches"] = each_step()
        exec(readme_python_block(README, HEADINGS[kind]), scope)
    with torch.no_grad():
        final = hf_models.hf_loss(model, eval_x, eval_y).item()
    mean = torch.tensor([*losses, final], dtype=torch.float64)
    dist.all_reduce(mean)
    return {"losses": (mean[:-1] / world).tolist(), "final": (mean[-1] / world).item(),
            "seeded_apart": apart}


HEADINGS = {"zero1": "### Use it in your trainer: `DistributedMuon`",
            "fsdp": "### Use it in your trainer: `ShardedMuon` on FSDP2"}


def _readme_scenarios(rank: int, world: int, port: int, out: str) -> None:

    os.environ["MASTER_PORT"] = str(port)
    import hf_models

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, model_args in hf_models.readme_models(bf16=False).items():
        for kind in ("ddp", "zero1", "fsdp"):
            results[(name, kind)] = _on_a_hf_model(kind, model_args)
    if rank == 0:
        torch.save(results, f"{out}/readme.pt")
    dist.destroy_process_group()


def pytest_generate_tests(metafunc):
    """The README test's models, listed at collection in pytest's process alone: a spawned rank
    imports this module too, and transformers costs it seconds."""
    if "readme_model" in metafunc.fixturenames:
        import hf_models

        metafunc.parametrize("readme_model", list(hf_models.readme_models(bf16=False)))


@pytest.mark.parametrize("kind", ["zero1", "fsdp"])
def test_the_readmes_lines_train_a_transformers_model_like_ddp_with_torchs_muon(
        spawned, kind, readme_model):
    _, scenarios = spawned(2)
    mine, ddp = scenarios[(readme_model, kind)], scenarios[(readme_model, "ddp")]
    assert mine["seeded_apart"]  # else matching DDP's start from rank 0 would prove nothing
    assert relative_diff([*mine["losses"], mine["final"]], [*ddp["losses"], ddp["final"]]) \
        <= 1e-5

