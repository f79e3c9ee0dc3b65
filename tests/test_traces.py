"""report.py's trace breakdown: hand-made traces with a known answer, on CPU (gloo's threads)
and GPU (kernels), the names of collectives, and the table over a folder of per-rank traces."""

import json

import pytest

import report


def op(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
            "args": args}


# One 100 us step on the training thread (tid 1): a matmul, a collective call (with an op of
# its own inside), an add; gloo's thread (tid 2) transfers from 35 to 60 us.
CPU_TRACE = {"traceEvents": [
    op("ProfilerStep#3", 0, 100, cat="user_annotation"),
    op("aten::mm", 0, 30),
    op("c10d::allreduce_", 30, 10, **{"Input Dims": [[[4, 8]], []],
                                      "Input type": ["TensorList", "Scalar"]}),
    op("aten::empty", 31, 1),
    op("aten::add_", 50, 20),
    op("gloo:all_reduce", 35, 25, tid=2, cat="user_annotation"),
    op("gloo:all_reduce", 150, 25, tid=2, cat="user_annotation"),  # after the step: not counted
]}


def test_a_cpu_step_splits_into_the_known_four_parts():
    # compute [0,30] and [50,70]; communication [30,60] (the call, then gloo's transfer):
    # hidden [50,60] = 10, compute alone 40, exposed 20, idle the rest [70,100] = 30
    (step,) = report.step_breakdown(CPU_TRACE)
    assert step["step"] == "ProfilerStep#3" and step["wall"] == pytest.approx(0.1)
    assert (step["compute"], step["hidden"], step["exposed"], step["idle"]) == \
        pytest.approx((0.040, 0.010, 0.020, 0.030))


def test_a_gpu_step_reads_the_kernels_not_the_threads():
    trace = {"traceEvents": [
        op("ProfilerStep#0", 0, 100, cat="user_annotation"),
        op("aten::mm", 0, 90),  # the CPU side is busy throughout: it must not count on GPU
        op("sm90_xmma_gemm", 0, 50, tid=7, cat="kernel"),
        op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 40, tid=8, cat="kernel"),
        op("Memcpy DtoD", 85, 5, tid=7, cat="gpu_memcpy")]}
    (step,) = report.step_breakdown(trace)
    assert (step["compute"], step["hidden"], step["exposed"], step["idle"]) == \
        pytest.approx((0.045, 0.010, 0.030, 0.015))


def test_the_four_parts_add_up_to_each_step_of_a_two_step_trace():
    second = [dict(e, ts=e["ts"] + 200) for e in CPU_TRACE["traceEvents"][:6]]
    second[0]["name"] = "ProfilerStep#4"
    steps = report.step_breakdown({"traceEvents": CPU_TRACE["traceEvents"] + second})
    assert [s["step"] for s in steps] == ["ProfilerStep#3", "ProfilerStep#4"]
    for s in steps:
        assert s["compute"] + s["hidden"] + s["exposed"] + s["idle"] == pytest.approx(s["wall"])
        assert min(s["compute"], s["hidden"], s["exposed"], s["idle"]) >= 0


def test_a_trace_without_steps_is_refused():
    with pytest.raises(ValueError, match="ProfilerStep"):
        report.step_breakdown({"traceEvents": [op("aten::mm", 0, 5)]})


@pytest.mark.parametrize("name, kind", [
    ("c10d::allreduce_", "all_reduce"), ("gloo:all_reduce", "all_reduce"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::_allgather_base_", "all_gather"),
    ("c10d::broadcast_", "broadcast"), ("c10d::recv_", "recv"), ("gloo:send", "send"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
    ("ncclDevKernel_SendRecv", "send_recv"), ("ncclDevKernel_Generic_4", "nccl"),
    ("aten::mm", None), ("ProfilerStep#1", None)])
def test_collectives_are_named_by_kind_whoever_runs_them(name, kind):
    assert report.collective_kind(name) == kind


def test_the_communication_pattern_counts_calls_bytes_and_transfer_time():
    # a collective's range on the training thread is its call, not a transfer on gloo's thread
    trace = {"traceEvents": CPU_TRACE["traceEvents"] +
             [op("gloo:all_reduce", 30, 10, cat="user_annotation")]}
    pattern = report.comm_pattern(trace)
    # the transfer after the step is not this step's
    assert pattern == {"all_reduce": {"count": 1, "bytes": 4 * 8 * 4, "ms": pytest.approx(0.025)}}


def test_the_traces_table_has_a_row_per_script_and_rank(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"01_ddp_optimized_ddp_rank{rank}.json").write_text(json.dumps(CPU_TRACE))
    (tmp_path / "05_pipeline_optimized_pipeline_1f1b_timeline.json").write_text("{}")  # not a rank
    text = report.render_traces(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| 01_ddp_optimized_ddp")]
    assert len(rows) == 4  # breakdown and collectives, two ranks each
    for row in rows[:2]:
        assert [c.strip() for c in row.split("|")[3:-1]] == \
            ["0.1", "0.04 (40%)", "0.02 (20%)", "0.01 (10%)", "0.03 (30%)"]
    assert report.render_traces(tmp_path / "none") == ""
