"""Unit tests for 05_pipeline's pure parts: the schedules as data, the simulator that turns them
into an ideal bubble, the cut into stages, and the timeline drawing; and the runtimes as a user
lifts them (a plain loss function, a process group, tied or untied heads, a timeline only when
asked, the README's lines), in gloo processes forked from this one."""

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

import common
from helpers import as_rank, load_recipe, readme_python_block

FOLDER = common.ROOT / "05_pipeline"
README = FOLDER / "README.md"
RECIPES = {name: load_recipe(FOLDER / f"{script}.py") for name, script in [
    ("gpipe", "optimized_pipeline_gpipe"),
    ("1f1b", "optimized_pipeline_1f1b"), ("dualpipev", "optimized_pipeline_dualpipev"),
    ("dualpipe", "optimized_pipeline_dualpipe")]}
BASELINE = load_recipe(FOLDER / "baseline_pipeline.py")  # the timeline code the others copy
INTERLEAVED = load_recipe(FOLDER / "optimized_pipeline_interleaved.py")
ZB = load_recipe(FOLDER / "optimized_pipeline_zb.py")
# Schedules of several stages a rank or a split backward, as (p, m) -> each rank's actions, and
# PyTorch's class for each with its stages a rank
INTERLEAVED_AND_ZB = {"interleaved v2": lambda p, m: INTERLEAVED.schedule(p, m, 2),
                      "interleaved v3": lambda p, m: INTERLEAVED.schedule(p, m, 3),
                      "zb-h1": ZB.schedule, "zbv": ZB.zbv_schedule}
PYTORCHS = {"interleaved v2": (torch_schedules.ScheduleInterleaved1F1B, 2),
            "interleaved v3": (torch_schedules.ScheduleInterleaved1F1B, 3),
            "zb-h1": (torch_schedules.ScheduleInterleavedZeroBubble, 1),
            "zbv": (torch_schedules.ScheduleZBVZeroBubble, 2)}
UNIFORM = {"F": 1.0, "B": 2.0}  # a backward costs two forwards
SPLIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # and splits into equal I and W


def check_valid(recipe, p, m):
    """`recipe`'s schedule for p ranks and m micro-batches is valid (check_actions)."""
    check_actions(recipe.schedule(p, m), p, m)


def check_actions(schedule, p, m):
    """Each micro-batch's F of each stage runs once, on one rank, then on that rank its B, or its
    I and later its W; every stage of every micro-batch runs."""
    assert len(schedule) == p
    runs = collections.Counter((a.micro, a.stage) for actions in schedule for a in actions
                               if a.kind == "F")
    stages = max(stage for _, stage in runs) + 1
    assert runs == {(micro, stage): 1 for micro in range(m) for stage in range(stages)}
    for actions in schedule:
        assert len(set(actions)) == len(actions)
        index = {(a.kind, a.micro, a.stage): i for i, a in enumerate(actions)}
        for micro, stage in {(a.micro, a.stage) for a in actions}:
            f, b = index[("F", micro, stage)], index.get(("B", micro, stage))
            i, w = index.get(("I", micro, stage)), index.get(("W", micro, stage))
            assert (b is None) != (i is None) and (i is None) == (w is None)
            assert f < (b if b is not None else i) and (w is None or i < w)


def key(post, r):
    """A receive as (kind, micro-batch, stage): 1F1B's name no stage, their rank's."""
    return tuple(post) if len(post) == 3 else (*post, r)


def run_under_nccls_rule(schedule, posts, fifo):
    """Runs each rank as the runtime does, against NCCL's rule: a send completes only once its
    peer's receive is posted, and a communicator runs its operations in the order they were
    posted, one at a time. `fifo` "pair": plain isend/irecv, a communicator for each pair of
    ranks (NCCL's for point-to-point); "rank": one for all of a rank's (batched operations).

    A rank's host, for each action in turn: posts the receives `posts` places before it, waits
    for the action's input if it comes from another rank, runs it, then posts its output's send
    (an F's to the next stage, a B's or I's to the previous, unless that stage is on this rank);
    at the end it waits for its sends. A send and a receive complete together when each is first
    in its communicator's queue, and must then carry the same tensor, or NCCL would deliver the
    wrong one. Returns normally when every rank finishes; raises on a deadlock."""
    owner = {(a.micro, a.stage): r for r, actions in enumerate(schedule) for a in actions}
    last = max(stage for _, stage in owner)
    p = len(schedule)
    queues = collections.defaultdict(collections.deque)  # communicator's queue -> operations
    at, arrived = [0] * p, set()  # each host's next action; receives completed (rank, key)

    def queue(r, peer):
        return (r, min(r, peer), max(r, peer)) if fifo == "pair" else (r,)

    def post(op, r, peer, k):
        queues[queue(r, peer)].append((op, r, peer, k))

    posted = [False] * p  # the receives before action at[r] are posted
    while True:
        progressed = False
        for r in range(p):  # hosts
            while at[r] < len(schedule[r]):
                a = schedule[r][at[r]]
                if not posted[r]:
                    for item in posts[r][at[r]]:
                        k = key(item, r)
                        post("recv", r, owner[(k[1], k[2] - 1 if k[0] == "F" else k[2] + 1)], k)
                    posted[r] = progressed = True
                src = a.stage - 1 if a.kind == "F" else a.stage + 1
                wants = ("F" if a.kind == "F" else "B", a.micro, a.stage)
                if a.kind != "W" and 0 <= src <= last and owner[(a.micro, src)] != r \
                        and (r, wants) not in arrived:
                    break  # waits for its input
                to = a.stage + 1 if a.kind == "F" else a.stage - 1
                if a.kind != "W" and 0 <= to <= last and (peer := owner[(a.micro, to)]) != r:
                    post("send", r, peer, ("F" if a.kind == "F" else "B", a.micro, to))
                at[r], posted[r], progressed = at[r] + 1, False, True
        for ops in list(queues.values()):  # communicators
            if not ops or ops[0][0] != "send":
                continue
            _, r, peer, k = ops[0]
            theirs = queues[queue(peer, r)]
            if theirs and theirs[0][:3] == ("recv", peer, r):
                assert theirs[0][3] == k, f"rank {peer} receives {theirs[0][3]} but {r} sends {k}"
                ops.popleft()
                theirs.popleft()
                arrived.add((peer, k))
                progressed = True
        if not progressed:
            break
    stuck = [r for r in range(p) if at[r] < len(schedule[r])]
    left = [op for ops in queues.values() for op in ops]
    assert not stuck and not left, f"deadlock: ranks {stuck} wait; pending {left[:4]}"


