"""The step-time model pinned on recorded runs: tests/fixtures/records_steptime.jsonl holds the
records of one `make all report` and `make all report MODEL=llama` (2 CPU processes at `small`,
the composed runs at 4 and 8) and tests/fixtures/calibration_small.json the calibration they
were predicted with. Each record's predicted_step_ms is the model's answer to the work it
recorded; report/README.md's hit rate is theirs, and it names every row the model misses by more
than 30%. tests/fixtures/records_h200.jsonl holds runs of one process on an H200 and
calibration_h200.json the calibration of that GPU they are priced at in report/README.md."""

import json
import re

import pytest

import common
from report import costmodel, results_table

FIXTURES = common.ROOT / "tests" / "fixtures"
README = common.ROOT / "report" / "README.md"
CALIBRATION = json.loads((FIXTURES / "calibration_small.json").read_text())
RECORDS = [r for r in common.load_results(FIXTURES / "records_steptime.jsonl")
           if r.get("predicted_step_ms") is not None]


def repredicted(rec: dict, calibration: dict = CALIBRATION) -> dict:
    """The model's step for a record's own work at a fixture's calibration."""
    work = dict(rec["prediction"]["work"])
    work["collectives"] = {op: tuple(value) for op, value in work["collectives"].items()}
    rates = costmodel.rates_from_calibration(calibration["sizes"][rec["size"]], rec["world_size"],
                                          rec["model"])
    return costmodel.predict_step(costmodel.StepWork(**work), rates)


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
    readme = README.read_text()
    assert f"{len(near)} of {len(RECORDS)} rows within ±15%" in readme, \
        results_table.prediction_summary(RECORDS)


def test_the_readme_explains_every_miss_over_30_percent():
    """Each script off by more than 30% is named in the README's list of the model's misses."""
    readme = README.read_text()
    misses = readme.split("<!-- misses:start -->")[1].split("<!-- misses:end -->")[0]
    over = {r["script"] for r in RECORDS
            if abs(results_table.prediction_error(r)) > results_table.PREDICTION_MISS}
    named = set(re.findall(r"`(\w+)`", misses))
    assert over <= named, over - named


# --- one H200 ---------------------------------------------------------------------------------
H200_CALIBRATION = json.loads((FIXTURES / "calibration_h200.json").read_text())
H200_RECORDS = common.load_results(FIXTURES / "records_h200.jsonl")


def h200_table() -> str:
    """report/README.md's table of the H200 runs: each run's measured step beside the model's
    for its recorded work at the fixture's calibration (the runs before it carry the
    prediction of an earlier calibration: they are priced again)."""
    from tabulate import tabulate

    rows = []
    for rec in H200_RECORDS:
        predicted = repredicted(rec, H200_CALIBRATION)
        rows.append([f"`{results_table.script_label(rec)}`", rec["model"], rec["size"],
                     f"{rec['step_ms']:.1f}", f"{predicted['step_ms']:.1f}",
                     f"{predicted['step_ms'] / rec['step_ms'] - 1:+.0%}",
                     f"{predicted['compute_ms']:.1f} + {predicted['optimizer_ms']:.1f}"])
    return tabulate(rows, ["run", "model", "size", "measured ms", "predicted ms", "off by",
                           "compute + AdamW ms"], tablefmt="github")


def test_the_h200_runs_are_one_gpu_in_bf16_and_the_last_ones_carry_the_fixtures_prediction():
    assert {(r["device"], r["world_size"], r["dtype"]) for r in H200_RECORDS} == {
        ("NVIDIA H200", 1, "bf16")}
    ids = {entry["id"] for entry in H200_CALIBRATION["sizes"].values()}
    priced_here = [r for r in H200_RECORDS if r["prediction"]["calibration"] in ids]
    assert len(priced_here) == 3
    for rec in priced_here:
        assert repredicted(rec, H200_CALIBRATION)["step_ms"] == pytest.approx(
            rec["predicted_step_ms"], rel=1e-3)


def test_the_readme_shows_the_h200_table_the_fixtures_give():
    block = README.read_text().split("<!-- h200:start -->\n")[1].split("<!-- h200:end -->")[0]
    assert block.strip() == h200_table(), "\n" + h200_table()


