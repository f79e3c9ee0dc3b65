"""report/charts.py: what each chart draws (its bars, their lengths, colours and labels, the
words beside them), from the records of a real `make all SIZE=small` run (2 CPU processes;
tests/fixtures/records_small.jsonl) and from made-up pairs; and what happens when a folder has
none."""

import json

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

import common
from helpers import load_recipe
from report import charts, cli, results_table

FIXTURE = common.ROOT / "tests" / "fixtures" / "records_small.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SWEEP = load_recipe(common.ROOT / "06_symmem" / "baseline_symmem_allreduce.py")  # sweep_entry


@pytest.fixture(scope="module")
def records():
    return common.load_results(FIXTURE)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bars(ax) -> dict[int, tuple[float, str]]:
    """Each horizontal bar's row, length and colour."""
    return {round(p.get_y() + p.get_height() / 2): (p.get_width(), to_hex(p.get_facecolor()))
            for p in ax.patches}


def words(ax) -> dict[int, str]:
    """The text drawn on each row."""
    return {round(t.get_position()[1]): t.get_text() for t in ax.texts}


def rows_of(ax) -> list[str]:
    return [label.get_text() for label in ax.get_yticklabels()]


# --- the real run ----------------------------------------------------------------------------
def test_the_speedup_chart_draws_each_compared_pair_of_a_real_run(records):
    """A row for every optimized run, bars for the pairs the table compares (the others, such as
    full fine-tuning from a checkpoint beside DDP from scratch, say why not)."""
    speed, memory = charts.draw_charts(records)["speedup.png"].axes
    pairs = results_table.compared_pairs(records)
    assert rows_of(speed) == [f"{r['folder']}  {results_table.row_label(r)}"
                              for r, _ in results_table.optimized_runs(records)]
    # compared with optimized_fsdp, not with the baseline_fsdp rows it follows: its label says so
    assert "03_fsdp  optimized_fsdp_fp8 vs optimized_fsdp" in rows_of(speed)
    assert [w for w, _ in bars(speed).values()] == pytest.approx(
        [b["step_ms"] / r["step_ms"] for r, b in pairs])
    assert [w for w, _ in bars(memory).values()] == pytest.approx(
        [r["peak_mem_mb"] / b["peak_mem_mb"] for r, b in pairs])
    row = {label: y for y, label in enumerate(rows_of(speed))}
    # 374.4 ms / 241.9 ms: a win; int8 compression is slower on 2 cores: a loss
    assert bars(speed)[row["01_ddp  optimized_ddp"]][1] == charts.GREEN
    assert words(speed)[row["01_ddp  optimized_ddp"]] == " 1.55x"
    int8 = row["02_compression  optimized_compression_int8"]
    assert bars(speed)[int8][1] == charts.RED and words(speed)[int8] == " 0.79x"
    # PowerSGD's losses strayed 1.46 from the baseline's, past its 0.2: neither bar is a result
    powersgd = row["02_compression  optimized_compression_powersgd"]
    assert bars(speed)[powersgd][1] == bars(memory)[powersgd][1] == charts.GREY
    assert words(speed)[powersgd] == " 0.92x over tolerance"
    assert words(memory)[powersgd] == " 1.15x over tolerance"


def test_each_ratio_sits_at_its_bars_end_and_no_line_runs_through_one(records):
    """A label starts at its bar's end, also a 0.42x far left of the 1.0 line; one that starts
    left of the line is on a white box drawn above the line, so the line stops short of it."""
    for ax in charts.draw_charts(records)["speedup.png"].axes:
        ratios = {round(t.get_position()[1]): t for t in ax.texts
                  if t.get_text().strip()[:1].isdigit() or t.get_text().strip().startswith("~")}
        assert ratios and set(ratios) == set(bars(ax))
        for y, (width, _) in bars(ax).items():
            assert ratios[y].get_position()[0] == pytest.approx(width)
        (one,) = ax.lines
        short = [ratios[y] for y, (width, _) in bars(ax).items() if width < 1.0]
        assert any(bars(ax)[y][0] < 0.5 for y in bars(ax))  # one far from the line
        assert short and all(
            t.get_bbox_patch() is not None and to_hex(t.get_bbox_patch().get_facecolor())
            == "#ffffff" and t.get_bbox_patch().get_alpha() in (None, 1.0)
            and t.get_zorder() > one.get_zorder() for t in short)


