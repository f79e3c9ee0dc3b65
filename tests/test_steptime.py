"""The step-time model (report/costmodel.py), what a record gives it (common.step_work) and
`make calibrate`.

- train_flops' matmul FLOPs against torch's own FlopCounterMode, for the GPT, the Llama and
  the MoE Llama; calibrate's Linear shapes against the same count;
- predict_step's parts, worked by hand (attention's rate by length, a layer's fixed cost,
  recompute, bubble, overlap windows); Rates.link's fall-backs; rates_from_calibration;
- CollectiveBytes.by_op in a spawned gloo world of 2;
- step_work and record: the work a record carries; the report's pricing of it at the
  calibration its run took, or why it has none;
- report/calibrate.py end to end at `tiny` (worlds 1 and 2, in a fresh Python: the calibration
  forks its worlds), its merging with the other sizes, its rendering, and the CLI's
  `calibrate --if-missing`.
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode

import common
import helpers
from helpers import cpu_env
from report import calibrate, cli, costmodel

TINY = common.SIZES["tiny"]
DECODERS = ("gpt", "llama", "moe")


def tiny_args(*extra: str) -> argparse.Namespace:
    args = common.parser(None).parse_args(["--size", "tiny", *extra])
    args.dtype = args.dtype or "fp32"
    return args


def cpu_topology(world: int = 1) -> common.Topology:
    return common.Topology(0, 0, world, world, 1, "gloo", torch.device("cpu"))


def counted_flops(run) -> int:
    """The FLOPs torch's FlopCounterMode counts in `run()`."""
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def world_figures(matmul: float = 1e9) -> dict:
    """A world's entry of calibration.json, in round figures."""
    compute = {"matmul_flops": matmul, "attention_flops": matmul / 2, "other_s": 1e-6,
               "layer_s": 1e-4, "attention_by_length": [[32, matmul / 2], [128, matmul]],
               "step_s": 0.1}
    return {"compute": {name: dict(compute) for name in DECODERS}, "optimizer_s": 2e-9,
            "memory_bytes_per_s": 1e10, "overlap": 0.5, "wake_up_s": {"2": 1e-5},
            "collectives": {"allreduce/2": [1e-4, 1e-9], "allgather/2": [5e-5, 2e-9]}}


def size_entry(worlds=(1, 2), device: str = "cpu", dtype: str = "fp32", size: str = "tiny",
               host: str = "test-host", time: str = "2026-01-01T00:00:00Z",
               torch_version: str = "x") -> dict:
    """One size's entry of calibration.json."""
    return {"id": f"{host} {time} torch {torch_version}", "host": host, "time": time,
            "torch": torch_version, "device": device, "dtype": dtype, "size": size,
            "worlds": {str(w): world_figures() for w in worlds}}


def stats(comm_by_op: dict | None = None) -> common.Stats:
    return common.Stats(10.0, 12.0, (9.0, 11.0), 1.0, 0.5, (0.0, 0.0), [4.8, 4.7],
                        comm_by_op=comm_by_op)


def with_calibration(monkeypatch, tmp_path, calibration: dict | None) -> None:
    """The report reads `calibration` (None: no file) from costmodel.CALIBRATION, here a file
    in tmp_path."""
    path = tmp_path / "calibration.json"
    if calibration is not None:
        path.write_text(json.dumps(calibration))
    monkeypatch.setattr(costmodel, "CALIBRATION", path)


# --- FLOPs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DECODERS)
def test_train_flops_matmuls_are_what_torchs_flop_counter_counts_in_a_step(name):
    """One forward and backward at tiny: FlopCounterMode's count, less the attention's own
    (counted alone, the same way, at the model's shapes), is 6 x the weights a token meets x
    tokens, exactly. The MoE too: dropless, every token reaches exactly top_k experts."""
    torch.manual_seed(0)
    model = calibrate.build_model(name, TINY, torch.device("cpu"), None)
    tokens = torch.randint(TINY.vocab_size, (TINY.batch_size, TINY.seq_len + 1))
    step = counted_flops(lambda: model(tokens[:, :-1], tokens[:, 1:]).backward())

    head_dim = TINY.d_model // TINY.n_heads
    kv_heads = TINY.n_heads if name == "gpt" else TINY.n_kv_heads
    # laid out as the models hand them over: (batch, seq, heads, head_dim), transposed
    q, k, v = (torch.randn(TINY.batch_size, TINY.seq_len, heads, head_dim, requires_grad=True)
               for heads in (TINY.n_heads, kv_heads, kv_heads))
    one_attention = counted_flops(lambda: common.causal_sdpa(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).sum().backward())

    n = TINY.batch_size * TINY.seq_len
    matmul, attention = common.train_flops(TINY, name, n, TINY.seq_len)
    assert step - TINY.n_layers * one_attention == matmul
    assert matmul == 6 * common.matmul_weights_per_token(TINY, name) * n > 0
    # CPU's fused attention kernel has no FLOP formula (0); the math path's bmms count 12 x seq
    # x d_model a token and layer, train_flops' figure
    assert one_attention in (0, attention / TINY.n_layers)


