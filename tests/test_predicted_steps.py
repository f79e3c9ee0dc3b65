"""The step-time model pinned on recorded runs: tests/fixtures/records_steptime.jsonl holds the
records of one `make all report` and `make all report MODEL=llama` (2 CPU processes at `small`,
the composed runs at 4 and 8) and tests/fixtures/calibration_small.json the calibration they
were predicted with. Each record's predicted_step_ms is the model's answer to the work it
recorded; the README's hit rate is theirs, and it names every row the model misses by more than
30%."""

import json
import re

import pytest

import common
from report import results_table

FIXTURES = common.ROOT / "tests" / "fixtures"
CALIBRATION = json.loads((FIXTURES / "calibration_small.json").read_text())
RECORDS = [r for r in common.load_results(FIXTURES / "records_steptime.jsonl")
           if r.get("predicted_step_ms") is not None]


def repredicted(rec: dict) -> dict:
    """The model's step for a record's own work at the fixture's calibration."""
    work = dict(rec["prediction"]["work"])
    work["collectives"] = {op: tuple(value) for op, value in work["collectives"].items()}
    rates = common.rates_from_calibration(CALIBRATION["sizes"][rec["size"]], rec["world_size"],
                                          rec["model"])
    return common.predict_step(common.StepWork(**work), rates)


def test_the_fixture_is_one_make_all_of_each_model_with_its_calibration():
    assert {r["model"] for r in RECORDS} >= {"gpt", "llama"}
    assert {r["world_size"] for r in RECORDS} == {2, 4, 8}
    assert {r["prediction"]["calibration"] for r in RECORDS} == {CALIBRATION["sizes"]["small"]
                                                                 ["id"]}


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: f"{r['model']}-{r['world_size']}-"
                         f"{results_table.script_label(r).replace(' ', '')}")
def test_each_prediction_is_the_model_on_the_recorded_work(rec):
    predicted = repredicted(rec)
    assert predicted["step_ms"] == pytest.approx(rec["predicted_step_ms"], rel=1e-3, abs=1e-3)
    assert predicted["bound_by"] == rec["prediction"]["bound_by"]
    parts = ("compute_ms", "communication_ms", "bubble_ms", "optimizer_ms")
    assert sum(rec["prediction"][p] for p in parts) == pytest.approx(rec["predicted_step_ms"],
                                                                     abs=0.01)


def test_the_readme_states_the_hit_rate_the_records_give():
    """The README's count of rows within 15% (`N of M rows`) is the fixture's, not typed in
    from another run."""
    near = [r for r in RECORDS
            if abs(results_table.prediction_error(r)) <= results_table.PREDICTION_BAND]
    readme = (common.ROOT / "README.md").read_text()
    assert f"{len(near)} of {len(RECORDS)} rows within ±15%" in readme, \
        results_table.prediction_summary(RECORDS)


def test_the_readme_explains_every_miss_over_30_percent():
    """Each script off by more than 30% is named in the README's list of the model's misses."""
    readme = (common.ROOT / "README.md").read_text()
    misses = readme.split("<!-- misses:start -->")[1].split("<!-- misses:end -->")[0]
    over = {r["script"] for r in RECORDS
            if abs(results_table.prediction_error(r)) > results_table.PREDICTION_MISS}
    named = set(re.findall(r"`(\w+)`", misses))
    assert over <= named, over - named