def test_the_other_charts_draw_what_the_real_run_recorded(records):
    drawn = charts.draw_charts(records)
    assert list(drawn) == list(charts.CHARTS)
    runs = results_table.latest_runs(records)

    (wire,) = drawn["compression_bytes.png"].axes
    compression = [r for r in runs if r["folder"] == "02_compression"]
    assert rows_of(wire) == [r["script"] for r in compression]
    assert [w for w, _ in bars(wire).values()] == [r["comm_mb"] for r in compression]

    timelines = [r for r in runs if r["folder"] == "05_pipeline" and r.get("timeline")]
    lanes = drawn["pipeline_timelines.png"].axes
    assert [ax.get_title() for ax in lanes] == [
        f"{results_table.script_label(r)} ({r['schedule']}, {r['microbatches']} micro-batch"
        f"{'es' * (r['microbatches'] != 1)} over {r['stages']} stages; cpu, world 2, size small):"
        f" measured bubble {r['bubble']:.3f}" for r in timelines]
    # one box per forward, backward or weight-gradient action of every rank
    assert [len(ax.collections) for ax in lanes] == [
        sum(len(lane) for lane in r["timeline"]) for r in timelines]

    sweeps = [r for r in runs if "sweep" in r]
    for ax in drawn["symmem_busbw.png"].axes:
        assert [list(line.get_ydata()) for line in ax.get_lines()] == [
            [row["busbw_gbps"] for row in r["sweep"] if row["op"] == ax.get_title()]
            for r in sweeps]


def test_the_pipeline_panels_name_their_setup_and_share_one_time_axis(records):
    lanes = charts.draw_charts(records)["pipeline_timelines.png"].axes
    assert lanes[0].get_title() == ("baseline_pipeline (naive, 1 micro-batch over 2 stages; "
                                    "cpu, world 2, size small): measured bubble 0.501")
    assert "dualpipev, 8 micro-batches over 4 stages; cpu, world 2" in lanes[3].get_title()
    # one time axis, wide enough for the longest step: lengths compare by eye across panels
    longest = max(1e3 * (max(a[4] for lane in r["timeline"] for a in lane)
                         - min(a[3] for lane in r["timeline"] for a in lane))
                  for r in records if r["folder"] == "05_pipeline" and r.get("timeline"))
    assert {ax.get_xlim() for ax in lanes} == {lanes[0].get_xlim()}
    assert lanes[0].get_xlim()[0] <= 0 and lanes[0].get_xlim()[1] >= longest
    assert all(lanes[0].get_shared_x_axes().joined(lanes[0], ax) for ax in lanes)
    # every panel keeps its own time labels: sharex alone would leave them on the last
    assert all(ax.xaxis.get_tick_params()["labelbottom"] and ax.get_xticklabels() for ax in lanes)


def _drawn_boxes(fig, texts) -> list:
    """The boxes of the texts that are shown, in pixels."""
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in texts if t.get_visible() and t.get_text()]


def _shown_ticks(ax):
    """The x tick labels inside the view limits (matplotlib keeps others, not drawn)."""
    low, high = sorted(ax.get_xlim())
    return [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]


@pytest.mark.parametrize("rows, setups", [(1, 1), (19, 1), (38, 2)])
def test_nothing_on_the_speedup_chart_overlaps_at_any_number_of_rows(records, rows, setups):
    # 1 row: the smallest figure; 19: the real run's chart; 38: its pairs on two setups, 17
    # inches tall, where the title fell into the left panel's (tight_layout holds it 2% of the
    # height below the top)
    on_gpu = [dict(r, device="NVIDIA H100 80GB HBM3", world_size=1) for r in records]
    pairs = results_table.compared_pairs(records + on_gpu[:len(records) * (setups - 1)])[:rows]
    drawn = [run for pair in pairs for run in pair]
    fig = charts.draw_charts(drawn)["speedup.png"]
    speed, memory = fig.axes
    # a row for each optimized run drawn: full fine-tuning, LoRA's baseline, has its own row
    assert len(rows_of(speed)) == len(results_table.optimized_runs(drawn)) >= rows
    fig.draw_without_rendering()
    (title,) = _drawn_boxes(fig, fig.texts)  # the suptitle
    panel_titles = _drawn_boxes(fig, [speed.title, memory.title])
    assert len(panel_titles) == 2
    assert not any(title.overlaps(box) for box in panel_titles)
    assert title.y0 >= max(box.y1 for box in panel_titles)
    # the left panel's last tick label clear of the right panel's first
    for left in _drawn_boxes(fig, _shown_ticks(speed)):
        assert not any(left.overlaps(right) for right in _drawn_boxes(fig, _shown_ticks(memory)))


