"""report/traces.py: hand-made traces with a known answer, on CPU (gloo's threads)
and GPU (kernels; one checked against HolisticTraceAnalysis's own figures), the names of
collectives, and the table over a folder of per-rank traces."""

import json

import pytest

from report import traces


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
    (step,) = traces.step_breakdown(CPU_TRACE)
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
    # compute [0,50]; data movement [40,80] and the copy [85,90] (HTA's non-compute); no
    # correlation ids, so the step is its CPU range
    (step,) = traces.step_breakdown(trace)
    assert (step["compute"], step["hidden"], step["exposed"], step["idle"]) == \
        pytest.approx((0.040, 0.010, 0.035, 0.015))


def gpu_trace(steps: int = 3) -> dict:
    """A DDP-shaped kineto trace of one GPU, as torch.profiler writes it: per step the CPU
    launches an input copy, a forward (launch-bound: gaps between kernels), a backward that
    copies gradients into buckets and whose three all-reduces run on NCCL's stream (two under
    backward, the last after it) and an optimizer that waits for them. Kernels start behind
    their launches, so the GPU runs past the CPU's step range."""
    events, correlation, free = [], [0], {7: 0.0, 20: 0.0}

    def launch(ts, name, cat, dur, stream):
        correlation[0] += 1
        events.append(op("cudaLaunchKernel", ts, 8, cat="cuda_runtime",
                         correlation=correlation[0]))
        start = max(ts + 12, free[stream] + 2)
        if name.startswith("optimizer"):
            start = max(start, free[20] + 2)  # the optimizer waits for the last all-reduce
        free[stream] = start + dur
        events.append(op(name, start, dur, tid=stream, cat=cat, correlation=correlation[0],
                         stream=stream, device=0))

    for s in range(steps):
        t = 1000 + 12000 * s
        events.append(op(f"ProfilerStep#{s + 3}", t, 11990, cat="user_annotation"))
        launch(t + 20, "Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 180, 7)
        for k in range(20):
            launch(t + 60 + 200 * k, "ampere_sgemm_128x64_tn", "kernel", 100 + 23 * (k % 4), 7)
        for k in range(30):
            launch(t + 4300 + 150 * k, "void at::native::vectorized_elementwise_kernel",
                   "kernel", 90 + 19 * (k % 5), 7)
            if k % 3 == 2:  # DDP copies the gradients into their bucket
                launch(t + 4305 + 150 * k, "Memcpy DtoD (Device -> Device)", "gpu_memcpy", 120, 7)
            if k in (9, 19, 29):
                launch(t + 4310 + 150 * k, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel",
                       1700, 20)
        for k in range(10):
            launch(t + 10000 + 90 * k, "optimizer_multi_tensor_apply_kernel", "kernel", 70, 7)
    return {"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 2}}


# HolisticTraceAnalysis 0.5.0's get_temporal_breakdown() of gpu_trace() written to a file (it
# leaves out the last ProfilerStep): idle, compute and non-compute as % of the kernels' span.
# No GPU was lent to record a real trace; HTA is not a requirement, so CI does not run it.
HTA_ON_GPU_TRACE = {"idle": 15.47, "compute": 61.63, "non_compute": 22.9}


def test_a_gpu_trace_agrees_with_hta_within_5_points():
    steps = traces.step_breakdown(gpu_trace())
    total = {k: sum(s[k] for s in steps[:-1]) for k in ("wall", "compute", "hidden",
                                                         "exposed", "idle")}
    ours = {"idle": total["idle"], "compute": total["compute"] + total["hidden"],
            "non_compute": total["exposed"]}
    for key, hta in HTA_ON_GPU_TRACE.items():
        assert 100 * ours[key] / total["wall"] == pytest.approx(hta, abs=5), key
    # a step is its span on the GPU: from its first kernel to the next step's first, later
    # than the CPU's range, and the parts still add up to it
    assert steps[0]["wall"] == pytest.approx(12.0)
    for s in steps:
        assert s["compute"] + s["hidden"] + s["exposed"] + s["idle"] == pytest.approx(s["wall"])
    assert traces.gpu_step_windows(*traces._events_and_steps(gpu_trace()))[0][0] == 1032


def test_the_four_parts_add_up_to_each_step_of_a_two_step_trace():
    second = [dict(e, ts=e["ts"] + 200) for e in CPU_TRACE["traceEvents"][:6]]
    second[0]["name"] = "ProfilerStep#4"
    steps = traces.step_breakdown({"traceEvents": CPU_TRACE["traceEvents"] + second})
    assert [s["step"] for s in steps] == ["ProfilerStep#3", "ProfilerStep#4"]
    for s in steps:
        assert s["compute"] + s["hidden"] + s["exposed"] + s["idle"] == pytest.approx(s["wall"])
        assert min(s["compute"], s["hidden"], s["exposed"], s["idle"]) >= 0


def test_a_trace_without_steps_is_refused():
    with pytest.raises(ValueError, match="ProfilerStep"):
        traces.step_breakdown({"traceEvents": [op("aten::mm", 0, 5)]})


@pytest.mark.parametrize("name, kind", [
    ("c10d::allreduce_", "all_reduce"), ("gloo:all_reduce", "all_reduce"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::_allgather_base_", "all_gather"),
    ("c10d::broadcast_", "broadcast"), ("c10d::recv_", "recv"), ("gloo:send", "send"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
    ("ncclDevKernel_SendRecv", "send_recv"), ("ncclDevKernel_Generic_4", "nccl"),
    ("nccl:all_reduce", "all_reduce"), ("c10d::alltoall_base_", "all_to_all"),
    ("aten::mm", None), ("ProfilerStep#1", None)])
def test_collectives_are_named_by_kind_whoever_runs_them(name, kind):
    assert traces.collective_kind(name) == kind


def test_the_communication_pattern_counts_calls_bytes_and_transfer_time():
    # a collective's range on the training thread is its call, not a transfer on gloo's thread
    trace = {"traceEvents": CPU_TRACE["traceEvents"] +
             [op("gloo:all_reduce", 30, 10, cat="user_annotation")]}
    pattern = traces.comm_pattern(trace)
    # the transfer after the step is not this step's
    assert pattern == {"all_reduce": {"count": 1, "bytes": 4 * 8 * 4, "ms": pytest.approx(0.025)}}


def test_a_message_is_the_calls_input_whichever_argument_and_thread_it_is():
    # (output, input): an all-gather of 4 floats into 8, a reduce-scatter of 8 into 4, issued
    # from autograd's thread as on CUDA; the GPU's copy of the step range is not a second step
    trace = {"traceEvents": [
        op("ProfilerStep#0", 0, 100, cat="user_annotation"),
        op("ProfilerStep#0", 5, 100, tid=7, cat="gpu_user_annotation"),
        op("c10d::_allgather_base_", 10, 5, tid=3, **{"Input Dims": [[8], [4], [], []],
                                                     "Input type": ["float", "float", "", ""]}),
        op("c10d::_reduce_scatter_base_", 20, 5, **{"Input Dims": [[4], [8], []],
                                                   "Input type": ["c10::BFloat16"] * 2 + [""]})]}
    assert len(traces.step_breakdown(trace)) == 1
    pattern = traces.comm_pattern(trace)
    assert (pattern["all_gather"]["count"], pattern["all_gather"]["bytes"]) == (1, 4 * 4)
    assert pattern["reduce_scatter"]["bytes"] == 8 * 2


def test_a_kernel_running_after_its_steps_cpu_range_is_that_steps_transfer():
    # launched at 90 inside the step, it runs 120-150 on the GPU, after the CPU's range ends
    trace = {"traceEvents": [
        op("ProfilerStep#0", 0, 100, cat="user_annotation"),
        op("c10d::allreduce_", 85, 10, **{"Input Dims": [[[8]]], "Input type": ["TensorList"]}),
        op("cudaLaunchKernel", 90, 2, cat="cuda_runtime", correlation=1),
        op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 120, 30, tid=8, cat="kernel",
           correlation=1, stream=8)]}
    assert traces.comm_pattern(trace)["all_reduce"] == {"count": 1, "bytes": 32,
                                                       "ms": pytest.approx(0.030)}


def test_the_traces_table_has_a_row_per_script_and_rank(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"01_ddp_optimized_ddp_rank{rank}.json").write_text(json.dumps(CPU_TRACE))
    (tmp_path / "05_pipeline_optimized_pipeline_1f1b_timeline.json").write_text("{}")  # not a rank
    (tmp_path / "04_zero_optimized_zero1_rank0.json").write_text('{"traceEvents": [')  # cut short
    text = traces.render_traces(tmp_path)
    assert "Not read: 04_zero_optimized_zero1_rank0.json (Expecting value" in text
    rows = [line for line in text.splitlines() if line.startswith("| 01_ddp_optimized_ddp")]
    assert len(rows) == 4  # breakdown and collectives, two ranks each
    for row in rows[:2]:
        assert [c.strip() for c in row.split("|")[3:-1]] == \
            ["0.1", "0.04 (40%)", "0.02 (20%)", "0.01 (10%)", "0.03 (30%)"]
    assert traces.render_traces(tmp_path / "none") == ""


def _traced(folder, names, ranks=(0, 1)):
    for name in names:
        for rank in ranks:
            (folder / f"{name}_rank{rank}.json").write_text(json.dumps(CPU_TRACE))


def _scripts_and_ranks(text):
    """(script, rank) of each row of the breakdown, the first table."""
    table = text.split("\n\n")[1]
    return [(cells[1].strip(), int(cells[2])) for cells in
            (line.split("|") for line in table.splitlines()[2:])]


def test_the_traces_table_keeps_each_pair_together_with_no_records(tmp_path):
    _traced(tmp_path, ["01_ddp_baseline_ddp", "01_ddp_baseline_ddp_flash", "01_ddp_optimized_ddp",
                       "01_ddp_optimized_ddp_flash", "04_zero_optimized_zero_pytorch--stage3",
                       "04_zero_optimized_zero1", "04_zero_baseline_zero"])
    _traced(tmp_path, ["01_ddp_baseline_ddp"], ranks=(10, 2))
    rows = _scripts_and_ranks(traces.render_traces(tmp_path))
    # by name: optimized_ddp_flash beside baseline_ddp_flash (the longest baseline it starts
    # with), not baseline_ddp; ranks by number, 10 after 2
    assert rows == [("01_ddp_baseline_ddp", r) for r in (0, 1, 2, 10)] + [
        (name, r) for name in ["01_ddp_optimized_ddp", "01_ddp_baseline_ddp_flash",
                               "01_ddp_optimized_ddp_flash", "04_zero_baseline_zero",
                               "04_zero_optimized_zero1", "04_zero_optimized_zero_pytorch--stage3"]
        for r in (0, 1)]


def test_the_traces_table_pairs_runs_as_their_records_say(tmp_path):
    _traced(tmp_path, ["01_ddp_baseline_ddp", "01_ddp_baseline_ddp_flash", "01_ddp_optimized_ddp",
                       "01_ddp_optimized_ddp_flash", "04_zero_optimized_zero_pytorch--stage3"])
    records = [  # the flash run compared with plain DDP; a run whose baseline left no trace
        {"folder": "01_ddp", "script": "optimized_ddp_flash", "baseline": "baseline_ddp",
         "variant": None},
        {"folder": "04_zero", "script": "optimized_zero_pytorch", "baseline": "baseline_zero",
         "variant": "--stage 3"}]
    rows = [name for name, rank in _scripts_and_ranks(traces.render_traces(tmp_path, records))
            if rank == 0]
    assert rows == ["01_ddp_baseline_ddp", "01_ddp_optimized_ddp", "01_ddp_optimized_ddp_flash",
                    "01_ddp_baseline_ddp_flash", "04_zero_optimized_zero_pytorch--stage3"]