def simulator(name):
    """GPipe's and 1F1B's `simulate`, or DualPipe(V)'s `simulate_split`: split backwards, two
    stages a rank."""
    recipe = RECIPES[name]
    return recipe.simulate_split if name.startswith("dualpipe") else recipe.simulate


MINIMUM_M = {"gpipe": lambda p: 1, "1f1b": lambda p: 1, "dualpipev": lambda p: 2 * p,
             "dualpipe": lambda p: 2 * p}


@pytest.mark.parametrize("fifo", ["pair", "rank"])
@pytest.mark.parametrize("name, p", [(name, p) for name in RECIPES for p in range(2, 9)
                                     if name != "dualpipe" or p % 2 == 0])
def test_receives_posted_ahead_never_deadlock_under_nccls_rule(name, p, fifo):
    """Every schedule's own action lists and receive posts, m from its minimum to 32 (DualPipe:
    even p and m), through the model of NCCL: every rank finishes, every message matched."""
    recipe = RECIPES[name]
    for m in range(MINIMUM_M[name](p), 33):
        if name == "dualpipe" and m % 2:
            continue
        schedule = recipe.schedule(p, m)
        check_valid(recipe, p, m)
        run_under_nccls_rule(schedule, simulator(name)(schedule)[2], fifo)


@pytest.mark.parametrize("fifo", ["pair", "rank"])
def test_the_model_catches_receives_posted_only_when_needed(fifo):
    """The model can fail: DualPipeV with each receive posted just before the action that needs
    it (the runtime this one replaced; the V's turn, in memory, receives nothing) deadlocks at
    p = 4, where two ranks each send to the other before posting the receive for what the other
    sends; the same lists with `simulate`'s posts run through."""
    recipe = RECIPES["dualpipev"]
    schedule = recipe.schedule(4, 8)
    owner = {(a.micro, a.stage): r for r, actions in enumerate(schedule) for a in actions}

    def networked(a, r):
        src = a.stage - 1 if a.kind == "F" else a.stage + 1
        return a.kind != "W" and 0 <= src <= 7 and owner[(a.micro, src)] != r

    late = [[[("F" if a.kind == "F" else "B", a.micro, a.stage)] if networked(a, r) else []
             for a in actions] for r, actions in enumerate(schedule)]
    posts = recipe.simulate_split(schedule)[2]
    assert sum(map(len, sum(late, []))) == sum(map(len, sum(posts, [])))
    with pytest.raises(AssertionError, match="deadlock"):
        run_under_nccls_rule(schedule, late, fifo)
    run_under_nccls_rule(schedule, posts, fifo)


def idle_time(recipe, schedule, seconds, paired=False):
    """The simulated idle time of a rank (all ranks do the same work here), from the fraction."""
    p = len(schedule)
    bubble, inflight, _ = recipe.simulate_split(schedule, [seconds] * p, paired=paired)
    busy = sum(seconds[a.kind] for a in schedule[0])
    return busy / (1 - bubble) - busy, inflight


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("m", range(1, 33))
def test_schedules_run_without_deadlock_with_the_formulas_bubble(name, p, m):
    recipe = RECIPES[name]
    check_valid(recipe, p, m)
    bubble, inflight, _ = recipe.simulate(recipe.schedule(p, m), [UNIFORM] * p)  # raises if stuck
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert inflight == (m if name == "gpipe" else min(p, m))
    if m == 1:  # the naive baseline: (p-1)/p, its recorded theory
        assert bubble == pytest.approx((p - 1) / p)


@pytest.mark.parametrize("name, p, m", [  # within DeepSeek's constraints, as the scripts are
    (name, p, m) for name in ["dualpipev", "dualpipe"] for p in range(2, 9)
    for m in range(2 * p, 33) if name == "dualpipev" or (p % 2 == 0 and m % 2 == 0)])
@pytest.mark.parametrize("w", [1.0, 0.5, 0.0])
def test_dualpipe_schedules_have_the_papers_bubble_and_activations(name, p, m, w):
    """DeepSeek's table, per device: bubble (PP/2-1)(F&B + B - 3W), activations PP+1 stages'
    (PP stages: 2p for DualPipeV, p for DualPipe; F&B = F + B on one thread). The table holds
    when a paired F and B wait for each other and F = I. Run one after the other, as the
    runtime runs them, the same lists idle (PP/2-1)(F + B - 2W): half the table's at W = F, two
    thirds at W = 0 (what the docstrings and the README say the runs should show)."""
    recipe = RECIPES[name]
    stages = 2 * p if name == "dualpipev" else p
    check_valid(recipe, p, m)
    assert sorted({a.stage for a in recipe.schedule(p, m)[0]}) == [0, stages - 1]
    seconds = {"F": 1.0, "I": 1.0, "W": w, "B": 1.0 + w}
    paired, inflight = idle_time(recipe, recipe.schedule(p, m), seconds, paired=True)
    F, B, W = seconds["F"], seconds["B"], seconds["W"]
    assert paired == pytest.approx((stages / 2 - 1) * ((F + B) + B - 3 * W))
    assert inflight == stages + 1
    one_after_the_other, _ = idle_time(recipe, recipe.schedule(p, m), seconds)
    assert one_after_the_other == pytest.approx((stages / 2 - 1) * (F + B - 2 * W))


def test_dualpipev_idles_less_than_1f1b_on_the_same_ranks():
    """Same ranks, same model: DualPipeV's stages are half 1F1B's, so are their F, I, W."""
    p, m = 4, 8
    one_f_one_b, _, _ = RECIPES["1f1b"].simulate(RECIPES["1f1b"].schedule(p, m), [UNIFORM] * p)
    half = {k: v / 2 for k, v in SPLIT.items()}
    v, _, _ = RECIPES["dualpipev"].simulate_split(RECIPES["dualpipev"].schedule(p, m),
                                                  [half] * p)
    assert v < one_f_one_b / 2


