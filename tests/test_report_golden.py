"""The report's output on fixed records, held to what it printed before a change: the results
table (tests/fixtures' records of real runs), what each chart draws, and the planner's tables
and picks. A change to any of them is deliberate: rewrite the expected files with
`python tests/test_report_golden.py` and let the diff show what changed."""

import argparse
import contextlib
import io
import json
import sys
import unittest.mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find `common`

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

import common
from report import charts, cli, costmodel

FIXTURES = common.ROOT / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
RECORDS = ("records_small.jsonl", "records_mesh.jsonl")
# the seed cases' dry runs, from `make dryrun` on 2026-11-28 (every other dry run left out)
PLANS = {"plan_cases": ["--cases", "--dry-results", str(FIXTURES / "dryrun_seed_cases.jsonl")],
         "plan_7b_8": ["--params", "7e9", "--gpus", "8", "--gpu-mem", "80"],
         "plan_70b_64_llama": ["--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--llama"],
         "plan_1b_4_fp32": ["--params", "1.5e9", "--gpus", "4", "--gpu-mem", "24", "--dtype",
                            "fp32", "--layers", "48", "--hidden", "1600", "--vocab", "50257",
                            "--seq-len", "1024"],
         "plan_published": ["--published"]}


def _report(*flags: str) -> str:
    """What `python -m report` with `flags` prints, run in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(list(flags)) == 0
    return out.getvalue()


def _table(name: str, tmp, *flags: str) -> str:
    return _report("--results", str(FIXTURES / name), "--out", str(tmp / "report.md"), *flags)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def chart_picture(records: list[dict]) -> dict:
    """What each chart draws, as data: titles, ticks, every bar (place, size, colour, hatch),
    every word and where it sits, every line's points."""
    picture = {}
    for name, fig in charts.draw_charts(records).items():
        axes = []
        for ax in fig.axes:
            axes.append({
                "title": ax.get_title(), "xlim": [_round(v) for v in ax.get_xlim()],
                "yticks": [t.get_text() for t in ax.get_yticklabels()],
                "bars": [[_round(p.get_x()), _round(p.get_y()), _round(p.get_width()),
                          _round(p.get_height()), to_hex(p.get_facecolor()), p.get_hatch()]
                         for p in ax.patches],
                "bar_collections": [[to_hex(c.get_facecolor()[0]), c.get_hatch(),
                                     [[_round(v) for v in path.vertices.ravel()[:4]]
                                      for path in c.get_paths()]] for c in ax.collections],
                "words": [[_round(t.get_position()[0]), _round(t.get_position()[1]),
                           t.get_text()] for t in ax.texts],
                "lines": [[[_round(v) for v in line.get_xdata()],
                           [_round(v) for v in line.get_ydata()]] for line in ax.lines]})
        picture[name] = {"title": fig._suptitle.get_text() if fig._suptitle else "",
                         "axes": axes}
        plt.close(fig)
    return picture


# The step-time model's calibration the tables are priced at: a fixture's, not this host's
# outputs/calibration.json (absent on a fresh clone), so that a record that carries its work is
# priced alike everywhere.
CALIBRATION = FIXTURES / "calibration_small.json"


def outputs(tmp) -> dict[str, str]:
    with unittest.mock.patch.object(costmodel, "CALIBRATION", CALIBRATION):
        return _outputs(tmp)


def _outputs(tmp) -> dict[str, str]:
    out = {}
    for name in RECORDS:
        stem = name.removesuffix(".jsonl")
        out[f"{stem}.md"] = _table(name, tmp)
        out[f"{stem}_wide.md"] = _table(name, tmp, "--wide")
        out[f"{stem}_charts.json"] = json.dumps(
            chart_picture(common.load_results(FIXTURES / name)), indent=1) + "\n"
    for name, flags in PLANS.items():
        out[f"{name}.txt"] = _report("plan", *flags)
    return out


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    return outputs(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", [f"{r.removesuffix('.jsonl')}{kind}" for r in RECORDS
                                  for kind in (".md", "_wide.md", "_charts.json")]
                         + [f"{p}.txt" for p in PLANS])
def test_the_report_prints_what_it_printed_before(produced, name):
    assert produced[name] == (GOLDEN / name).read_text(), \
        f"{name} changed: if on purpose, run `python tests/test_report_golden.py` and commit"


if __name__ == "__main__":
    import tempfile

    argparse.ArgumentParser(description=__doc__).parse_args()
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in outputs(Path(tmp)).items():
            (GOLDEN / name).write_text(text)
            print(f"wrote {GOLDEN / name}")
