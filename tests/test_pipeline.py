"""Unit tests for 05_pipeline's pure parts: the schedules as data, the simulator that turns them
into an ideal bubble, the cut into stages, and the timeline drawing."""

import json

import pytest

import common
from helpers import load_recipe

FOLDER = common.ROOT / "05_pipeline"
RECIPES = {name: load_recipe(FOLDER / f"{script}.py") for name, script in [
    ("naive", "baseline_pipeline"), ("gpipe", "optimized_pipeline_gpipe"),
    ("1f1b", "optimized_pipeline_1f1b")]}
UNIFORM = {"F": 1.0, "B": 2.0}  # a backward costs two forwards


def check_valid(schedule, p, m, micro):
    """Every rank runs each of its micro-batches' F once, then its B once."""
    assert len(schedule) == p
    for actions in schedule:
        assert sorted(actions) == sorted([("F", i) for i in range(micro)] +
                                         [("B", i) for i in range(micro)])
        for i in range(micro):
            assert actions.index(("F", i)) < actions.index(("B", i))
        for kind in "FB":  # each link carries micro-batches in order, both ways
            order = [a.mb for a in actions if a.kind == kind]
            assert order == sorted(order)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("m", range(1, 33))
def test_schedules_run_without_deadlock_with_the_formulas_bubble(name, p, m):
    recipe = RECIPES[name]
    schedule = recipe.schedule(p, m)
    check_valid(schedule, p, m, m)
    bubble, inflight = recipe.simulate(schedule, [UNIFORM] * p)  # raises on a deadlock
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert inflight == (m if name == "gpipe" else min(p, m))


@pytest.mark.parametrize("p", range(2, 9))
def test_the_naive_baseline_leaves_each_rank_idle_p_minus_1_over_p(p):
    recipe = RECIPES["naive"]
    schedule = recipe.schedule(p, 1)
    check_valid(schedule, p, 1, 1)
    assert recipe.simulate(schedule, [UNIFORM] * p) == (pytest.approx((p - 1) / p), 1)


def test_the_simulator_finds_a_deadlock_and_uneven_stages_widen_the_bubble():
    recipe = RECIPES["1f1b"]
    A = recipe.Action
    with pytest.raises(ValueError, match="deadlock"):  # rank 1 wants B0 before its F0
        recipe.simulate([[A("F", 0), A("B", 0)], [A("B", 0), A("F", 0)]], [UNIFORM] * 2)
    even, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM] * 2)
    uneven, _ = recipe.simulate(recipe.schedule(2, 8), [UNIFORM, {"F": 1.5, "B": 3.0}])
    assert uneven > even


@pytest.mark.parametrize("n, p", [(8, 2), (8, 3), (4, 4), (10, 7)])
def test_stages_are_contiguous_and_differ_by_at_most_one_layer(n, p):
    stages = RECIPES["1f1b"].cut(n, p)
    assert [i for stage in stages for i in stage] == list(range(n))
    assert max(map(len, stages)) - min(map(len, stages)) <= 1 and min(map(len, stages)) >= 1


def test_the_timeline_draws_each_action_where_it_ran(tmp_path):
    timelines = [[("F", 0, 0.0, 0.25), ("B", 0, 0.5, 1.0)], [("F", 0, 0.25, 0.5)]]
    text = common.render_timeline(timelines, width=8)
    assert text.splitlines()[1:] == ["rank  0 |F0..B0BB|", "rank  1 |..F0....|"]
    args = common.parser(None).parse_args(["--results", str(tmp_path / "r.jsonl")])
    common.write_timeline_trace(timelines, args, common.Topology(0, 0, 2, 2, 1, "gloo", None))
    (trace,) = (tmp_path / "traces").iterdir()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("F0", 0, 0.0, 250000.0), ("B0", 0, 500000.0, 500000.0), ("F0", 1, 250000.0, 250000.0)]