def test_write_charts_saves_each_drawn_chart_as_a_png(records, tmp_path):
    written = charts.write_charts(records, tmp_path)
    assert [p.name for p in written] == list(charts.CHARTS)
    assert all(path.read_bytes().startswith(PNG_MAGIC) for path in written)
    assert not plt.get_fignums()  # saved and closed


def test_the_speedup_chart_pairs_exactly_what_the_table_compares(records):
    pairs = results_table.compared_pairs(records)
    table = results_table.render_report(records)
    compared = [line for line in table.splitlines() if line.startswith("| optimized")
                and line.split("|")[1 + results_table.REPORT_HEADERS.index("speedup")]
                .strip().endswith("x")]
    assert len(pairs) == len(compared) == 31
    assert all(rec["baseline"] == base["script"] for rec, base in pairs)


def test_the_report_links_the_charts_it_wrote(tmp_path):
    out = tmp_path / "report.md"
    assert cli.main(["--results", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    for name in charts.CHARTS:
        assert f"](charts/{name})" in text and (tmp_path / "charts" / name).exists()


def test_records_without_a_folders_data_draw_no_chart_for_it(records, tmp_path):
    only_ddp = [r for r in records if r["folder"] == "01_ddp"]
    assert list(charts.draw_charts(only_ddp)) == ["speedup.png"]
    failed = [dict(r, status="skipped", reason="needs CUDA") for r in records]
    assert charts.draw_charts(failed) == {}
    out = tmp_path / "empty.md"
    (tmp_path / "empty.jsonl").write_text(json.dumps(failed[0]) + "\n")
    cli.main(["--results", str(tmp_path / "empty.jsonl"), "--out", str(out)])
    assert "## Charts" not in out.read_text()


# --- made-up pairs ---------------------------------------------------------------------------
def _run(script, baseline=None, status="ok", **fields):
    """A record as `common.record` writes it (ok) or as a run that died writes it (no flags)."""
    rec = {"folder": "01_ddp", "script": script, "baseline": baseline, "status": status,
           "reason": None, "size": "small", "model": "gpt", "world_size": 2, "nnodes": 1,
           "device": "cpu", "link": None}
    if status == "ok":
        rec.update(step_ms=100.0, step_ms_p90=110.0, peak_mem_mb=800.0, losses=[5.0, 4.0],
                   dtype="fp32", batch_size=4, seq_len=128, steps=20, warmup=5, seed=0,
                   lr=1e-3)
    return {**rec, **fields}


def test_a_pair_the_table_does_not_compare_says_why_where_its_bars_would_be():
    records = [_run("baseline_ddp"), _run("optimized_ddp", "baseline_ddp", step_ms=50.0),
               _run("baseline_ddp_flash", status="failed", reason="RuntimeError: boom"),
               _run("optimized_ddp_flash", "baseline_ddp_flash"),
               _run("optimized_ddp_bf16", "baseline_ddp", batch_size=8),
               _run("optimized_ddp_lone", "baseline_ddp_lone")]
    speed, memory = charts.draw_charts(records)["speedup.png"].axes
    assert rows_of(speed) == ["01_ddp  optimized_ddp", "01_ddp  optimized_ddp_bf16",
                              "01_ddp  optimized_ddp_flash", "01_ddp  optimized_ddp_lone"]
    assert list(bars(speed)) == list(bars(memory)) == [0]  # one pair, drawn
    assert words(speed) == {0: " 2.00x",
                            1: " not compared: baseline ran with other batch_size",
                            2: " not compared: baseline failed",
                            3: " not compared: no baseline_ddp_lone run on this setup"}


def test_a_run_over_its_tolerance_is_not_drawn_as_a_win():
    base = _run("baseline_ddp")
    faster = _run("optimized_ddp", "baseline_ddp", step_ms=50.0, peak_mem_mb=400.0,
                  losses=[5.0, 4.5], loss_tolerance=0.1)
    speed, memory = charts.draw_charts([base, faster])["speedup.png"].axes
    assert bars(speed) == {0: (2.0, charts.GREY)} and bars(memory) == {0: (0.5, charts.GREY)}
    assert words(speed) == {0: " 2.00x over tolerance"}
    within = dict(faster, loss_tolerance=0.6)
    speed, memory = charts.draw_charts([base, within])["speedup.png"].axes
    assert bars(speed) == {0: (2.0, charts.GREEN)} and bars(memory) == {0: (0.5, charts.GREEN)}
    assert words(speed) == {0: " 2.00x"}


def test_a_speedup_within_the_runs_spread_is_grey_and_marked_and_a_busy_host_named():
    base = _run("baseline_ddp", step_ms_iqr=[95.0, 130.0])
    overlapping = _run("optimized_ddp", "baseline_ddp", step_ms=80.0, step_ms_iqr=[75.0, 96.0])
    (speed, _) = charts.draw_charts([base, overlapping])["speedup.png"].axes
    assert bars(speed) == {0: (1.25, charts.GREY)} and words(speed) == {0: " ~1.25x"}
    apart = dict(overlapping, step_ms_iqr=[75.0, 90.0])
    (speed, _) = charts.draw_charts([base, apart])["speedup.png"].axes
    assert bars(speed) == {0: (1.25, charts.GREEN)} and words(speed) == {0: " 1.25x"}
    assert not speed.patches[0].get_hatch() and "hatched" not in speed.figure.get_suptitle()
    # 2 ranks on 2 cores, the load near 3 after the baseline's timed steps: one task too many
    busy_base = dict(base, load_avg=[2.1, 3.1], cpus=2)
    (speed, memory) = charts.draw_charts([busy_base, apart])["speedup.png"].axes
    assert words(speed) == {0: " 1.25x (busy host)"}
    # drawn unlike a clean bar, and the title says how; a busy host does not change memory
    assert bars(speed) == {0: (1.25, charts.GREEN)} and speed.patches[0].get_hatch()
    assert not memory.patches[0].get_hatch()
    assert "hatched: timed on a busy host" in speed.figure.get_suptitle()


def test_a_world_of_one_sweep_keeps_the_baselines_rows_and_draws_its_algbw():
    # on CUDA symmetric memory sweeps all-reduce only: the baseline's other ops stay in the table
    records = [_sweep("baseline_symmem_allreduce", None, ["all_reduce", "all_gather"]),
               _sweep("optimized_symmem_allreduce", "baseline_symmem_allreduce", ["all_reduce"],
                      transport="cuda symmetric memory")]
    table = results_table.render_report(records, wide=True)  # every row names its scripts
    gathered = [line for line in table.splitlines() if line.startswith("| all_gather")]
    assert len(gathered) == 2 and all("baseline_symmem_allreduce" in line for line in gathered)
    drawn = charts.draw_charts(records)
    assert list(drawn) == ["symmem_busbw.png"]
    gather, reduce = drawn["symmem_busbw.png"].axes
    assert gather.get_ylabel() == "algbw GB/s"  # a world of one's busbw is 0
    assert [line.get_label() for line in reduce.get_lines()] == [
        "baseline_symmem_allreduce (process group)",
        "optimized_symmem_allreduce (cuda symmetric memory)"]
    assert list(reduce.get_lines()[1].get_ydata()) == [
        row["algbw_gbps"] for row in records[1]["sweep"]]


def _sweep(script, baseline, ops, world=1, transport=None):
    """A sweep record as a GPU at world size 1 writes it: busbw 0, algbw measured."""
    return {"folder": "06_symmem", "script": script, "baseline": baseline, "status": "ok",
            "size": "small", "model": "gpt", "world_size": world, "device": "NVIDIA H100",
            "link": None, "transport": transport,
            "sweep": [SWEEP.sweep_entry(op, b, 0.01 * b / 4096, world)
                      for op in ops for b in (4096, 2**20)]}


def test_runs_on_different_setups_are_labelled_each_with_its_own(records):
    on_gpu = [dict(r, device="NVIDIA H100", world_size=1) for r in records[:2]]
    title, suffixes = charts._setups(records[:2] + on_gpu)
    assert title == "runs on several setups"
    assert suffixes[0] == " [cpu, world 2, size small]"
    assert suffixes[-1] == " [NVIDIA H100, world 1, size small]"
    assert charts._setups(records[:2]) == ("cpu, world 2, size small", ["", ""])
