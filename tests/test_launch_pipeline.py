"""Launch tests: 05_pipeline with CPU processes at `tiny`.

Launches shared through one module-scoped fixture, half on each decoder, the runs of a world
forked from one Python (`python -m report smoke`, as `make smoke` runs them): torch imported
once a world, not once a rank and once more for torchrun's agent. The GPT (tied head):
the naive baseline, GPipe, DualPipeV, torch.distributed.pipelining's GPipe and DualPipeV,
DualPipeV at 3 ranks on a deeper model. The Llama (untied head): the naive baseline, 1F1B,
torch's 1F1B, 1F1B at 3 ranks with an odd m, DualPipe at 4 ranks. Each is checked against the
unsplit model trained in this process on the same batches, and against its model's baseline.
"""

import argparse
import functools
import sys
from pathlib import Path

import pytest
import torch

import common
import helpers
from helpers import (
    TINY,
    assert_bad_input_is_one_line,
    assert_within_its_tolerance,
    forked_runs,
    load_recipe,
)

FOLDER = common.ROOT / "05_pipeline"
# a record's timeline, read by field: the baseline holds it, the pipelines copy it
TimedAction = load_recipe(FOLDER / "baseline_pipeline.py").TimedAction
M = 4  # micro-batches at tiny, 2 sequences each
DEEPER = ["--size", "small", "--seq-len", "16"]  # 8 layers: DualPipeV's 6 stages at 3 ranks
LLAMA = ["--model", "llama"]
RUNS = {  # name: script, processes, flags
    "baseline_pipeline": ("baseline_pipeline", 2, []),
    "optimized_pipeline_gpipe": ("optimized_pipeline_gpipe", 2, []),
    "optimized_pipeline_dualpipev": ("optimized_pipeline_dualpipev", 2, []),
    "torch gpipe": ("optimized_pipeline_pytorch", 2, []),
    "torch dualpipev": ("optimized_pipeline_pytorch", 2, ["--schedule", "dualpipev"]),
    "dualpipev at 3 ranks": ("optimized_pipeline_dualpipev", 3,
                             [*DEEPER, "--microbatches", "6", "--batch-size", "6"]),
    "baseline_pipeline llama": ("baseline_pipeline", 2, LLAMA),
    "optimized_pipeline_1f1b llama": ("optimized_pipeline_1f1b", 2, LLAMA),
    "torch 1f1b llama": ("optimized_pipeline_pytorch", 2, [*LLAMA, "--schedule", "1f1b"]),
    "1f1b at 3 ranks llama": ("optimized_pipeline_1f1b", 3,
                              [*LLAMA, "--microbatches", "3", "--batch-size", "6"]),
    "dualpipe at 4 ranks llama": ("optimized_pipeline_dualpipe", 4,
                                  [*LLAMA, "--microbatches", "8", "--batch-size", "8"]),
    # interleaved (v 2) and zero-bubble: p 2 and 4, m 4 and 8, both decoders, beside torch's
    "optimized_pipeline_interleaved": ("optimized_pipeline_interleaved", 2, []),
    "torch interleaved": ("optimized_pipeline_pytorch", 2, ["--schedule", "interleaved"]),
    "optimized_pipeline_zb llama": ("optimized_pipeline_zb", 2, LLAMA),
    "torch zb llama": ("optimized_pipeline_pytorch", 2, [*LLAMA, "--schedule", "zb"]),
    "zbv": ("optimized_pipeline_zb", 2, ["--zbv"]),
    "torch zbv": ("optimized_pipeline_pytorch", 2, ["--schedule", "zbv"]),
    # m 8, the scripts' default: a batch of 8 and no --microbatches (smoke_line)
    "zb m 8": ("optimized_pipeline_zb", 2, ["--batch-size", "8"]),
    "interleaved m 8 llama": ("optimized_pipeline_interleaved", 2, [*LLAMA, "--batch-size", "8"]),
    "interleaved at 4 ranks llama": ("optimized_pipeline_interleaved", 4,
                                     [*LLAMA, *DEEPER, "--batch-size", "8"]),
    "zb at 4 ranks": ("optimized_pipeline_zb", 4, []),
    "zbv at 4 ranks llama": ("optimized_pipeline_zb", 4, [*LLAMA, *DEEPER, "--zbv"])}