def pytorchs_order(name: str, p: int, m: int) -> list[list[tuple[str, int, int]]] | None:
    """PyTorch's `pipeline_order` for `name` (PYTORCHS) on p ranks and m micro-batches, each
    rank's actions as (kind, micro, stage) without its idle slots; None where torch refuses m.
    Its stages are stand-ins: the order reads only their group's size and the stage count."""
    schedule_class, stages_a_rank = PYTORCHS[name]
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=p * stages_a_rank,
                                    submod=None) for _ in range(stages_a_rank)]
    try:
        order = schedule_class(stages, m).pipeline_order
    except ValueError:  # interleaved schedules: m in groups of about p that do not divide it
        return None
    kinds = {torch_schedules.FORWARD: "F", torch_schedules.FULL_BACKWARD: "B",
             torch_schedules.BACKWARD_INPUT: "I", torch_schedules.BACKWARD_WEIGHT: "W"}
    return [[(kinds[a.computation_type], a.microbatch_index, a.stage_index)
             for a in order[r] if a is not None] for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("name", list(INTERLEAVED_AND_ZB))
def test_the_interleaved_and_zero_bubble_schedules_are_pytorchs_action_for_action(name, p):
    """Each rank's list equals torch.distributed.pipelining's order, m = 1..12. Where torch
    refuses an m (its interleaved schedules group the micro-batches), the interleaved script
    refuses it too, in one line; ZB-H1, one stage a rank, has no groups and takes any m."""
    compared = 0
    for m in range(1, 13):
        theirs = pytorchs_order(name, p, m)
        if theirs is None and name.startswith("interleaved"):
            with pytest.raises(ValueError, match="--microbatches") as refused:
                INTERLEAVED_AND_ZB[name](p, m)
            assert len(str(refused.value).splitlines()) == 1
            continue
        ours = [[tuple(a[:3]) for a in actions] for actions in INTERLEAVED_AND_ZB[name](p, m)]
        assert theirs is None or ours == theirs, (p, m)
        compared += theirs is not None
        check_actions(INTERLEAVED_AND_ZB[name](p, m), p, m)
    assert compared >= 6  # torch built most of the m's: the equality was checked, not skipped


@pytest.mark.parametrize("fifo", ["pair", "rank"])
@pytest.mark.parametrize("name, p", [(name, p) for name in INTERLEAVED_AND_ZB
                                     for p in range(2, 9)])
def test_interleaved_and_zero_bubble_receives_never_deadlock_under_nccls_rule(name, p, fifo):
    for m in range(1, 17):
        try:
            schedule = INTERLEAVED_AND_ZB[name](p, m)
        except ValueError:  # m in groups that do not divide it (the test above)
            continue
        run_under_nccls_rule(schedule, ZB.simulate_split(schedule)[2], fifo)


@pytest.mark.parametrize("p", range(2, 9))
def test_interleaving_cuts_the_bubble_v_fold_and_holds_more_stages(p):
    """v chunks a rank, each 1/v of its layers: the bubble (p-1)/(vm+p-1) from m = p on (its
    recorded `bubble_uniform`), and rank 0 holds (v-1)g + 2p - 1 stages' activations (g
    micro-batches a group, p where p divides m), all it runs if fewer: 1F1B's p at v = 1 is
    2p - 1 here, as PyTorch's interleaved order warms up twice as deep."""
    for m in range(1, 25):
        for v in (1, 2, 3, 4):
            try:
                schedule = INTERLEAVED.schedule(p, m, v)
            except ValueError:
                continue
            stage = {"F": 1 / v, "B": 2 / v}  # 1/v of a rank's layers
            bubble, held, _ = INTERLEAVED.simulate_split(schedule, [stage] * p)
            if m >= p:  # fewer: a micro-batch's next chunk waits for it to come round the ranks
                assert bubble == pytest.approx(INTERLEAVED.interleaved_bubble(p, m, v)), (m, v)
                assert bubble == pytest.approx((p - 1) / (v * m + p - 1))
            else:
                assert bubble >= INTERLEAVED.interleaved_bubble(p, m, v) - 1e-12
            g = m // max(1, m // p)
            assert held == min((v - 1) * g + 2 * p - 1, v * m), (m, v)


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_idles_f_plus_i_minus_w_a_stage_at_1f1bs_memory_and_zbv_less(p):
    """ZB-H1 on p stages, m >= p: (p-1)(F+I-W) idle a rank (1F1B's (p-1)(F+B) less 2W) and p
    micro-batches' activations, 1F1B's; ZBV on 2p half stages, m >= 2p: less idle still, 2p
    half stages' activations (p whole ones)."""
    for m in range(p, 25):
        for F, I, W in [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.0, 0.5), (1.0, 1.0, 0.0)]:
            seconds = {"F": F, "I": I, "W": W}
            idle, held = idle_time(ZB, ZB.schedule(p, m), seconds)
            assert idle == pytest.approx((p - 1) * (F + I - W)) and held == p, (m, seconds)
            one_f_one_b, _, _ = RECIPES["1f1b"].simulate(RECIPES["1f1b"].schedule(p, m),
                                                         [{"F": F, "B": I + W}] * p)
            one_f_one_b_idle = one_f_one_b / (1 - one_f_one_b) * m * (F + I + W)
            assert idle == pytest.approx(one_f_one_b_idle - 2 * (p - 1) * W)
            if m >= 2 * p:
                half = {kind: value / 2 for kind, value in seconds.items()}
                idle_v, held_v = idle_time(ZB, ZB.zbv_schedule(p, m), half)
                assert idle_v < idle and held_v == 2 * p, (m, seconds)


def test_the_simulator_finds_a_deadlock_and_uneven_stages_widen_the_bubble():
    recipe = RECIPES["1f1b"]
    A = recipe.Action
    with pytest.raises(ValueError, match="deadlock"):  # rank 0 wants B0 before its F0
        recipe.simulate([[A("B", 0, 0), A("F", 0, 0)], [A("F", 0, 1), A("B", 0, 1)]],
                        [UNIFORM] * 2)
    even, _, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM] * 2)
    uneven, _, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM, {"F": 1.5, "B": 3.0}])
    assert uneven > even


