"""Unit tests for 05_pipeline's pure parts: the schedules as data, the simulator that turns them
into an ideal bubble, the cut into stages, and the timeline drawing."""

import collections
import json

import pytest
import torch

import common
from helpers import load_recipe

FOLDER = common.ROOT / "05_pipeline"
RECIPES = {name: load_recipe(FOLDER / f"{script}.py") for name, script in [
    ("gpipe", "optimized_pipeline_gpipe"),
    ("1f1b", "optimized_pipeline_1f1b"), ("dualpipev", "optimized_pipeline_dualpipev"),
    ("dualpipe", "optimized_pipeline_dualpipe")]}
UNIFORM = {"F": 1.0, "B": 2.0}  # a backward costs two forwards
SPLIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # and splits into equal I and W


def check_valid(recipe, p, m):
    """Each micro-batch's F of each stage runs once, on one rank, then on that rank its B, or its
    I and later its W; every stage of every micro-batch runs."""
    schedule = recipe.schedule(p, m)
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
        run_under_nccls_rule(schedule, recipe.simulate(schedule)[2], fifo)


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
    assert sum(map(len, sum(late, []))) == sum(map(len, sum(recipe.simulate(schedule)[2], [])))
    with pytest.raises(AssertionError, match="deadlock"):
        run_under_nccls_rule(schedule, late, fifo)
    run_under_nccls_rule(schedule, recipe.simulate(schedule)[2], fifo)


def idle_time(recipe, schedule, seconds, paired=False):
    """The simulated idle time of a rank (all ranks do the same work here), from the fraction."""
    p = len(schedule)
    bubble, inflight, _ = recipe.simulate(schedule, [seconds] * p, paired=paired)
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
    when a paired F and B wait for each other and F = I."""
    recipe = RECIPES[name]
    stages = 2 * p if name == "dualpipev" else p
    check_valid(recipe, p, m)
    assert sorted({a.stage for a in recipe.schedule(p, m)[0]}) == [0, stages - 1]
    seconds = {"F": 1.0, "I": 1.0, "W": w, "B": 1.0 + w}
    paired, inflight = idle_time(recipe, recipe.schedule(p, m), seconds, paired=True)
    F, B, W = seconds["F"], seconds["B"], seconds["W"]
    assert paired == pytest.approx((stages / 2 - 1) * ((F + B) + B - 3 * W))
    assert inflight == stages + 1


def test_dualpipev_idles_less_than_1f1b_on_the_same_ranks():
    """Same ranks, same model: DualPipeV's stages are half 1F1B's, so are their F, I, W."""
    p, m = 4, 8
    one_f_one_b, _, _ = RECIPES["1f1b"].simulate(RECIPES["1f1b"].schedule(p, m), [UNIFORM] * p)
    half = {k: v / 2 for k, v in SPLIT.items()}
    v, _, _ = RECIPES["dualpipev"].simulate(RECIPES["dualpipev"].schedule(p, m), [half] * p)
    assert v < one_f_one_b / 2


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
    text = common.render_timeline(timelines, width=8)
    assert text.splitlines()[1:] == ["rank  0 |F0..b0bb|", "rank  1 |..F0....|"]  # 2nd stage
    args = common.parser(None).parse_args(["--results", str(tmp_path / "r.jsonl")])
    common.write_timeline_trace(timelines, args, common.Topology(0, 0, 2, 2, 1, "gloo", None))
    (trace,) = (tmp_path / "traces").iterdir()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]["stage"]) for e in spans] == [
        ("F0", 0, 0.0, 250000.0, 0), ("B0", 0, 500000.0, 500000.0, 3),
        ("F0", 1, 250000.0, 250000.0, 1)]


def test_gathered_timelines_count_from_the_steps_first_start(tmp_path):
    """Each step's times from the moment its first rank started it (here the only rank, whose
    clock is rank 0's: offset 0); the bubble from busy time over the span to the last end."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        steps = [(100.0, [("F", 0, 0, 100.5, 101.0), ("B", 0, 0, 101.0, 102.0)]),
                 (200.0, [("F", 0, 0, 200.0, 201.0), ("B", 0, 0, 202.0, 204.0)])]
        args = common.parser(None).parse_args(["--results", str(tmp_path / "r.jsonl")])
        topo = common.Topology(0, 0, 1, 1, 1, "gloo", torch.device("cpu"))
        assert common.clock_offset(topo) == 0.0
        timed, bubble, means, held = common.gather_timelines(steps, 3, args, topo)
    finally:
        dist.destroy_process_group()
    assert timed == [[[("F", 0, 0, 0.5, 1.0), ("B", 0, 0, 1.0, 2.0)]],
                     [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 2.0, 4.0)]]]
    assert bubble == pytest.approx((0.25 + 0.25) / 2)  # 1.5 of 2 s busy, then 3 of 4
    assert means == [{"F": 0.75, "B": 1.5}] and held == 3