def test_the_moes_matmul_weights_a_token_are_its_active_parameters_less_the_input_table():
    active = helpers.moe_param_counts(TINY)[1]
    norms = TINY.n_layers * 2 * TINY.d_model + TINY.d_model
    assert common.matmul_weights_per_token(TINY, "moe") == \
        active - TINY.vocab_size * TINY.d_model - norms


@pytest.mark.parametrize("name", DECODERS)
def test_calibrates_linear_shapes_are_train_flops_matmuls(name):
    """What calibrate times as the matmuls: every Linear and MoE router at the batch's tokens,
    each routed expert at its even share: train_flops' matmuls, none left in `other_s`."""
    n = TINY.batch_size * TINY.seq_len
    model = calibrate.build_model(name, TINY, torch.device("cpu"), None)
    shapes = calibrate.linear_shapes(model, TINY, n)
    timed = sum(count * 6 * rows * fan_in * fan_out
                for (rows, fan_in, fan_out), count in shapes.items())
    assert timed == common.train_flops(TINY, name, n, TINY.seq_len)[0]
    if name == "moe":
        routed = (n * TINY.top_k // TINY.n_experts, TINY.d_model, TINY.expert_ffn)
        # gate, up and down of each expert of each layer: 64 x 64 at tiny, a share of 64 rows
        assert shapes[routed] == 3 * TINY.n_layers * TINY.n_experts


# --- predict_step -----------------------------------------------------------------------------
RATES = costmodel.Rates(matmul_flops=1e9, attention_flops=5e8, other_s=1e-6, optimizer_s=2e-9,
                     links={"allreduce/2": (1e-4, 1e-9), "allgather/2": (5e-5, 2e-9)},
                     overlap=0.5, source="by hand", layer_s=1e-4)
# 2 ms of matmuls, 1 ms of attention, 1 ms of the rest: 4 ms of compute; 2 ms of AdamW.
# all-reduce: 3 x 0.1 ms + 4 MB x 1 ns = 4.3 ms; all-gather: 2 x 0.05 ms + 1 MB x 2 ns = 2.1 ms
WORK = costmodel.StepWork(matmul_flops=2e6, attention_flops=5e5, token_layers=1000,
                       stepped_params=1e6,
                       collectives={"allreduce/2": (4e6, 3), "allgather/2": (1e6, 2)},
                       overlapped={"allreduce": "backward"})


def test_predict_step_hides_an_overlapped_collective_under_its_window_only():
    step = costmodel.predict_step(WORK, RATES)
    # the all-reduce hides under backward (2/3 of 4 ms), at half the window: 4.3 - 0.5 x 8/3;
    # the all-gather is not overlapped: all its 2.1 ms show
    communication = 4.3 - 0.5 * 8 / 3 + 2.1
    assert step == pytest.approx({"step_ms": 4 + communication + 0 + 2, "compute_ms": 4.0,
                                  "communication_ms": communication, "bubble_ms": 0.0,
                                  "optimizer_ms": 2.0, "bound_by": "communication"})


def test_predict_step_with_layer_passes_recompute_a_bubble_and_attention_by_length():
    rates = costmodel.Rates(**{**RATES.__dict__,
                            "attention_by_length": ((32, 5e8), (128, 1e9))})
    work = costmodel.StepWork(**{**WORK.__dict__, "recompute": True, "bubble": 0.2, "seq_len": 64,
                              "layer_passes": 10,
                              "overlapped": {"allreduce": "backward", "allgather": "step"}})
    step = costmodel.predict_step(work, rates)
    attention = 5e5 / 7.5e8 * 1e3  # ms: at 64, halfway in log length from 5e8 to 1e9 FLOP/s
    compute = (2 + attention + 1 + 10 * 0.1) * 4 / 3  # 10 layer passes of 0.1 ms; a forward more
    # the all-reduce's window, 2/3 of the compute (4.15 ms), is shorter than it: that much, half
    # hidden; the all-gather (2.1 ms) fits in the step's window (all the compute): half hidden
    communication = (4.3 - 0.5 * 2 / 3 * compute) + (2.1 - 0.5 * 2.1)
    bubble = compute * 0.2 / 0.8  # idle a fifth of the step: a quarter of the compute more
    assert step == pytest.approx({"step_ms": compute + communication + bubble + 2,
                                  "compute_ms": compute, "communication_ms": communication,
                                  "bubble_ms": bubble, "optimizer_ms": 2.0,
                                  "bound_by": "compute"})


def test_float8_linears_run_at_the_float8_rate_measured_else_the_matmul_rate():
    work = costmodel.StepWork(**{**WORK.__dict__, "float8_share": 0.75, "collectives": {}})
    # 0.5 ms of matmuls at 1 GFLOP/s, 1.5 ms in float8 at 0.5 GFLOP/s (emulated: slower), plus
    # 1 ms of attention and 1 ms of the rest
    slower = costmodel.Rates(**{**RATES.__dict__, "float8_matmul_flops": 5e8})
    assert costmodel.predict_step(work, slower)["compute_ms"] == pytest.approx(0.5 + 3 + 2)
    assert costmodel.predict_step(work, RATES)["compute_ms"] == pytest.approx(4)  # none measured


def test_predict_step_with_no_overlap_shows_every_collective_whole():
    rates = costmodel.Rates(**{**RATES.__dict__, "overlap": 0.0})
    step = costmodel.predict_step(WORK, rates)
    assert step["communication_ms"] == pytest.approx(4.3 + 2.1)
    assert step["step_ms"] == pytest.approx(4 + 6.4 + 2)


def test_attention_runs_at_the_rate_measured_nearest_its_length_linear_in_log_length():
    rates = costmodel.Rates(**{**RATES.__dict__,
                            "attention_by_length": ((128, 3e9), (32, 1e9), (512, 4e9))})
    assert rates.attention_rate(8) == rates.attention_rate(32) == 1e9  # the shortest's
    assert rates.attention_rate(64) == pytest.approx(2e9)  # halfway from 32 to 128
    assert rates.attention_rate(256) == pytest.approx(3.5e9)
    assert rates.attention_rate(4096) == 4e9  # the longest's
    assert RATES.attention_rate(64) == RATES.attention_flops  # none measured by length


def test_a_link_is_the_measured_one_else_the_nearest_group_else_the_nearest_all_reduce():
    links = {"allreduce/2": (1.0, 1.5), "allreduce/8": (2.0, 2.5), "allgather/4": (3.0, 3.5),
             "send/2": (4.0, 4.5)}
    rates = costmodel.Rates(1.0, 1.0, 0.0, 0.0, links, 0.0, "by hand")
    assert rates.link("allgather/4") == (3.0, 3.5)  # measured
    assert rates.link("allgather/2") == (3.0, 3.5)  # the only all-gather measured
    assert rates.link("allreduce/3") == (1.0, 1.5)  # nearer 2 than 8
    assert rates.link("allreduce/7") == (2.0, 2.5)
    assert rates.link("send/4") == (4.0, 4.5)
    assert rates.link("alltoall/3") == (1.0, 1.5)  # never measured: the nearest all-reduce
    assert rates.link("reduce_scatter/16") == (2.0, 2.5)
    assert rates.link("allreduce/1") == (0.0, 0.0)  # a group of one sends nothing
    assert costmodel.Rates(1.0, 1.0, 0.0, 0.0, {}, 0.0, "a world of one").link("allgather/1") == \
        (0.0, 0.0)


def test_a_gpus_links_named_by_mesh_dim_are_read_as_they_are_named():
    gpu = costmodel.Rates(1e15, 1e15, 0.0, 0.0, {"dp/network": (1e-5, 1e-11),
                                               "dp/nvlink": (1e-6, 1e-12)}, 1.0, "datasheet")
    assert gpu.link("dp/network") == (1e-5, 1e-11)
    assert gpu.link("dp/nvlink") == (1e-6, 1e-12)
    with pytest.raises(KeyError, match="datasheet has no link for 'tp/nvlink'"):
        gpu.link("tp/nvlink")


def test_rates_from_calibration_are_the_worlds_and_models_figures_or_none():
    entry = size_entry(worlds=(2,))
    entry["worlds"]["2"]["compute"]["llama"]["matmul_flops"] = 7e9
    rates = costmodel.rates_from_calibration(entry, 2, "llama")
    assert rates == costmodel.Rates(7e9, 5e8, 1e-6, 2e-9, {"allreduce/2": (1e-4, 1e-9),
                                                        "allgather/2": (5e-5, 2e-9)},
                                 0.5, entry["id"], 1e-4, ((32, 5e8), (128, 1e9)))
    assert costmodel.rates_from_calibration(entry, 2, "gpt").matmul_flops == 1e9
    assert costmodel.rates_from_calibration(entry, 4, "llama") is None  # a world not measured
    assert costmodel.rates_from_calibration(entry, 2, "resnet") is None  # a model not measured
    assert costmodel.rates_from_calibration({}, 2, "gpt") is None
    del entry["worlds"]["2"]["compute"]["gpt"]["layer_s"]  # an older `make calibrate`'s
    assert costmodel.rates_from_calibration(entry, 2, "gpt") is None


# --- bytes sent by op -------------------------------------------------------------------------
def test_collective_bytes_counts_bytes_and_calls_by_op_and_group_size(monkeypatch):
    """Counted from the tensors handed over, so no byte need move: rank 0 of a fake group of 2
    in this process (gloo's reduce-scatter, an all-to-all, taken by its gloo path)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = torch.ones(1000)  # 4000 bytes
        gathered = torch.empty(2 * x.numel())
        with common.CollectiveBytes() as sent:
            for _ in range(3):
                dist.all_reduce(x)
            common.all_gather_single(gathered, x)
            with monkeypatch.context() as on_gloo:  # an all-to-all, priced as a reduce-scatter
                on_gloo.setattr(dist, "get_backend", lambda group=None: "gloo")
                common.reduce_scatter(x[:500], x)
            dist.all_to_all_single(torch.empty_like(x), x)
    finally:
        dist.destroy_process_group()
    # a ring all-reduce sends 2(n-1)/n of the tensor, an all-gather (n-1) x this rank's share,
    # a reduce-scatter and an all-to-all (n-1)/n of what they are handed
    assert sent.by_op == {"allreduce/2": [3 * 2 * (1 / 2) * 4000, 3],
                          "allgather/2": [1 * 4000, 1], "reduce_scatter/2": [2000, 1],
                          "alltoall/2": [2000, 1]}, sent.by_op
    assert sent.bytes == sum(sent_bytes for sent_bytes, _ in sent.by_op.values())


# --- a run's work, priced by the report -------------------------------------------------------
def measured(model: str = "gpt", world: int = 2, dtype: str = "fp32", size: str = "tiny",
             **changed) -> dict:
    """A measured run's record as the report reads it: its host, torch and time, its work."""
    work = costmodel.StepWork(1e9, 1e8, 1e4, 1e6, {"allreduce/2": (2**20, 2)},
                              common.DDP_OVERLAP, seq_len=32, layer_passes=2)
    return {"status": "ok", "step_ms": 10.0, "size": size, "model": model, "world_size": world,
            "dtype": dtype, "device": "cpu", "host": "test-host", "torch": "x",
            "time": "2026-01-01T01:00:00+00:00",
            "work": {**work.__dict__, "collectives": {"allreduce/2": [2**20, 2]}}, **changed}


@pytest.mark.parametrize("calibration, rec, why", [
    ({}, measured(), "no calibration of 2 processes at tiny in fp32 on this host: run make "
     "calibrate SIZE=tiny"),
    ({"sizes": {"small": size_entry(size="small")}}, measured(),
     "no calibration of 2 processes at tiny in fp32 on this host: run make calibrate SIZE=tiny"),
    ({"sizes": {"tiny": size_entry()}}, measured("resnet", work=None),
     "no cost model for the ResNet's convolutions"),
    ({"sizes": {"tiny": size_entry()}}, measured(world=4),
     "no calibration of 4 processes at tiny in fp32 on this host: run make calibrate SIZE=tiny"),
    ({"sizes": {"tiny": size_entry()}}, measured(dtype="bf16"),
     "no calibration of 2 processes at tiny in bf16 on this host: run make calibrate SIZE=tiny"),
    ({"sizes": {"tiny": size_entry(device="cuda")}}, measured(),
     "no calibration of 2 processes at tiny in fp32 on this host: run make calibrate SIZE=tiny"),
    ({"sizes": {"tiny": size_entry(host="other-host")}}, measured(),
     "no calibration of 2 processes at tiny in fp32 on this host: run make calibrate SIZE=tiny"),
], ids=["no-file", "other-size", "resnet", "other-world", "other-dtype", "other-device",
        "other-host"])
def test_without_a_calibration_that_applies_the_prediction_says_what_to_run(calibration, rec,
                                                                            why):
    (got,) = costmodel.priced([rec], calibration)
    assert got["predicted_step_ms"] is None and got["prediction"] == {"why": why}


def test_load_calibration_is_none_before_the_first_calibration(tmp_path):
    path = tmp_path / "calibration.json"
    assert costmodel.load_calibration(path) is None
    path.write_text(json.dumps({"sizes": {"tiny": size_entry()}}))
    assert costmodel.load_calibration(path) == {"sizes": {"tiny": size_entry()}}


def test_a_runs_work_is_its_share_of_the_step(tmp_path):
    """A world of 2 taking its share of the global batch, DDP's all-reduce counted in MB: this
    rank's tokens are its own batch, the collectives' bytes are MB x 2^20, each layer passed
    once, and the parameters stepped are the optimizer's (a tied weight once; a ZeRO-style
    optimizer's, only its own). Context parallelism's attention runs in blocks of 1/cp of the
    sequence, the busiest rank's share."""
    args = tiny_args()
    torch.manual_seed(0)
    model = common.GPT(TINY, TINY.seq_len)
    tokens = TINY.batch_size * TINY.seq_len  # this rank's: the global batch over 2 ranks
    got = common.step_work(args, cpu_topology(2), stats({"allreduce/2": [1.5, 2]}), model,
                           None, 2, common.DDP_OVERLAP, False, 0.0, 1)
    work = costmodel.StepWork(*common.train_flops(TINY, "gpt", tokens, TINY.seq_len),
                              tokens * TINY.n_layers, helpers.gpt_param_count(TINY, TINY.seq_len),
                              {"allreduce/2": (1.5 * 2**20, 2)}, common.DDP_OVERLAP,
                              seq_len=TINY.seq_len, layer_passes=TINY.n_layers)
    assert got == {**work.__dict__, "collectives": {"allreduce/2": [1.5 * 2**20, 2]}}

    first_two = list(model.parameters())[:2]  # a shard's optimizer steps its own parameters
    optimizer = torch.optim.AdamW(first_two)
    got = common.step_work(args, cpu_topology(2), stats(), model, optimizer, 2, {}, True, 0.5, 4)
    assert got["stepped_params"] == sum(p.numel() for p in first_two)
    assert got["recompute"] and got["bubble"] == 0.5
    assert got["layer_passes"] == 4 * TINY.n_layers  # a stage's layers, m times
    (priced,) = costmodel.priced([measured(work=got)], {"sizes": {"tiny": size_entry()}})
    assert priced["prediction"]["bubble_ms"] == pytest.approx(
        priced["prediction"]["compute_ms"], abs=1e-3)  # idle half the step

    cp = common.step_work(args, cpu_topology(2), stats(), model, None, 2, {}, False, 0.0, 1,
                          cp=2, attention_busiest=1.5)
    assert cp["seq_len"] == TINY.seq_len // 2
    assert cp["attention_flops"] == 1.5 * work.attention_flops
    assert common.step_work(tiny_args("--model", "resnet"), cpu_topology(2), stats(), model,
                            None, 2, {}, False, 0.0, 1) is None


def test_a_record_carries_its_work_and_the_report_prices_it(tmp_path, monkeypatch):
    """In a world of 1: the record carries its step's work (`theory`'s bubble and the run's
    checkpointing in it, its collectives by op in bytes) and no prediction; the report prices
    it at its host's calibration: its parts rounded, what binds it, the calibration's id."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common.free_port())).items():
        monkeypatch.setenv(name, value)
    args = tiny_args("--results", str(tmp_path / "r.jsonl"))
    topo = common.setup(args)
    try:
        torch.manual_seed(0)
        model = common.GPT(TINY, TINY.seq_len)
        rec = common.record(args, topo, stats({"allreduce/2": [1.23456, 3]}), baseline=None,
                            model=model, optimizer=None, comm_mb=1.0, theory={"bubble": 0.25},
                            checkpointing=True, overlapped=common.DDP_OVERLAP)
    finally:
        dist.destroy_process_group()
    assert "predicted_step_ms" not in rec and "prediction" not in rec
    assert rec["work"]["recompute"] and rec["work"]["bubble"] == 0.25
    assert rec["work"]["layer_passes"] == TINY.n_layers  # no pipeline: each layer once
    assert rec["work"]["overlapped"] == common.DDP_OVERLAP
    assert rec["work"]["collectives"] == {"allreduce/2": [1.23456 * 2**20, 3]}
    assert rec["comm_by_op"] == {"allreduce/2": [1.235, 3]}
    assert common.load_results(args.results)[0] == rec
    entry = size_entry(host=rec["host"], torch_version=rec["torch"], worlds=(1,))
    (priced,) = costmodel.priced([rec], {"sizes": {"tiny": entry}})
    expected = costmodel.predict_step(costmodel.work_of(rec),
                                      costmodel.rates_from_calibration(entry, 1, "gpt"))
    parts = ("compute_ms", "communication_ms", "bubble_ms", "optimizer_ms")
    assert priced["predicted_step_ms"] == round(expected["step_ms"], 3) > 0
    assert {k: priced["prediction"][k] for k in parts} == {k: round(expected[k], 3)
                                                           for k in parts}
    assert priced["prediction"]["bound_by"] == expected["bound_by"]
    assert priced["prediction"]["calibration"] == entry["id"]


def test_a_record_is_priced_at_the_calibration_its_run_took():
    """Of its host's calibrations: the newest taken before it ran with its torch, not a later
    one; an older record's own; before any calibration, the newest of its host."""
    early, late = (size_entry(time=t) for t in ("2026-01-01T00:30:00Z", "2026-01-01T02:00:00Z"))
    calibration = {"sizes": {"tiny": late}, "history": [early]}
    assert costmodel.calibration_for(measured(), calibration) == early
    assert costmodel.calibration_for(measured(time="2026-01-01T03:00:00+00:00"),
                                     calibration) == late
    assert costmodel.calibration_for(measured(time="2025-12-31T00:00:00+00:00"),
                                     calibration) == late
    assert costmodel.calibration_for(measured(torch="y"), calibration) == late
    assert costmodel.calibration_for(measured(prediction={"calibration": late["id"]}),
                                     calibration) == late


# --- make calibrate ---------------------------------------------------------------------------
def test_a_later_world_scales_the_first_worlds_rates_by_its_whole_steps_slowdown():
    first = {"matmul_flops": 8e9, "attention_flops": 4e9, "other_s": 1e-6, "layer_s": 1e-4,
             "attention_by_length": [[32, 4e9], [128, 6e9]], "step_s": 0.1, "matmul_s": 0.05,
             "attention_s": 0.01}
    scaled = calibrate.scaled_compute(first, 0.25)
    assert scaled.pop("attention_by_length") == [[32, pytest.approx(4e9 / 2.5)],
                                                 [128, pytest.approx(6e9 / 2.5)]]
    assert scaled == pytest.approx({"matmul_flops": 8e9 / 2.5, "attention_flops": 4e9 / 2.5,
                                    "other_s": 2.5e-6, "layer_s": 2.5e-4, "step_s": 0.25,
                                    "slowdown": 2.5})


def test_median_of_the_ranks_figures_goes_figure_by_figure_through_dicts_and_lists():
    ranks = [{"a": 1.0, "b": {"c": [1.0, 10.0]}}, {"a": 3.0, "b": {"c": [2.0, 30.0]}},
             {"a": 2.0, "b": {"c": [9.0, 20.0]}}]
    assert calibrate._median_of(ranks) == {"a": 2.0, "b": {"c": [2.0, 20.0]}}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> dict:
    """calibrate([1, 2], "tiny", "fp32", 1), each figure measured twice (its band), into a file
    that already holds a "small" entry: the file's JSON. In a fresh Python: calibrate forks its
    worlds, and a fork from this process, after other tests ran OpenMP threads, could hang in
    the child."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    path.write_text(json.dumps({"sizes": {"small": size_entry()}}))
    code = ("import sys; from pathlib import Path; from report.calibrate import calibrate; "
            "calibrate([1, 2], 'tiny', 'fp32', 1, Path(sys.argv[1]), repeats=2)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=common.ROOT,
                          env=cpu_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(path.read_text())


def test_calibrate_writes_each_worlds_positive_rates_at_its_size(calibrated):
    entry = calibrated["sizes"]["tiny"]
    assert (entry["size"], entry["device"], entry["dtype"], entry["reps"]) == (
        "tiny", "cpu", "fp32", 1)
    assert set(entry["worlds"]) == {"1", "2"}
    for world, figures in entry["worlds"].items():
        assert set(figures["compute"]) == set(DECODERS)
        for c in figures["compute"].values():
            assert c["matmul_flops"] > 0 and c["attention_flops"] > 0 and c["other_s"] >= 0
            assert c["step_s"] > 0
            # the first world decomposes each model's step; the next scales it by its slowdown
            assert ("slowdown" in c) == (world == "2") and ("matmul_s" in c) == (world == "1")
            assert c["layer_s"] >= 0 and [seq for seq, _ in c["attention_by_length"]] == [
                TINY.seq_len, TINY.long_seq_len, 4 * TINY.long_seq_len]
            # torchao's float8 linears are timed only where they run natively (sm89 GPUs)
            assert "float8_matmul_flops" not in c
            if world == "1":  # the parts never add up to more than the whole step
                assert c["parts_over_whole"] >= 1
                assert c["matmul_s"] + c["attention_s"] <= c["step_s"] * (1 + 1e-9)
        assert figures["optimizer_s"] > 0 and figures["memory_bytes_per_s"] > 0
        assert 0 <= figures["overlap"] <= 1
        # each figure's band: the lower and higher of its two measurements, the median between
        low, high = figures["band"]["low"], figures["band"]["high"]
        assert low["optimizer_s"] <= figures["optimizer_s"] <= high["optimizer_s"]
        assert low["compute"]["gpt"]["step_s"] <= high["compute"]["gpt"]["step_s"]
    assert entry["worlds"]["1"]["collectives"] == {} and entry["worlds"]["1"]["overlap"] == 0
    assert entry["worlds"]["1"]["wake_up_s"] == {}
    assert set(entry["worlds"]["2"]["wake_up_s"]) == {"2"}
    links = entry["worlds"]["2"]["collectives"]
    assert set(links) == {f"{op}/2" for op in calibrate.COLLECTIVES}
    assert all(latency > 0 and per_byte > 0 for latency, per_byte in links.values()), links
    for name in DECODERS:  # what a run at this world would be priced at
        rates = costmodel.rates_from_calibration(entry, 2, name)
        assert rates.source == entry["id"]
        assert costmodel.predict_step(costmodel.StepWork(*common.train_flops(
            TINY, name, 128, TINY.seq_len), 256, 1e5, {"allreduce/2": (1e5, 1)}, {},
            seq_len=TINY.seq_len, layer_passes=TINY.n_layers), rates)["step_ms"] > 0


def test_calibrate_keeps_the_other_sizes_entries(calibrated):
    calibration = calibrated
    assert set(calibration["sizes"]) == {"small", "tiny"}
    assert calibration["sizes"]["small"] == size_entry()


def test_render_calibration_has_a_line_for_each_world_and_link(calibrated):
    text = calibrate.render_calibration(calibrated["sizes"]["tiny"])
    assert text.startswith("calibration ") and "(tiny, fp32, " in text.splitlines()[0]
    assert "  1 processes: AdamW " in text and "  2 processes: AdamW " in text
    assert all(f"{op}/2 " in text for op in calibrate.COLLECTIVES)
    assert "a collective after compute: " in text  # world 2's wake-up
    assert text.count(" matmul ") == 2 * len(DECODERS)
    assert "float8" not in text  # not measured on a CPU
    assert "figures over 2 repeats, the median's spread" in text


@pytest.mark.parametrize("flags, measures", [
    (["--worlds", "2", "4"], None),  # all there: nothing measured
    (["--worlds", "2"], None),
    (["--worlds", "2", "8"], ([2, 8], "tiny", "fp32")),  # a world missing
    (["--worlds", "2", "--dtype", "bf16"], ([2], "tiny", "bf16")),  # another dtype
    (["--worlds", "2", "--size", "small"], ([2], "small", "fp32")),  # another size
])
def test_calibrate_if_missing_measures_only_what_the_file_lacks(flags, measures, tmp_path,
                                                                monkeypatch, capsys):
    monkeypatch.setattr(cli, "CALIBRATION", tmp_path / "calibration.json")
    with_calibration(monkeypatch, tmp_path, {"sizes": {"tiny": size_entry(worlds=(2, 4))}})
    calls = []
    monkeypatch.setattr(cli, "calibrate", lambda *call, **kw: calls.append(call) or size_entry())
    monkeypatch.setattr(cli, "render_calibration", lambda entry: "rendered")
    assert cli.main(["calibrate", "--size", "tiny", *flags, "--if-missing"]) == 0
    assert calls == ([] if measures is None else
                     [(*measures, 1, tmp_path / "calibration.json")])
    calls.clear()
    assert cli.main(["calibrate", "--size", "tiny", *flags]) == 0  # always, without the flag
    assert len(calls) == 1 and "rendered" in capsys.readouterr().out


def test_two_calibrations_compare_figure_by_figure_and_name_each_apart():
    first, second = size_entry(worlds=(2,)), size_entry(worlds=(2,))
    second["id"] = "later"
    second["worlds"]["2"]["compute"]["gpt"]["matmul_flops"] = 1.05e9  # 5%: within 10%
    second["worlds"]["2"]["collectives"]["allreduce/2"] = [2e-4, 1e-9]  # twice the latency
    second["worlds"]["2"]["compute"]["llama"]["attention_by_length"] = [[32, 5e8], [128, 8e8]]
    figures = calibrate.calibration_figures(first)
    # each model's 5 figures and 2 lengths' rates, 3 of the world, a wake-up, 2 links' 2 each
    assert len(figures) == 3 * 7 + 3 + 1 + 4
    assert figures["2/collectives/allreduce/2/latency_s"] == 1e-4
    assert figures["2/compute/gpt/attention at 128"] == 1e9
    text = calibrate.compare_calibrations(first, second).splitlines()
    assert text[0] == f"{first['id']} against later: 27 of 29 figures within 10%"
    assert text[1:] == ["   50% apart: 2/collectives/allreduce/2/latency_s 0.0001 and 0.0002",
                        "   20% apart: 2/compute/llama/attention at 128 1e+09 and 8e+08"]


def test_compare_names_a_file_without_the_size_in_one_line(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"sizes": {"small": size_entry()}}))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["calibrate", "--compare", str(path), str(tmp_path / "missing.json")])
    assert stopped.value.code == 2
    assert "missing.json holds no calibration at --size small" in capsys.readouterr().err


def test_if_older_takes_a_quick_calibration_unless_this_hosts_is_younger(monkeypatch):
    """`make`'s quick calibration runs unless this host, with this torch, has one younger than
    the limit for every world and model the target runs."""
    now = datetime.datetime.now(datetime.UTC)
    entry = size_entry(host=platform.node(), torch_version=torch.__version__,
                       time=(now - datetime.timedelta(minutes=30)).isoformat())
    covers = costmodel.calibration_covers
    assert covers(entry, "fp32", [1, 2], ["gpt"], 3600)
    assert not covers(entry, "fp32", [1, 2], ["gpt"], 600)  # too old
    assert not covers(entry, "fp32", [4], ["gpt"], 3600)  # a world missing
    assert not covers(entry, "bf16", [2], ["gpt"], 3600)
    assert not covers({**entry, "host": "elsewhere"}, "fp32", [2], ["gpt"], 3600)
    assert not covers({**entry, "torch": "0.0"}, "fp32", [2], ["gpt"], 3600)
    assert covers({**entry, "host": "elsewhere"}, "fp32", [2], ["gpt"])


def banded_entry() -> dict:
    """A calibration whose world 2 was measured thrice: its band, a tenth either side."""
    entry = size_entry(worlds=(2,))
    figures = entry["worlds"]["2"]
    scaled = {end: json.loads(json.dumps(figures)) for end in ("low", "high")}
    for end, by in (("low", 0.9), ("high", 1.1)):
        compute = scaled[end]["compute"]["gpt"]
        compute["matmul_flops"] *= by
        compute["other_s"] *= by
        scaled[end]["optimizer_s"] *= by
        scaled[end]["collectives"]["allreduce/2"] = [v * by for v in
                                                     figures["collectives"]["allreduce/2"]]
    figures["band"] = scaled
    return entry


def test_a_prediction_carries_the_band_its_calibrations_spread_gives():
    """Priced at each figure's end of its band that makes the step faster, then slower: a
    matmul rate a tenth higher with seconds a tenth lower, and the other way round."""
    (rec,) = costmodel.priced([measured()], {"sizes": {"tiny": banded_entry()}})
    fast, slow = rec["prediction"]["band_ms"]
    assert fast < rec["predicted_step_ms"] < slow
    fastest, slowest = costmodel.rates_band(banded_entry(), 2, "gpt")
    assert fastest.matmul_flops == pytest.approx(1.1e9) and slowest.matmul_flops == \
        pytest.approx(0.9e9)
    assert fastest.links["allreduce/2"][0] < slowest.links["allreduce/2"][0]
    assert costmodel.rates_band(size_entry(), 2, "gpt") is None  # one repeat: no band


def test_a_second_calibration_is_checked_against_the_first_ones_band():
    first, second = banded_entry(), size_entry(worlds=(2,))
    second["id"] = "later"
    second["worlds"]["2"]["optimizer_s"] *= 1.2  # past the first's highest, a tenth above
    outside = calibrate.outside_band(first, second)
    assert [path for path, *_ in outside] == ["2/optimizer_s"]
    text = calibrate.compare_calibrations(first, second)
    assert "figures of the second within the first's band" in text
    assert "2/optimizer_s 2.4e-09, the band 1.8e-09 to 2.2e-09" in text


def test_a_calibration_keeps_the_one_it_replaces_for_the_records_priced_at_it(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr(calibrate, "_fork_world", lambda world, *rest: world_figures())
    path = tmp_path / "calibration.json"
    first = calibrate.calibrate([2], "tiny", "fp32", 1, path, quick=True)
    second = calibrate.calibrate([2], "tiny", "fp32", 1, path)
    saved = json.loads(path.read_text())
    assert first["quick"] and first["id"].endswith(" quick") and not second["quick"]
    assert saved["sizes"]["tiny"]["id"] == second["id"]
    assert [e["id"] for e in saved["history"]] == [first["id"]]