@pytest.mark.parametrize("n, stages", [(8, 2), (8, 3), (4, 4), (10, 7)])
def test_equal_costs_cut_into_contiguous_stages_within_one_layer(n, stages):
    cut = common.cut_into_stages([1] * n, stages)
    assert [i for stage in cut for i in stage] == list(range(n))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1 and min(map(len, cut)) >= 1


def test_the_cut_weighs_layers_by_their_matrix_multiplies():
    """At `small` a block costs 12 x 256^2, the head 1024 x 256 (a third), the embeddings 0.
    Four stages of two layers would put 2 blocks and the two light ends on the V's rank 0 and 4
    blocks on rank 1; by cost the ranks get 3 blocks each."""
    model = common.GPT(common.SIZES["small"], 32)
    for stages, lengths in [(4, [3, 1, 2, 2]), (2, [4, 4])]:
        cut = model.pipeline_stages(stages)
        assert [len(stage) for stage in cut] == lengths
        assert [layer for stage in cut for layer in stage][1:-1] == list(model.blocks)  # in order
    assert [len(s) for s in common.cut_into_stages([0, 0, 0, 5], 4)] == [1, 1, 1, 1]  # never empty


def test_the_timeline_draws_each_action_where_it_ran(tmp_path):
    timelines = [[("F", 0, 0, 0.0, 0.25), ("B", 0, 3, 0.5, 1.0)], [("F", 0, 1, 0.25, 0.5)]]
    text = BASELINE.render_timeline(timelines, width=8)
    assert text.splitlines()[1:] == ["rank  0 |F0..b0bb|", "rank  1 |..F0....|"]  # 2nd stage
    args = common.parser(None).parse_args(["--results", str(tmp_path / "r.jsonl")])
    BASELINE.write_timeline_trace(timelines, args, common.Topology(0, 0, 2, 2, 1, "gloo", None))
    (trace,) = (tmp_path / "traces").iterdir()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]["stage"]) for e in spans] == [
        ("F0", 0, 0.0, 250000.0, 0), ("B0", 0, 500000.0, 500000.0, 3),
        ("F0", 1, 250000.0, 250000.0, 1)]


def test_gathered_timelines_count_from_the_first_stages_first_forward(tmp_path):
    """Each step's times from its first stage's first forward (here on the only rank, whose
    clock is rank 0's: offset 0), not from the step's start before it; the bubble, the steps'
    median of idle time over the span to the last end."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        steps = [(100.0, [("F", 0, 0, 100.5, 101.0), ("B", 0, 0, 101.0, 102.0)]),
                 (200.0, [("F", 0, 0, 200.0, 201.0), ("B", 0, 0, 202.0, 204.0)])]
        args = common.parser(None).parse_args(["--results", str(tmp_path / "r.jsonl")])
        topo = common.Topology(0, 0, 1, 1, 1, "gloo", torch.device("cpu"))
        assert BASELINE.clock_offset(topo) == 0.0
        timed, bubble, means, held = BASELINE.gather_timelines(steps, 3, args, topo)
    finally:
        dist.destroy_process_group()
    assert timed == [[[("F", 0, 0, 0.0, 0.5), ("B", 0, 0, 0.5, 1.5)]],
                     [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 2.0, 4.0)]]]
    assert bubble == pytest.approx((0.0 + 0.25) / 2)  # all 1.5 s busy, then 3 of 4
    assert means == [{"F": 0.75, "B": 1.5}] and held == 3


def test_a_stage_cut_empty_stops_in_one_line():
    """More stages than the model has layers leave a stage empty: PipelineRank says so in one
    line, where it once stopped with StopIteration (the README's cut is the user's own)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        for kind in ("gpipe", "1f1b"):
            recipe = RECIPES[kind]
            with pytest.raises(ValueError) as error:
                recipe.PipelineRank([], lambda y, t: y.sum(), recipe.schedule(1, 2), (1, 4, 8))
            assert len(str(error.value).splitlines()) == 1
            assert "holds no layer" in str(error.value) and "stages" in str(error.value)
    finally:
        dist.destroy_process_group()


# --- the runtimes as a user lifts them, in forked gloo processes -------------------------------
RUNTIMES = {"baseline": BASELINE, "1f1b": RECIPES["1f1b"],
            "dualpipev": RECIPES["dualpipev"], "dualpipe": RECIPES["dualpipe"],
            "interleaved": INTERLEAVED, "zb": ZB, "zbv": ZB}
SCRIPTS = {**RUNTIMES, "gpipe": RECIPES["gpipe"]}  # every runtime's script, by kind
LOSS_RANK = {"baseline": -1, "gpipe": -1, "1f1b": -1, "dualpipev": 0, "dualpipe": 0,
             "interleaved": -1, "zb": -1, "zbv": 0}  # in group
# The runtimes that sum a tied weight across ranks around `run` (TiedGradients.summed), not in it
SUMMED_AROUND_RUN = {"interleaved", "zb", "zbv"}
TINY_SIZE, BATCH, MICRO, STEPS, LR = common.SIZES["tiny"], 8, 4, 3, 1e-3
# the project's models seeded apart, rank r from seed r: each runtime once, each model twice
SEEDED_APART = [("baseline", "llama"), ("1f1b", "gpt"), ("dualpipev", "llama"), ("dualpipe", "gpt")]
# tests/hf_models.py's CASES on every runtime but 1F1B, which the README's lines run
HF_RUNTIMES = ["baseline", "gpipe", "dualpipev", "dualpipe", "interleaved", "zb", "zbv"]
# Windows shorter than the 32-token sequences, which the models' own mask builder makes: Mistral's
# on every layer, Qwen2's on its layers past max_window_layers (one mask a layer type)
WINDOWED = {"mistral window 8": ("mistral", {"sliding_window": 8}),
            "qwen2 window 8 past layer 1": ("qwen2", {"use_sliding_window": True,
                                                     "sliding_window": 8,
                                                     "max_window_layers": 1})}