SCHEDULES = [name for name in RUNS if not name.startswith("baseline")]


def decoder(rec: dict) -> common.Decoder:
    size = common.SIZES[rec["size"]]
    return common.Llama(size) if rec["model"] == "llama" else common.GPT(size, rec["seq_len"])


def baseline_of(runs: dict, rec: dict) -> dict:
    """The naive baseline's run of the same model."""
    return runs["baseline_pipeline llama" if rec["model"] == "llama" else "baseline_pipeline"][0]


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))


def planned_schedule(name: str, flags: list[str], p: int, m: int) -> list:
    """The action lists the script `name` runs with `flags` on p ranks: its own schedule's."""
    recipe = load_recipe(FOLDER / f"{name}.py")
    if name == "optimized_pipeline_interleaved":
        return recipe.schedule(p, m, 2)  # --virtual-stages' default
    return recipe.zbv_schedule(p, m) if "--zbv" in flags else recipe.schedule(p, m)


def stages_a_rank(name: str, flags: list[str]) -> int:
    """Two for DualPipeV, interleaving (v 2) and ZBV; one for the others."""
    return 2 if name in ("optimized_pipeline_dualpipev", "optimized_pipeline_interleaved") \
        or "--zbv" in flags else 1


def asked_microbatches(flags: list[str]) -> int:
    """The m a run's flags ask for: its --microbatches; else, where it sets its own batch, the
    scripts' default 8 (a flag at its default is no part of the run's name: smoke would not find
    its record); else smoke_line's M."""
    if "--microbatches" in flags:
        return int(flags[flags.index("--microbatches") + 1])
    return 8 if "--batch-size" in flags else M