# --- speedups: the ratio of two steps priced alike ------------------------------------------
def test_a_predicted_speedup_is_the_baselines_predicted_step_over_the_runs():
    """`python -m report --json`: every run of the table, its measured and predicted steps, and
    beside a baseline it is compared with, both speedups; the fixture's, priced as they ran."""
    rows = results_table.json_rows(costmodel.priced(RECORDS, CALIBRATION))
    compared = [r for r in rows if r["speedup"] is not None]
    assert len(compared) >= 40
    for row in compared:
        assert row["speedup"] == pytest.approx(row["baseline_step_ms"] / row["step_ms"],
                                               rel=1e-3)
        assert row["predicted_speedup"] == pytest.approx(
            row["baseline_predicted_step_ms"] / row["predicted_step_ms"], rel=1e-3)
    assert all(r["speedup"] is None and r["predicted_speedup"] is None for r in rows
               if r["baseline"] is None)


# --- the ratio runs: records carrying their work, priced at the calibration their run took ----
RATIO_CALIBRATION = json.loads((FIXTURES / "calibration_ratios.json").read_text())
RATIO_RECORDS = costmodel.priced(common.load_results(FIXTURES / "records_ratios.jsonl"),
                                 RATIO_CALIBRATION)


def test_the_ratio_runs_are_priced_at_the_quick_calibrations_their_make_runs_took():
    """`make ddp zero pipeline` and `make all MODEL=llama SIZE=tiny`: each record carries its
    work, no prediction of its own; the report prices each at the newest quick calibration of
    its size taken before it ran."""
    measured = [r for r in RATIO_RECORDS if r.get("step_ms") is not None]
    assert measured and all("work" in r and r["prediction"].get("calibration") for r in measured
                            if r["model"] != "resnet")
    used = {r["prediction"]["calibration"] for r in measured if r["model"] != "resnet"}
    assert all(entry["quick"] for entry in costmodel.calibrations(RATIO_CALIBRATION)
               if entry["id"] in used)


def test_the_readme_states_the_ratio_runs_hit_rates():
    """The README's counts for the ratio runs: speedups within 15%, steps within 25%."""
    readme = README.read_text()
    block = readme.split("<!-- ratios:start -->")[1].split("<!-- ratios:end -->")[0]
    errors = [(rec, results_table.speedup_error(rec, base))
              for rec, base in results_table.compared_pairs(RATIO_RECORDS)]
    errors = [(rec, e) for rec, e in errors if e is not None]
    near = sum(abs(e) <= results_table.PREDICTION_BAND for _, e in errors)
    assert f"{near} of {len(errors)} speedups within ±15%" in block
    steps = [results_table.prediction_error(r) for r in results_table.latest_runs(RATIO_RECORDS)
             if "sweep" not in r]
    steps = [e for e in steps if e is not None]
    assert f"{sum(abs(e) <= 0.25 for e in steps)} of {len(steps)} steps within ±25%" in block
    over = {rec["script"] for rec, e in errors if abs(e) > results_table.PREDICTION_MISS}
    assert over <= set(re.findall(r"`(\w+)`", block)), over


def measured_speedups(records: list[dict]) -> dict[tuple, float]:
    """Each compared run's measured speedup, by what names the run: folder, script, variant,
    world, size and model."""
    return {(rec["folder"], rec["script"], rec.get("variant"), rec["world_size"], rec["size"],
             rec["model"]): base["step_ms"] / rec["step_ms"]
            for rec, base in results_table.compared_pairs(results_table.latest_runs(records))}


def test_the_readme_states_how_closely_the_measured_speedups_repeat():
    """The ratio runs made again (records_ratios_rerun.jsonl): at each size, how many measured
    speedups the two runs agree on within ±15%, and the largest move, as the README says."""
    block = README.read_text().split("<!-- ratios:start -->")[1].split("<!-- ratios:end -->")[0]
    block = " ".join(block.split())
    first = measured_speedups(common.load_results(FIXTURES / "records_ratios.jsonl"))
    again = measured_speedups(common.load_results(FIXTURES / "records_ratios_rerun.jsonl"))
    assert set(first) == set(again)
    moves = {size: [again[k] / first[k] - 1 for k in first if k[4] == size]
             for size in ("small", "tiny")}
    for size, changes in moves.items():
        near = sum(abs(c) <= results_table.PREDICTION_BAND for c in changes)
        assert f"{near} of {len(changes)} speedups at `{size}`" in block.replace("**", "")
    assert f"up to {round(100 * max(map(abs, moves['tiny'])))}%" in block