# bf16 weights against DDP in bf16, absolute per step: the 1F1B script allows 5e-2, the
# README's lines hold 7e-5 here; 1e-3 keeps room and still fails a wrong start or mask
BF16_TOLERANCE = 1e-3


# 8 layers (embeddings, 6 blocks, loss head): a stage each for interleaving (v 2) and ZBV at 4
# ranks; the grid below trains the interleaved and zero-bubble runtimes at p 2 and 4, m 4 and 8
DEEPER_TINY = dataclasses.replace(TINY_SIZE, n_layers=6)
GRID = [(kind, p, m) for kind in sorted(SUMMED_AROUND_RUN) for p in (2, 4) for m in (4, 8)]


def tiny_decoder(name: str, seed: int = 0, size: common.Size = TINY_SIZE) -> common.Decoder:
    torch.manual_seed(seed)
    return common.Llama(size) if name == "llama" else common.GPT(size, size.seq_len)


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = [common.global_token_batch(TINY_SIZE, TINY_SIZE.seq_len, BATCH, step, seed=0)
               for step in range(STEPS)]
    return [(tokens[:, :-1], tokens[:, 1:]) for tokens in batches]


def plain_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss function as a user writes one: no `common` in it."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def cut(model: torch.nn.Module, n: int) -> list[list[torch.nn.Module]]:
    """`model`'s n stages: the project's decoders' by cost, as their scripts cut them (the loss
    head as its norm and head); a HuggingFace Llama's contiguous, as the README cuts it."""
    if isinstance(model, common.Decoder):
        plain = RUNTIMES["baseline"].plain_layers
        return [plain(stage, s == n - 1) for s, stage in enumerate(model.pipeline_stages(n))]
    layers = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    bounds = [len(layers) * s // n for s in range(n + 1)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def build_runtime(kind: str, model: torch.nn.Module, group, record_timeline: bool = False,
                  call_layer=None, m: int = MICRO):
    """`kind`'s runtime for this rank of `group`, as a trainer builds it: every rank's whole
    model made the group's first rank's (`broadcast_parameters`), then cut; m micro-batches."""
    recipe, p, r = SCRIPTS[kind], dist.get_world_size(group), dist.get_rank(group)
    recipe.broadcast_parameters(model, group)
    width = common.input_embedding(model).embedding_dim
    shape = (BATCH // m, TINY_SIZE.seq_len, width)
    options = dict(group=group, call_layer=call_layer, record_timeline=record_timeline)
    if kind in ("baseline", "gpipe", "1f1b"):
        stage, tied = cut(model, p)[r], recipe.tied_weights(model)
        if kind == "baseline":
            return recipe.ModelParallelRank(stage, plain_loss, (BATCH, *shape[1:]), tied=tied,
                                            **options)
        return recipe.PipelineRank(stage, plain_loss, recipe.schedule(p, MICRO), shape,
                                   tied=tied, **options)
    if kind in SUMMED_AROUND_RUN:  # as their scripts' main: the stages, then the tied weight's
        n = p if kind == "zb" else 2 * p
        stages = cut(model, n)
        mine = {"interleaved": range(r, n, p), "zb": [r], "zbv": [r, n - 1 - r]}[kind]
        actions = {"interleaved": lambda: recipe.schedule(p, m, 2),
                   "zb": lambda: recipe.schedule(p, m),
                   "zbv": lambda: recipe.zbv_schedule(p, m)}[kind]()
        pipe = recipe.MultiStagePipelineRank({s: stages[s] for s in mine}, plain_loss, actions,
                                             shape, **options)
        held = list(pipe.layers.parameters())
        pipe.tied = recipe.TiedGradients([w for w in recipe.tied_weights(model)
                                          if any(w is q for q in held)],
                                         group or dist.group.WORLD)
        return pipe
    n = 2 * p if kind == "dualpipev" else p
    stages = cut(model, n)
    return recipe.MultiStagePipelineRank({s: stages[s] for s in sorted({r, n - 1 - r})},
                                         plain_loss, recipe.schedule(p, MICRO), shape, **options)


class NoClock:
    """A runtime's `time` while no timeline is asked for: reading the clock fails."""

    @staticmethod
    def perf_counter() -> float:
        raise AssertionError("the runtime read its clock with no timeline asked for")


def train(kind: str, model: torch.nn.Module, group, record_timeline: bool = False,
          call_layer=None, m: int = MICRO) -> dict:
    """STEPS steps of `kind` on `model` (this rank's, whole) in m micro-batches: the losses, the
    stage's final weights (in `layers`' order) and which weights its `TiedGradients` sums."""
    pipe = build_runtime(kind, model, group, record_timeline, call_layer, m)
    del model
    opt = torch.optim.AdamW(pipe.layers.parameters(), lr=LR)
    held = list(pipe.layers.parameters())
    twins = RUNTIMES["dualpipe"].TwinGradients(held, group) if kind == "dualpipe" else None
    losses = []
    summed = pipe.tied.summed if kind in SUMMED_AROUND_RUN else contextlib.nullcontext
    for tokens, targets in token_batches():
        opt.zero_grad(set_to_none=True)
        with summed():
            loss = pipe.run(tokens, targets)
        if twins is not None:
            loss = twins.sum(loss)
        opt.step()
        losses.append(loss.item())
    tied = getattr(pipe, "tied", None)
    # a step's actions by field: a TimedAction pickles by its module's name, which a script
    # loaded by path lacks
    timelines = [(start, [a._asdict() for a in actions]) for start, actions in pipe.timelines]
    return {"losses": losses, "weights": [q.detach().clone() for q in held],
            "tied": None if tied is None else len(tied.weights), "timelines": timelines}


def join(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives rank `rank` of `world`, its store on `port`."""
    as_rank(rank, world, port)


def _train_every_runtime(rank: int, world: int, port: int, out: str) -> None:
    """World 2: every runtime on both decoders on the world (group None), its clock removed;
    then 1F1B with its timeline asked for, and SEEDED_APART. World 3: the same on the sub-group
    {0, 1} (rank 2 idle), then on {1, 2} (rank 0 idle): group and global ranks differ there.
    Each rank saves what it trained, by (group, kind, model, group rank)."""
    join(rank, world, port)
    common.setup(common.parser(None).parse_args(["--timeout", "60"]))
    torch.set_num_threads(1)
    groups = {"world": ([0, 1], None)} if world == 2 else {
        f"ranks {a} {b}": ([a, b], dist.new_group([a, b])) for a, b in [(0, 1), (1, 2)]}
    results, clocks = {}, {kind: recipe.time for kind, recipe in RUNTIMES.items()}
    try:
        for name, (members, group) in groups.items():
            if rank not in members:
                continue
            for kind, recipe in RUNTIMES.items():
                recipe.time = NoClock
                for model_name in ("gpt", "llama"):
                    results[(name, kind, model_name, dist.get_rank(group))] = \
                        train(kind, tiny_decoder(model_name), group)
                recipe.time = clocks[kind]
        if world == 2:
            results[("timeline", "1f1b", "llama", rank)] = train(
                "1f1b", tiny_decoder("llama"), None, record_timeline=True)
            for kind, model_name in SEEDED_APART:
                results[("seeded apart", kind, model_name, rank)] = train(
                    kind, tiny_decoder(model_name, seed=rank), None)
        torch.save(results, Path(out) / f"world{world}-rank{rank}.pt")
        dist.barrier()  # rank 0's store serves the others' groups until they are done
    finally:
        dist.destroy_process_group()


def _train_hf_models(rank: int, world: int, port: int, out: str) -> None:
    """On a process group of its own, the README's lines as they stand, given what they take
    from the trainer: `model`, built from seed r on rank r, and `batches`, the whole global
    batch on every rank; beside each, the reference: DDP from the same models on the same
    global batch. On each of hf_models.CASES, then HF_RUNTIMES through the lines' own
    `call_layer` on the same modules (`call_layer` knows its decoder layers by identity), their
    weights put back to rank r's first; in bf16 on each family; on hf_models.UNSUPPORTED's
    models and WINDOWED's; on a Gemma 2, whose forward softcaps its logits (the refusal).
    Last, the layers of each family on a group of one rank, without `call_layer` or through
    one that returns a tuple: the errors."""
    import hf_models  # here, not at the top: only these processes pay for importing transformers
    from transformers import Gemma2Config, Gemma2ForCausalLM

    sys.path.insert(0, str(FOLDER))  # the script next to the trainer, as the README says
    join(rank, world, port)
    common.setup(common.parser(None).parse_args(["--timeout", "60"]))
    torch.set_num_threads(1)
    block = compile(readme_python_block(README), "05_pipeline/README.md", "exec")
    batches = hf_models.token_batches(STEPS, 0, 1, BATCH)  # the global batch, on every rank
    ddp_batches = hf_models.token_batches(STEPS, rank, world, BATCH // world)

    def seeded(family: str, attn: str, tied: bool, dtype: torch.dtype = torch.float32,
               **config: object):
        torch.manual_seed(rank)
        return hf_models.tiny_model(family, attn, tied, dtype, **config)

    def readme(model: torch.nn.Module) -> dict:
        namespace = {"__name__": "trainer", "model": model, "batches": batches}
        exec(block, namespace)
        return namespace

    first_of = {family: next(c for c in hf_models.CASES if c.family == family)
                for family in hf_models.FAMILIES}
    runs = [*((str(case), case, torch.float32, {}) for case in hf_models.CASES),
            *((f"{family} bf16", first_of[family], torch.bfloat16, {})
              for family in hf_models.FAMILIES),
            *((name, hf_models.Case(name, "eager", False), torch.float32, {})
              for name in hf_models.UNSUPPORTED),
            *((name, hf_models.Case(family, "eager", False), torch.float32, config)
              for name, (family, config) in WINDOWED.items())]
    results = {"cases": [str(case) for case in hf_models.CASES]}
    try:
        for name, case, dtype, config in runs:
            model = seeded(*case, dtype=dtype, **config)
            results[(name, "seeded apart")] = hf_models.seeded_apart(model)
            initial = {key: value.clone() for key, value in model.state_dict().items()}
            namespace = readme(model)
            results[(name, "readme")] = namespace["losses"]
            results[(name, "readme dtypes")] = {q.dtype for q in
                                                namespace["pipe"].layers.parameters()}
            results[(name, "ddp")] = hf_models.ddp_losses(
                seeded(*case, dtype=dtype, **config), ddp_batches, LR)
            if name in results["cases"]:
                for kind in HF_RUNTIMES:
                    model.load_state_dict(initial)  # rank r's seed again, in the same modules
                    results[(name, kind)] = train(kind, model, None, False,
                                                  namespace["call_layer"])["losses"]
        torch.manual_seed(rank)
        gemma = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=TINY_SIZE.vocab_size, hidden_size=TINY_SIZE.d_model,
            intermediate_size=common.llama_ffn_dim(TINY_SIZE.d_model),
            num_hidden_layers=TINY_SIZE.n_layers, num_attention_heads=TINY_SIZE.n_heads,
            num_key_value_heads=TINY_SIZE.n_kv_heads,
            head_dim=TINY_SIZE.d_model // TINY_SIZE.n_heads, attn_implementation="eager"))
        try:
            readme(gemma)
        except ValueError as error:
            results["forward does more"] = str(error)
        alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank
        one_stage = RUNTIMES["1f1b"].PipelineRank
        for family, bad in [*((family, None) for family in hf_models.FAMILIES),
                            ("llama", lambda layer, x: (layer(x),))]:
            pipe = one_stage(cut(seeded(*first_of[family]), 1)[0], plain_loss,
                             RUNTIMES["1f1b"].schedule(1, MICRO),
                             (BATCH // MICRO, TINY_SIZE.seq_len, TINY_SIZE.d_model),
                             group=alone, call_layer=bad)
            try:
                pipe.run(*token_batches()[0])
            except TypeError as error:
                results[("error", family, "none" if bad is None else "tuple")] = str(error)
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _train_the_grid(rank: int, world: int, port: int, out: str) -> None:
    """GRID's runs of p = `world`, on both decoders: the tiny ones at p 2 (4 layers, the 4
    stages of interleaving and ZBV), the deeper ones at p 4."""
    join(rank, world, port)
    common.setup(common.parser(None).parse_args(["--timeout", "60"]))
    torch.set_num_threads(1)
    size = TINY_SIZE if world == 2 else DEEPER_TINY
    try:
        results = {("grid", kind, model_name, p, m, rank): train(
            kind, tiny_decoder(model_name, size=size), None, m=m)
            for kind, p, m in GRID if p == world for model_name in ("gpt", "llama")}
        torch.save(results, Path(out) / f"grid{world}-rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, out: str) -> None:
    """One start a world size (a world's start-up costs seconds): every runtime; at 2 ranks
    then the HuggingFace models, in a folder and on a port of their own; at 2 and 4, the grid's
    runs, on a third port."""
    if world != 4:
        _train_every_runtime(rank, world, port, out)
    if world in (2, 4):
        _train_the_grid(rank, world, port + 2, out)
    if world == 2:
        (Path(out) / "hf models").mkdir(exist_ok=True)
        _train_hf_models(rank, world, port + 1, str(Path(out) / "hf models"))
    # as run_main ends a script: no interpreter teardown, where gloo's ranks have aborted in
    # C++ after a good run ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Each world's ranks forked from this process: torch and the recipes imported once, not
    once a rank."""
    out, fork = tmp_path_factory.mktemp("runtimes"), multiprocessing.get_context("fork")
    for world in (2, 3, 4):
        port = common.free_port(block=3)  # the runtimes' store, the HuggingFace models', grid'
        ranks = [fork.Process(target=_spawned, args=(r, world, port, str(out)))
                 for r in range(world)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=600)
        for p in ranks:  # past the timeout: a hang is a failure, not a wait
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in ranks] == [0] * world
    return out


@pytest.fixture(scope="module")
def trained(spawned):
    results = {}
    for path in [*spawned.glob("world*.pt"), *spawned.glob("grid*.pt")]:
        results.update(torch.load(path, weights_only=False))
    return results


def unsplit(model_name: str, model: common.Decoder | None = None
            ) -> tuple[list[float], common.Decoder]:
    """The losses and final weights of `model` (default: the tiny decoder of seed 0) trained
    whole on the runtimes' batches."""
    model = model or tiny_decoder(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens, targets in token_batches():
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
@pytest.mark.parametrize("kind", list(RUNTIMES))
def test_a_runtime_on_a_sub_group_trains_as_on_a_world_of_two(trained, kind, model_name):
    """Ranks {0, 1} and {1, 2} of a world of 3, the third idle: the same losses and weights, to
    the bit, as on a world of 2; and those are the unsplit model's, to float rounding (the GPT's
    tied embedding and head summed across the first and last stage, the Llama's left alone)."""
    world = [trained[("world", kind, model_name, r)] for r in (0, 1)]
    for name in ("ranks 0 1", "ranks 1 2"):
        sub = [trained[(name, kind, model_name, r)] for r in (0, 1)]
        for ours, theirs in zip(sub, world, strict=True):
            assert ours["losses"] == theirs["losses"]
            assert all(torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"],
                                                         strict=True))
    reference, _ = unsplit(model_name)
    assert max_relative_difference(world[LOSS_RANK[kind]]["losses"], reference) <= 1e-5


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
@pytest.mark.parametrize("kind, p, m", GRID)
def test_interleaved_and_zero_bubble_train_the_unsplit_model_at_p_2_and_4_m_4_and_8(
        trained, kind, p, m, model_name):
    """Interleaving (v 2), ZB-H1 and ZBV at p 2 (the tiny decoders) and 4 (the deeper ones), m 4
    and 8: the unsplit model's losses to 1e-5, relative."""
    reference, _ = unsplit(model_name, tiny_decoder(model_name, size=TINY_SIZE if p == 2
                                                    else DEEPER_TINY))
    losses = trained[("grid", kind, model_name, p, m, p - 1 if LOSS_RANK[kind] else 0)]["losses"]
    assert max_relative_difference(losses, reference) <= 1e-5


@pytest.mark.parametrize("kind", ["baseline", "1f1b", "interleaved", "zb"])
def test_a_tied_head_is_summed_on_its_two_stages_an_untied_one_nowhere(trained, kind):
    """By identity: the GPT's embedding is its head (both ends hold it and sum its gradients,
    so its two copies stay one weight, the unsplit model's), the Llama's is not."""
    assert [trained[("world", kind, "gpt", r)]["tied"] for r in (0, 1)] == [1, 1]
    assert [trained[("world", kind, "llama", r)]["tied"] for r in (0, 1)] == [0, 0]
    _, gpt = unsplit("gpt")
    embedding = common.input_embedding(gpt).weight
    assert embedding is common.output_head(gpt).weight
    first, last = (trained[("world", kind, "gpt", r)]["weights"] for r in (0, 1))
    assert torch.equal(first[0], last[-1])  # the embedding's copy, the head's
    assert torch.allclose(first[0], embedding.detach(), rtol=0, atol=1e-6)


def test_no_timeline_is_recorded_unless_asked(trained):
    """Asked for none, a runtime never read its clock (it had none: `NoClock`), so on CUDA it
    never synchronised; asked, it records every step's actions, as scheduled, and trains the
    same."""
    for key, result in trained.items():
        assert (result["timelines"] == []) == (key[0] != "timeline"), key
    schedule = RUNTIMES["1f1b"].schedule(2, MICRO)
    for r in (0, 1):
        timed, untimed = trained[("timeline", "1f1b", "llama", r)], \
            trained[("world", "1f1b", "llama", r)]
        assert timed["losses"] == untimed["losses"] and len(timed["timelines"]) == STEPS
        for _, actions in timed["timelines"]:
            assert [(a["kind"], a["micro"], a["stage"]) for a in actions] == \
                [tuple(a) for a in schedule[r]]


@pytest.mark.parametrize("kind, model_name", SEEDED_APART)
def test_ranks_seeded_apart_train_as_if_seeded_the_same(trained, kind, model_name):
    """Rank r seeds r, then `broadcast_parameters` makes every rank's whole model rank 0's
    before the cut: the same losses and weights, to the bit, as with both ranks seeded 0 (not
    a patchwork of the two ranks' stages, nor only a tied weight made equal)."""
    for r in (0, 1):
        apart, same = (trained[(run, kind, model_name, r)] for run in ("seeded apart", "world"))
        assert apart["losses"] == same["losses"]
        assert all(map(torch.equal, apart["weights"], same["weights"]))


@pytest.fixture(scope="module")
def hf_models_trained(spawned):
    """What `_train_hf_models` saved, rank by rank."""
    return [torch.load(spawned / "hf models" / f"rank{r}.pt", weights_only=False)
            for r in (0, 1)]


def readme_losses(trained: list[dict], name: str) -> list[float]:
    """The README's lines' losses on `name`'s model: the last rank's (the first rank, not the
    last stage, returns 0 a step)."""
    assert trained[0][(name, "readme")] == [0.0] * STEPS
    return trained[-1][(name, "readme")]


def test_the_huggingface_models_are_every_family_and_attention_seeded_apart(hf_models_trained):
    """The models the lines below run on: the three families, sdpa and eager, each rank's own
    draw before the README's `broadcast_parameters` (so a stage kept from rank 1's seed would
    not be DDP's model)."""
    cases = hf_models_trained[0]["cases"]
    assert {case.split("-")[0] for case in cases} == {"llama", "qwen2", "mistral"}
    assert {case.split("-")[1] for case in cases} == {"sdpa", "eager"} and len(cases) == 6
    apart = {key: seeded for key, seeded in hf_models_trained[0].items()
             if key[-1] == "seeded apart"}
    assert len(apart) == 13 and all(apart.values()), apart


@pytest.mark.parametrize("kind", ["readme", *HF_RUNTIMES])
def test_every_runtime_trains_each_huggingface_family_like_ddp(hf_models_trained, kind):
    """On each of hf_models.CASES (Llama, Qwen2 with q/k/v biases and rotary base 1e6,
    Mistral; sdpa and eager; tied and untied heads), rank r seeded r: the README's lines (1F1B)
    and every other runtime, through the lines' `call_layer`, train DDP's model on the same
    global batch (its first rank's weights) to 1e-5: eager is causal (its mask made as the
    model makes it), the rotary is the model's, and no stage is another rank's initialisation."""
    for case in hf_models_trained[0]["cases"]:
        reference = hf_models_trained[0][(case, "ddp")]
        losses = readme_losses(hf_models_trained, case) if kind == "readme" else \
            hf_models_trained[LOSS_RANK[kind]][(case, kind)]
        assert max_relative_difference(losses, reference) <= 1e-5, case


@pytest.mark.parametrize("name", ["fused", "rope scaling", *WINDOWED])
def test_the_readme_trains_fused_projections_a_scaled_rotary_and_windows_like_ddp(
        hf_models_trained, name):
    """Phi-3's fused qkv_proj and gate_up_proj, a Llama whose rotary is scaled (linear), and
    sliding windows shorter than the sequence (WINDOWED), eager: the model's own layers,
    rotary_emb and masks do the work, so the README's lines train DDP's model to 1e-5,
    refusing nothing."""
    losses = readme_losses(hf_models_trained, name)
    assert max_relative_difference(losses, hf_models_trained[0][(name, "ddp")]) <= 1e-5


def test_the_readme_names_no_family_and_trains_from_the_logits_as_written():
    """The README's lines take the trainer's model (they build none and import no family's
    classes), call its decoder layers with its own rotary and transformers' own mask builder,
    and compute the loss from the last stage's logits against targets already shifted, never
    `labels=` (which HuggingFace shifts again)."""
    lines = readme_python_block(README)
    for family_or_building in ("Llama", "Qwen", "Mistral", "Phi", "Config", "DecoderLayer",
                               "from_pretrained", "model = ", "manual_seed"):
        assert family_or_building not in lines, family_or_building
    assert "broadcast_parameters(model)" in lines and "call_layer=call_layer" in lines
    assert "model.model.rotary_emb" in lines and "create_masks_for_generate(" in lines
    assert "labels" not in lines and "F.cross_entropy(logits" in lines


def test_the_readme_keeps_bf16_weights_bf16_and_trains_like_ddp_in_bf16(hf_models_trained):
    """The README's lines (1F1B) on each family in bf16 weights (no autocast), ranks seeded
    apart: every stage's weights, and so the activations sent between stages, stay bf16; the
    last stage's losses are DDP's on the same bf16 model and global batch within
    BF16_TOLERANCE."""
    for family in ("llama", "qwen2", "mistral"):
        name = f"{family} bf16"
        for trained in hf_models_trained:
            assert trained[(name, "readme dtypes")] == {torch.bfloat16}
        losses = readme_losses(hf_models_trained, name)
        reference = hf_models_trained[0][(name, "ddp")]
        assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)
                   ) <= BF16_TOLERANCE, (family, losses, reference)