def smoke_line(name: str) -> str:
    """RUNS[name] as a run of `python -m report smoke`: the script, M micro-batches of 2
    sequences unless its flags set the batch (a flag given twice would name the run otherwise
    than its record does, and smoke would not find the record), its flags."""
    script, _, flags = RUNS[name]
    batch = [] if "--batch-size" in flags else \
        [f"{flag} {value}" for flag, value in [("--batch-size", 2 * M), ("--microbatches", M)]
         if flag not in flags]
    return " ".join([f"05_pipeline/{script}.py", *batch, *flags])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each of RUNS: its record and its console (both ranks' output)."""
    found = {}
    for nproc in sorted({n for _, n, _ in RUNS.values()}):
        names = [name for name, (_, n, _) in RUNS.items() if n == nproc]
        runs = [smoke_line(name) for name in names]
        out = tmp_path_factory.mktemp(f"world{nproc}")
        records = forked_runs(runs, nproc, out, TINY)
        for name, run, rec in zip(names, runs, records, strict=True):
            script, *own = run.split()  # the log smoke names after them
            log = out / "smoke" / "logs" / (Path(script).stem + "".join(own) + ".log")
            found[name] = (rec, log.read_text())
    return {name: found[name] for name in RUNS}


def unsplit_losses(rec):
    """The whole model on one process, the same batches, AdamW: what every schedule must match
    (trained once for each setup: most schedules share their model, size and batch)."""
    return list(_unsplit_losses(rec["size"], rec["seq_len"], rec["batch_size"], rec["model"]))


@functools.cache
def _unsplit_losses(size: str, seq_len: int, batch_size: int, model_name: str
                    ) -> tuple[float, ...]:
    args = common.parser(None).parse_args([*TINY, "--size", size, "--seq-len", str(seq_len),
                                           "--batch-size", str(batch_size), "--model",
                                           model_name])
    args.dtype = "fp32"
    topo = common.Topology(0, 0, 1, 1, 1, "gloo", torch.device("cpu"))
    model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return tuple(losses)


@pytest.mark.parametrize("script", list(RUNS))
def test_every_schedule_trains_the_unsplit_model(runs, script):
    rec, _ = runs[script]
    assert rec["status"] == "ok" and rec["world_size"] == RUNS[script][1]
    assert rec["model"] == ("llama" if "llama" in script else "gpt")
    assert max_relative_difference(rec["losses"], unsplit_losses(rec)) <= 1e-5
    size = common.SIZES[rec["size"]]
    assert rec["params"] == (helpers.llama_param_count(size) if rec["model"] == "llama"
                             else helpers.gpt_param_count(size, rec["seq_len"]))  # all stages


@pytest.mark.parametrize("script, stages_of", [
    ("optimized_pipeline_1f1b llama", lambda r, p: [r]),
    ("1f1b at 3 ranks llama", lambda r, p: [r]),
    ("optimized_pipeline_dualpipev", lambda r, p: [r, 2 * p - 1 - r]),
    ("dualpipev at 3 ranks", lambda r, p: [r, 2 * p - 1 - r]),
    ("interleaved at 4 ranks llama", lambda r, p: [r, r + p]),
    ("zbv at 4 ranks llama", lambda r, p: [r, 2 * p - 1 - r])])
def test_state_is_the_busiest_ranks_every_stage(runs, script, stages_of):
    rec, _ = runs[script]
    p = rec["world_size"]
    stages = decoder(rec).pipeline_stages(p * len(stages_of(0, p)))
    held = [{id(q): q.numel() for s in stages_of(r, p) for layer in stages[s]
             for q in layer.parameters()} for r in range(p)]  # a tied weight once a rank
    busiest = max(sum(params.values()) for params in held)
    assert rec["state_mb"] == pytest.approx(16 * busiest / 2**20, rel=0.01)  # AdamW, fp32


@pytest.mark.parametrize("script", [name for name in SCHEDULES if RUNS[name][1] == 2])
def test_every_schedule_matches_the_baseline_of_its_model(runs, script):
    """To float rounding, and within the tolerance the report checks (the same batch at 2 ranks:
    the baseline's records compare)."""
    rec = runs[script][0]
    base = baseline_of(runs, rec)
    assert base["model"] == rec["model"] and base["batch_size"] == rec["batch_size"]
    assert max_relative_difference(rec["losses"], base["losses"]) <= 1e-5
    assert_within_its_tolerance(rec, base)


@pytest.mark.parametrize("script", [name for name in RUNS if not name.startswith("torch")])
def test_records_carry_the_real_timeline_of_the_schedule_and_its_bubble(runs, script):
    rec, console = runs[script]
    m, p = rec["microbatches"], rec["world_size"]
    name, _, flags = RUNS[script]
    asked = asked_microbatches(flags)
    if name == "baseline_pipeline":  # the whole batch forward, then backward, on every rank
        planned, stages = [[("F", 0, r), ("B", 0, r)] for r in range(p)], p
        assert m == 1 and rec["theory"]["bubble"] == pytest.approx((p - 1) / p, abs=1e-4)
    else:
        planned = [[(a.kind, a.micro, a.stage) for a in actions]
                   for actions in planned_schedule(name, flags, p, m)]
        stages = stages_a_rank(name, flags) * p
        assert m == asked
    assert rec["stages"] == stages and rec["tokens_per_s"] > 0
    timeline = [[TimedAction(*a) for a in actions] for actions in rec["timeline"]]
    assert [[(a.kind, a.micro, a.stage) for a in actions] for actions in timeline] == planned
    for actions in timeline:  # on each rank's clock from the step's first start, one at a time
        assert all(0 <= a.start < a.end for a in actions)
        assert all(a.end <= b.start for a, b in zip(actions[:-1], actions[1:], strict=True))
    assert 0 < rec["bubble"] < 1 and 0 <= rec["theory"]["bubble"] < 1
    if name in ("optimized_pipeline_gpipe", "optimized_pipeline_1f1b"):
        assert rec["theory"]["bubble_uniform"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-4)
    elif name == "optimized_pipeline_interleaved":  # v = 2: the fill a stage of half the layers
        uniform = {"bubble_uniform": (p - 1) / (2 * m + p - 1),
                   "bubble_1f1b_uniform": (p - 1) / (m + p - 1)}
        for key, value in uniform.items():  # a record's theory: three decimals
            assert rec["theory"][key] == pytest.approx(value, abs=1e-3)
    elif name != "baseline_pipeline" and name != "optimized_pipeline_zb":
        assert 0 <= rec["theory"]["bubble_paired"] < 1  # DualPipe(V): both simulations'
    if name == "optimized_pipeline_zb":
        assert rec["schedule"] == ("zbv" if "--zbv" in flags else "zb-h1")
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    assert all(f"rank  {r} |" in console for r in range(p))


def test_in_flight_activations_match_each_schedules_theory(runs):
    expected = {"optimized_pipeline_gpipe": M, "optimized_pipeline_1f1b llama": 2,  # m, p
                "1f1b at 3 ranks llama": 3,
                "optimized_pipeline_dualpipev": 5, "dualpipev at 3 ranks": 7,  # 2p+1 stages'
                "dualpipe at 4 ranks llama": 5,  # p+1 stages'
                # (v-1)g + 2p - 1 half stages', g micro-batches a group (PyTorch's order)
                "optimized_pipeline_interleaved": 5, "interleaved at 4 ranks llama": 11,
                "optimized_pipeline_zb llama": 2, "zb at 4 ranks": 4,  # p, 1F1B's
                "zbv": 4, "zbv at 4 ranks llama": 8}  # 2p half stages'
    for script, inflight in expected.items():
        rec = runs[script][0]
        assert rec["inflight_max"] == rec["theory"]["inflight_max"] == inflight, script


def test_a_tied_gradient_is_summed_only_where_the_weight_is_on_two_ranks(runs):
    """DualPipe at 4 ranks: each rank holds stages r and 3-r and all-reduces their gradients
    with its twin; DualPipeV's rank 0 holds the GPT's tied weight in both of its stages, once;
    GPipe's GPT sums its tied weight's two gradients, the Llama's 1F1B has none to sum."""
    dualpipe = runs["dualpipe at 4 ranks llama"][0]
    def stages(rec):
        return [sorted({TimedAction(*a).stage for a in actions})
                for actions in rec["timeline"]]

    assert stages(dualpipe) == [[0, 3], [1, 2], [1, 2], [0, 3]]
    v = runs["optimized_pipeline_dualpipev"][0]
    assert stages(v) == [[0, 3], [1, 2]]
    shape = 4 * 2 * 32 * 64 / 2**20  # a micro-batch's activations, MB
    assert v["comm_mb"] == pytest.approx(2 * M * shape, rel=1e-3)  # nothing but activations
    gpipe, llama = runs["optimized_pipeline_gpipe"][0], runs["optimized_pipeline_1f1b llama"][0]
    tied = 4 * 128 * 64 / 2**20  # the tiny GPT's embedding, fp32
    assert gpipe["comm_mb"] == pytest.approx(M * shape + tied, rel=1e-2)
    assert llama["comm_mb"] == pytest.approx(M * shape, rel=1e-2)  # nothing but activations
    # interleaving's rank 0: v m activations on, (v-1) m gradients back, and the tied gradient;
    # ZB-H1's are 1F1B's (the Llama's: activations only), ZBV's DualPipeV's
    assert runs["optimized_pipeline_interleaved"][0]["comm_mb"] == pytest.approx(
        3 * M * shape + tied, rel=1e-2)
    assert runs["optimized_pipeline_zb llama"][0]["comm_mb"] == pytest.approx(M * shape, rel=1e-2)
    assert runs["zbv"][0]["comm_mb"] == pytest.approx(2 * M * shape, rel=1e-3)
    assert stages(runs["optimized_pipeline_interleaved"][0]) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("script, flags, world, hint", [
    ("optimized_pipeline_1f1b", ["--batch-size", "6", "--microbatches", "4"], "1",
     "--microbatches"),
    ("optimized_pipeline_dualpipev", ["--microbatches", "3"], "2", "--microbatches 4 or more"),
    ("optimized_pipeline_dualpipev", ["--batch-size", "6", "--microbatches", "4"], "2",
     "--microbatches"),
    ("optimized_pipeline_dualpipe", ["--microbatches", "6"], "4", "at least 8"),
    ("optimized_pipeline_dualpipe", ["--microbatches", "9"], "2", "even --microbatches"),
    ("optimized_pipeline_dualpipe", ["--batch-size", "6", "--microbatches", "4"], "2",
     "--microbatches"),
    ("optimized_pipeline_pytorch", ["--batch-size", "6", "--microbatches", "4"], "1",
     "--microbatches"),
    ("optimized_pipeline_pytorch", ["--schedule", "dualpipev", "--microbatches", "2"], "2",
     "--microbatches 4 or more"),
    ("optimized_pipeline_interleaved", ["--microbatches", "9", "--batch-size", "9"], "4",
     "a multiple of 2"),
    ("optimized_pipeline_pytorch", ["--schedule", "interleaved", "--microbatches", "9",
                                    "--batch-size", "9"], "4", "a multiple of 2"),
    ("optimized_pipeline_zb", ["--batch-size", "6", "--microbatches", "4"], "2",
     "--microbatches"),
])
def test_bad_input_exits_2_with_one_line(script, flags, world, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", flags, hint, tmp_path,
                                 WORLD_SIZE=world)


# At tiny the cut has 4 layers (embeddings, 2 decoder blocks, loss head), a stage each at most.
# Each script's world one past that, by its stages a rank: (script, flags, world, stages).
PAST_THE_CUT = [
    ("baseline_pipeline", [], "5", 5), ("optimized_pipeline_gpipe", [], "5", 5),
    ("optimized_pipeline_1f1b", [], "5", 5),
    ("optimized_pipeline_dualpipev", ["--microbatches", "6"], "3", 6),  # the V: 2p stages
    ("optimized_pipeline_dualpipe", ["--microbatches", "12"], "6", 6),  # even p only
    ("optimized_pipeline_pytorch", [], "5", 5),
    ("optimized_pipeline_pytorch", ["--schedule", "1f1b"], "5", 5),
    ("optimized_pipeline_pytorch", ["--schedule", "dualpipev", "--microbatches", "6"], "3", 6),
    ("optimized_pipeline_interleaved", [], "3", 6),  # v 2: 2p stages
    ("optimized_pipeline_zb", [], "5", 5), ("optimized_pipeline_zb", ["--zbv"], "3", 6),
    ("optimized_pipeline_pytorch", ["--schedule", "interleaved"], "3", 6),
    ("optimized_pipeline_pytorch", ["--schedule", "zb"], "5", 5),
    ("optimized_pipeline_pytorch", ["--schedule", "zbv"], "3", 6)]


@pytest.mark.parametrize("script, flags, world, hint", [
    ("baseline_pipeline", [], "1", "two or more processes"),
    *((script, ["--size", "tiny", *flags], world, f"{stages} stages on {world} processes")
      for script, flags, world, stages in PAST_THE_CUT),
    ("optimized_pipeline_dualpipe", ["--microbatches", "6"], "3", "even number of processes"),
    ("optimized_pipeline_pytorch", ["--schedule", "dualpipev"], "8", "16 stages on 8"),
    *((script, ["--model", "resnet"], "2", "a decoder's list of layers") for script in [
        "baseline_pipeline", "optimized_pipeline_gpipe", "optimized_pipeline_1f1b",
        "optimized_pipeline_dualpipev", "optimized_pipeline_dualpipe",
        "optimized_pipeline_interleaved", "optimized_pipeline_zb", "optimized_pipeline_pytorch"]),
])
def test_a_world_the_schedule_cannot_use_is_skipped_with_why(script, flags, world, hint,
                                                            monkeypatch):
    """The world size is the host's (the Makefile's NPROC is its GPU count), not a flag: a
    schedule that cannot use it skips with the reason (recorded: tests/test_gpu_paths.py)."""
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(sys, "argv", [script, *flags])
    monkeypatch.setattr(common, "setup", lambda args: pytest.fail(f"{script} ran at {world}"))
    with pytest.raises(common.Skip, match=hint):
        load_recipe(FOLDER / f"{script}.py").main()


class ReachedSetup(Exception):
    """Raised in place of `common.setup`: the script took its flags and its world."""


def settings_at_setup(script: str, flags: list[str], world: int, monkeypatch
                      ) -> argparse.Namespace:
    """What `script` hands `common.setup` at `world` processes, run in this process."""
    def reached(args):
        raise ReachedSetup(args)

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(sys, "argv", [script, *flags])
    monkeypatch.setattr(common, "setup", reached)
    with pytest.raises(ReachedSetup) as reached_with:
        load_recipe(FOLDER / f"{script}.py").main()
    return reached_with.value.args[0]


@pytest.mark.parametrize("script, flags, world, stages", PAST_THE_CUT)
def test_a_stage_a_layer_runs_and_one_stage_more_skips_naming_the_flags(script, flags, world,
                                                                         stages, monkeypatch):
    """Tiny's 4 layers serve 4 stages, the embeddings and the loss head each a stage alone
    (the launches train DualPipeV at 2 ranks and DualPipe at 4 so, like the unsplit model):
    that world reaches setup. One stage more skips in one line counting the decoder blocks and
    naming --nproc_per_node and --size."""
    fits = 4 // (stages // int(world))  # 4 layers, over the script's stages a rank
    settings_at_setup(script, ["--size", "tiny", *flags], fits, monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(common.Skip) as skipped:
        load_recipe(FOLDER / f"{script}.py").main()
    why = str(skipped.value)
    assert len(why.splitlines()) == 1 and "2 decoder blocks" in why, why
    assert "--nproc_per_node" in why and "--size" in why, why


@pytest.mark.parametrize("script, world, m", [("optimized_pipeline_dualpipe", 8, 16),
                                              ("optimized_pipeline_dualpipev", 4, 8),
                                              ("optimized_pipeline_gpipe", 8, 8)])
def test_micro_batches_default_to_what_the_world_needs(script, world, m, monkeypatch):
    """DualPipe needs m >= 2p, DualPipeV 2p stages' worth: the default follows the world."""
    args = settings_at_setup(script, ["--size", "large"], world, monkeypatch)
    assert (args.microbatches, args.batch_size) == (m, 4 * m)


@pytest.mark.parametrize("mine, theirs", [("optimized_pipeline_gpipe", "torch gpipe"),
                                          ("optimized_pipeline_1f1b llama", "torch 1f1b llama"),
                                          ("optimized_pipeline_dualpipev", "torch dualpipev"),
                                          ("optimized_pipeline_interleaved", "torch interleaved"),
                                          ("optimized_pipeline_zb llama", "torch zb llama"),
                                          ("zbv", "torch zbv")])
def test_the_hand_written_schedule_trains_like_torchs_own(runs, mine, theirs):
    ours, torchs = runs[mine][0], runs[theirs][0]
    assert max_relative_difference(ours["losses"], torchs["losses"]) <= 1e-5
    assert torchs["schedule"] == " ".join(theirs.split()[:2])
    assert torchs["model"] == ours["model"] and torchs["stages"] == ours["stages"]
    if theirs != "torch gpipe":  # the console's summary names the schedule it ran
        (summary,) = [line for line in runs[theirs][1].splitlines()
                      if line.startswith("optimized_pipeline_pytorch: ")]
        assert f"--schedule {theirs.split()[1]}" in summary and "ms/step" in summary
    assert ours["comm_mb"] == pytest.approx(torchs["comm_mb"], rel=1e-3)  # the same tensors
