"""report.py's charts, drawn from the records of a real `make all SIZE=small` run (2 CPU
processes; tests/fixtures/records_small.jsonl), and what happens when a folder has none."""

import json

import pytest

import common
import report

FIXTURE = common.ROOT / "tests" / "fixtures" / "records_small.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def records():
    return common.load_results(FIXTURE)


def test_every_chart_is_drawn_from_a_real_run(records, tmp_path):
    written = report.write_charts(records, tmp_path)
    assert [p.name for p in written] == list(report.CHARTS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_the_speedup_chart_pairs_exactly_what_the_table_compares(records):
    pairs = report.compared_pairs(records)
    table = report.render_report(records)
    compared = [line for line in table.splitlines() if line.startswith("| optimized")
                and line.split("|")[7].strip().endswith("x")]
    assert len(pairs) == len(compared) == 19
    assert all(rec["baseline"] == base["script"] for rec, base in pairs)


def test_the_report_links_the_charts_it_wrote(tmp_path):
    out = tmp_path / "report.md"
    assert report.main(["--results", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    for name in report.CHARTS:
        assert f"](charts/{name})" in text and (tmp_path / "charts" / name).exists()


def test_records_without_a_folders_data_draw_no_chart_for_it(records, tmp_path):
    only_ddp = [r for r in records if r["folder"] == "01_ddp"]
    assert [p.name for p in report.write_charts(only_ddp, tmp_path)] == ["speedup.png"]
    failed = [dict(r, status="skipped", reason="needs CUDA") for r in records]
    assert report.write_charts(failed, tmp_path / "none") == []
    out = tmp_path / "empty.md"
    (tmp_path / "empty.jsonl").write_text(json.dumps(failed[0]) + "\n")
    report.main(["--results", str(tmp_path / "empty.jsonl"), "--out", str(out)])
    assert "## Charts" not in out.read_text()


def _sweep(script, baseline, ops, world=1, transport=None):
    """A sweep record as a GPU at world size 1 writes it: busbw 0, algbw measured."""
    return {"folder": "06_symmem", "script": script, "baseline": baseline, "status": "ok",
            "size": "small", "model": "gpt", "world_size": world, "device": "NVIDIA H100",
            "link": None, "transport": transport,
            "sweep": [common.sweep_entry(op, b, 0.01 * b / 4096, world)
                      for op in ops for b in (4096, 2**20)]}


def test_a_world_of_one_sweep_keeps_the_baselines_rows_and_draws_its_algbw(tmp_path):
    # on CUDA symmetric memory sweeps all-reduce only: the baseline's other ops stay in the table
    records = [_sweep("baseline_symmem_allreduce", None, ["all_reduce", "all_gather"]),
               _sweep("optimized_symmem_allreduce", "baseline_symmem_allreduce", ["all_reduce"],
                      transport="cuda symmetric memory")]
    table = report.render_report(records)
    gathered = [line for line in table.splitlines() if line.startswith("| all_gather")]
    assert len(gathered) == 2 and all("baseline_symmem_allreduce" in line for line in gathered)
    assert [p.name for p in report.write_charts(records, tmp_path)] == ["symmem_busbw.png"]


def test_runs_on_different_setups_are_labelled_each_with_its_own(records):
    on_gpu = [dict(r, device="NVIDIA H100", world_size=1) for r in records[:2]]
    title, suffixes = report._setups(records[:2] + on_gpu)
    assert title == "runs on several setups"
    assert suffixes[0] == " [cpu, world 2, size small]"
    assert suffixes[-1] == " [NVIDIA H100, world 1, size small]"
    assert report._setups(records[:2]) == ("cpu, world 2, size small", ["", ""])
