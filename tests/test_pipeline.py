"""Unit tests for 05_pipeline's pure parts: the schedules as data, the simulator that turns them
into an ideal bubble, the cut into stages, and the timeline drawing."""

import collections
import json

import pytest

import common
from helpers import load_recipe

FOLDER = common.ROOT / "05_pipeline"
RECIPES = {name: load_recipe(FOLDER / f"{script}.py") for name, script in [
    ("naive", "baseline_pipeline"), ("gpipe", "optimized_pipeline_gpipe"),
    ("1f1b", "optimized_pipeline_1f1b"), ("dualpipev", "optimized_pipeline_dualpipev"),
    ("dualpipe", "optimized_pipeline_dualpipe")]}
UNIFORM = {"F": 1.0, "B": 2.0}  # a backward costs two forwards
SPLIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # and splits into equal I and W


def check_valid(recipe, p, m):
    """Each micro-batch's F of each stage runs once, on the rank `rank_of` names, then its B, or
    its I and later its W; each link carries each kind of message in the order both ends expect
    (NCCL matches a link's sends and receives in order, per process group)."""
    schedule, stages = recipe.schedule(p, m), recipe.n_stages(p)
    assert len(schedule) == p
    for r, actions in enumerate(schedule):
        assert len(set(actions)) == len(actions)
        index = {(a.kind, a.mb, a.stage): i for i, a in enumerate(actions)}
        for mb in range(m):
            for stage in range(stages):
                here = recipe.rank_of(stage, mb, p, m) == r
                f, b = index.get(("F", mb, stage)), index.get(("B", mb, stage))
                i, w = index.get(("I", mb, stage)), index.get(("W", mb, stage))
                assert (f is not None) == here
                if here:
                    assert (b is None) != (i is None) and (i is None) == (w is None)
                    assert f < (b if b is not None else i) and (w is None or i < w)
    sent, received = collections.defaultdict(list), collections.defaultdict(list)
    for r, actions in enumerate(schedule):
        for a in actions:  # what each action receives and sends over the network, in order
            if a.kind == "W":
                continue
            step = 1 if a.kind == "F" else -1
            src_stage, dst_stage = a.stage - step, a.stage + step
            if 0 <= src_stage < stages and (src := recipe.rank_of(src_stage, a.mb, p, m)) != r:
                received[(src, r, a.kind == "F")].append((a.mb, a.stage))
            if 0 <= dst_stage < stages and (dst := recipe.rank_of(dst_stage, a.mb, p, m)) != r:
                sent[(r, dst, a.kind == "F")].append((a.mb, dst_stage))
    assert sent == received


def idle_time(recipe, schedule, seconds, paired=False):
    """The simulated idle time of a rank (all ranks do the same work here), from the fraction."""
    p = len(schedule)
    bubble, inflight = recipe.simulate(schedule, [seconds] * p, paired=paired)
    busy = sum(seconds[a.kind] for a in schedule[0])
    return busy / (1 - bubble) - busy, inflight


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("m", range(1, 33))
def test_schedules_run_without_deadlock_with_the_formulas_bubble(name, p, m):
    recipe = RECIPES[name]
    check_valid(recipe, p, m)
    bubble, inflight = recipe.simulate(recipe.schedule(p, m), [UNIFORM] * p)  # raises if stuck
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert inflight == (m if name == "gpipe" else min(p, m))


@pytest.mark.parametrize("p", range(2, 9))
def test_the_naive_baseline_leaves_each_rank_idle_p_minus_1_over_p(p):
    recipe = RECIPES["naive"]
    check_valid(recipe, p, 1)
    assert recipe.simulate(recipe.schedule(p, 1), [UNIFORM] * p) == (pytest.approx((p - 1) / p), 1)


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("m", range(4, 33))
@pytest.mark.parametrize("w", [1.0, 0.5, 0.0])
def test_dualpipe_schedules_have_the_papers_bubble_and_activations(name, p, m, w):
    """DeepSeek's table, per device: bubble (PP/2-1)(F&B + B - 3W), activations PP+1 stages'
    (PP stages: 2p for DualPipeV, p for DualPipe; F&B = F + B on one thread). The table holds
    when a paired F and B wait for each other and F = I."""
    recipe, stages = RECIPES[name], RECIPES[name].n_stages(p)
    if m < 2 * p or (name == "dualpipe" and (p % 2 or m % 2)):
        pytest.skip("outside DeepSeek's constraints, which the scripts refuse")
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
    one_f_one_b, _ = RECIPES["1f1b"].simulate(RECIPES["1f1b"].schedule(p, m), [UNIFORM] * p)
    half = {k: v / 2 for k, v in SPLIT.items()}
    v, _ = RECIPES["dualpipev"].simulate(RECIPES["dualpipev"].schedule(p, m), [half] * p)
    assert v < one_f_one_b / 2


def test_the_simulator_finds_a_deadlock_and_uneven_stages_widen_the_bubble():
    recipe = RECIPES["1f1b"]
    A = recipe.Action
    with pytest.raises(ValueError, match="deadlock"):  # rank 1 wants B0 before its F0
        recipe.simulate([[A("F", 0, 0), A("B", 0, 0)], [A("B", 0, 1), A("F", 0, 1)]],
                        [UNIFORM] * 2)
    even, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM] * 2)
    uneven, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM, {"F": 1.5, "B": 3.0}])
    assert uneven > even


@pytest.mark.parametrize("n, stages", [(8, 2), (8, 3), (4, 4), (10, 7)])
def test_equal_costs_cut_into_contiguous_stages_within_one_layer(n, stages):
    cut = RECIPES["1f1b"].cut([1] * n, stages)
    assert [i for stage in cut for i in stage] == list(range(n))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1 and min(map(len, cut)) >= 1


def test_the_cut_weighs_layers_by_their_matrix_multiplies():
    recipe = RECIPES["dualpipev"]
    layers = common.GPT(common.SIZES["small"], 32).pipeline_layers()
    costs = [recipe.layer_cost(layer) for layer in layers]
    assert costs[0] == 0 and costs[1] == 12 * 256**2 and costs[-1] == 1024 * 256  # head: 1/3
    # Four stages of two layers would put 2 blocks and the two light ends on the V's rank 0
    # and 4 blocks on rank 1; by cost the ranks get 3 blocks each.
    assert [list(s) for s in recipe.cut(costs, 4)] == [[0, 1, 2], [3], [4, 5], [6, 7]]
    assert [list(s) for s in recipe.cut(costs, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(s) for s in recipe.cut([0, 0, 0, 5], 4)] == [1, 1, 1, 1]  # never empty


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