def test_a_forward_that_does_more_than_its_layers_is_refused_in_one_line(hf_models_trained):
    """Gemma 2's forward softcaps the logits after its head: the layers so called compute
    other logits, and the README's lines stop before the cut, naming the model's class and
    `call_layer`, rather than pipeline another model."""
    for trained in hf_models_trained:
        error = trained["forward does more"]
        assert "Gemma2ForCausalLM" in error and "call_layer" in error
        assert len(error.splitlines()) == 1, error


def test_layers_the_runtime_cannot_call_stop_it_with_one_line_naming_call_layer(
        hf_models_trained):
    """Each family's decoder layers passed as they come (without `call_layer`), and a
    `call_layer` that returns a tuple: one line each, naming the layer and `call_layer`."""
    for trained in hf_models_trained:
        for family, layer in [("llama", "LlamaDecoderLayer"), ("qwen2", "Qwen2DecoderLayer"),
                              ("mistral", "MistralDecoderLayer")]:
            missing = trained[("error", family, "none")]
            assert layer in missing and "as layer(x)" in missing
            assert len(missing.splitlines()) == 1 and "pass call_layer=" in missing.lower()
        tupled = trained[("error", "llama", "tuple")]
        assert "returns tuple, not a tensor" in tupled
        assert len(tupled.splitlines()) == 1 and "pass call_layer=" in tupled.lower()
