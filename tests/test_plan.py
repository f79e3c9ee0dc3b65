"""report/planner.py: its formulas, its verdicts, its one-line errors, and its fp32
per-rank state against what each folder measured in a real run (tests/fixtures)."""

import subprocess
import sys

import pytest

import common
from report import planner

FIXTURE = common.ROOT / "tests" / "fixtures" / "records_small.jsonl"
# Each script whose kept state is one of the planned strategies. Not planned: DualPipe (every
# rank holds two stages, the whole model at 2 ranks) and the collective sweeps (no model).
STRATEGY_OF = {
    "baseline_ddp": "DDP", "optimized_ddp": "DDP", "baseline_ddp_flash": "DDP",
    "optimized_ddp_flash": "DDP", "baseline_compression": "DDP",
    "optimized_compression_int8": "DDP", "optimized_compression_powersgd": "DDP",
    "baseline_fsdp": "DDP", "optimized_fsdp": "FSDP full", "optimized_fsdp_fp8": "FSDP full",
    "baseline_zero": "DDP", "optimized_zero1": "ZeRO-1", "optimized_zero2": "ZeRO-2",
    "optimized_zero3": "ZeRO-3", "optimized_zero_pytorch": "ZeRO-1",
    "optimized_zero_pytorch --stage 3": "ZeRO-3", "baseline_symmem_training": "DDP",
    "optimized_symmem_training": "ZeRO-1",  # AdamW's state by share, weights and grads whole
    "baseline_pipeline": "pipeline", "optimized_pipeline_gpipe": "pipeline",
    "optimized_pipeline_1f1b": "pipeline", "optimized_pipeline_dualpipev": "pipeline",
    "optimized_pipeline_pytorch": "pipeline",
    "optimized_pipeline_pytorch --schedule 1f1b": "pipeline",
    "optimized_pipeline_pytorch --schedule dualpipev": "pipeline",
    "baseline_symmem_tp": "TP", "optimized_symmem_tp": "TP", "optimized_symmem_tp_pytorch": "TP"}


def plan(*flags):
    return subprocess.run([sys.executable, "-m", "report", "plan", *flags], cwd=common.ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_planned_state_is_what_each_folder_measured():
    records = [r for r in common.load_results(FIXTURE) if r.get("status") == "ok"
               and "state_mb" in r]
    checked = set()
    for rec in records:
        label = " ".join(filter(None, [rec["script"], rec.get("variant")]))
        if label not in STRATEGY_OF:
            continue
        size = common.SIZES[rec["size"]]
        embedding = size.vocab_size * size.d_model + rec["seq_len"] * size.d_model
        planned = planner.state_per_gpu(STRATEGY_OF[label], rec["params"], rec["world_size"],
                                       "fp32", embedding=embedding)
        assert planned / 2**20 == pytest.approx(rec["state_mb"], rel=0.05), label
        checked.add(label)
    assert checked == set(STRATEGY_OF)


# Each script whose bytes sent are a planned strategy's, counted by the script from what it
# handed to collectives. Not planned: compression and FP8 (fewer bytes by design),
# ZeroRedundancyOptimizer (DDP's all-reduce, then a broadcast of every shard), DualPipe(V)
# (two stages a rank), symmetric-memory training (no process group).
BYTES_OF = {
    "baseline_ddp": "DDP", "optimized_ddp": "DDP", "baseline_ddp_flash": "DDP",
    "optimized_ddp_flash": "DDP", "baseline_compression": "DDP", "baseline_fsdp": "DDP",
    "optimized_fsdp": "FSDP full", "baseline_zero": "DDP", "optimized_zero1": "ZeRO-1",
    "optimized_zero2": "ZeRO-2", "optimized_zero3": "ZeRO-3",
    "optimized_zero_pytorch --stage 3": "FSDP full", "baseline_symmem_training": "DDP",
    "baseline_pipeline": "pipeline", "optimized_pipeline_gpipe": "pipeline",
    "optimized_pipeline_1f1b": "pipeline", "optimized_pipeline_pytorch": "pipeline",
    "optimized_pipeline_pytorch --schedule 1f1b": "pipeline",
    "baseline_symmem_tp": "TP", "optimized_symmem_tp": "TP", "optimized_symmem_tp_pytorch": "TP"}


def test_the_planned_bytes_are_what_each_folder_counted():
    checked = set()
    for rec in common.load_results(FIXTURE):
        label = " ".join(filter(None, [rec["script"], rec.get("variant")]))
        if rec.get("status") != "ok" or label not in BYTES_OF:
            continue
        # a pipeline stage's output a step: the whole batch's residual stream, fp32; tensor
        # parallelism: every layer's, for one GPU's share of the batch
        size = common.SIZES[rec["size"]]
        tokens = rec["batch_size"] * rec["seq_len"]
        planned = planner.sent_per_gpu(
            BYTES_OF[label], rec["params"], rec["world_size"], "fp32",
            stage_output_bytes=tokens * size.d_model * 4,
            tied_params=size.vocab_size * size.d_model,
            stream=size.n_layers * tokens // rec["world_size"] * size.d_model,
            replicated=(size.vocab_size + rec["seq_len"]) * size.d_model)
        # ZeRO-3 and FSDP keep the root gathered from forward to backward: 2% under the formula
        assert planned / 2**20 == pytest.approx(rec["comm_mb"], rel=0.05), label
        checked.add(label)
    assert checked == set(BYTES_OF)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sharding_divides_what_it_shards(dtype):
    p, n = 1e9, 8
    ddp = planner.state_per_gpu("DDP", p, n, dtype)
    assert ddp == 16 * p  # both count 16 bytes a parameter, split differently
    assert planner.state_per_gpu("ZeRO-3", p, n, dtype) == ddp / n
    stages = [planner.state_per_gpu(s, p, n, dtype) for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert stages == sorted(stages, reverse=True) and len(set(stages)) == 4
    assert planner.state_per_gpu("FSDP hybrid", p, 16, dtype, per_node=8) == ddp / 8


def test_bytes_sent_follow_the_ring_formulas():
    p, n = 1e9, 4
    assert planner.sent_per_gpu("DDP", p, n, "fp32") == pytest.approx(2 * 3 / 4 * 4 * p)
    assert planner.sent_per_gpu("ZeRO-3", p, n, "fp32") == \
        pytest.approx(1.5 * planner.sent_per_gpu("DDP", p, n, "fp32"))
    assert planner.sent_per_gpu("DDP", p, 1, "fp32") == 0
    # the busiest stage: a middle one sends activations forward and gradients back, an end one
    # activations one way and the tied table's gradient (4 bytes a value in fp32)
    assert planner.sent_per_gpu("pipeline", p, n, "fp32", stage_output_bytes=10) == 20
    assert planner.sent_per_gpu("pipeline", p, n, "fp32", stage_output_bytes=10,
                               tied_params=5) == 30
    assert planner.sent_per_gpu("pipeline", p, 2, "fp32", stage_output_bytes=10) == 10
    assert planner.sent_per_gpu("pipeline", p, 1, "fp32", stage_output_bytes=10) == 0


def test_tensor_parallelism_moves_activations_not_parameters():
    p, stream, tables = 1e9, 1e6, 1e7
    tp = planner.sent_per_gpu("TP", p, 4, "fp32", stream=stream, replicated=tables)
    # 4 all-gathers and 4 reduce-scatters of the 4 GPUs' batch a layer, 3/4 of each, and the
    # tables' gradients all-reduced
    assert tp == pytest.approx(3 / 4 * (8 * 4 * stream * 4 + 2 * 4 * tables))
    assert planner.sent_per_gpu("TP", 2 * p, 4, "fp32", stream=stream, replicated=tables) == tp
    assert planner.sent_per_gpu("TP", p, 1, "fp32", stream=stream, replicated=tables) == 0
    # inside one node TP x DP is TP; across two, each GPU's gradients cross to its other replica
    assert planner.sent_per_gpu("TP x DP", p, 8, "fp32", stream=stream, replicated=tables) == \
        planner.sent_per_gpu("TP", p, 8, "fp32", stream=stream, replicated=tables)
    across = planner.sent_per_gpu("TP x DP", p, 16, "fp32", stream=stream, replicated=tables)
    assert across == pytest.approx(planner.sent_per_gpu("TP", p, 8, "fp32", stream=stream,
                                                       replicated=tables)
                                   + 2 * 1 / 2 * 4 * ((p - tables) / 8 + tables))
    assert planner.state_per_gpu("TP", p, 8, embedding=tables) == 16 * ((p - tables) / 8 + tables)
    assert planner.state_per_gpu("TP x DP", p, 16, embedding=tables) == \
        planner.state_per_gpu("TP", p, 8, embedding=tables)


def test_checkpointing_shrinks_activations():
    kw = {"layers": 32, "seq": 4096, "batch": 1, "hidden": 4096, "vocab": 32000, "dtype": "bf16"}
    full = planner.activations_per_gpu(checkpointing=False, **kw)
    assert planner.activations_per_gpu(checkpointing=True, **kw) < full / 4
    assert planner.activations_per_gpu(checkpointing=False, **{**kw, "dtype": "fp32"}) > full


def test_a_7b_model_on_8_gpus_of_80_gb():
    run = plan("--params", "7e9", "--gpus", "8", "--gpu-mem", "80")
    assert run.returncode == 0, run.stderr
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[6].strip()
            for line in run.stdout.splitlines() if line.startswith("| ")}
    assert rows[("DDP", "yes")] == "no"  # 16 bytes x 7e9 = 112 GB of state alone
    assert rows[("ZeRO-3", "no")] == rows[("FSDP full", "yes")] == "yes"
    assert rows[("TP", "no")] == rows[("TP x DP", "yes")] == "yes"  # the blocks split 8 ways
    assert "Cheapest in communication that fits: pipeline" in run.stdout


def test_nothing_fits_says_what_to_change():
    run = plan("--params", "70e9", "--gpus", "2", "--gpu-mem", "24")
    assert run.returncode == 0 and "Nothing fits" in run.stdout and "--gpus" in run.stdout


@pytest.mark.parametrize("flags, hint", [
    (["--gpus", "8", "--gpu-mem", "80"], "--params"),
    (["--params", "7e9", "--gpus", "0", "--gpu-mem", "80"], "--gpus"),
    (["--params", "1e5", "--gpus", "8", "--gpu-mem", "80"], "--params"),
    (["--params", "7e9", "--gpus", "8", "--gpu-mem", "80", "--dtype", "fp16"], "--dtype"),
    # TP 8 in a node leaves 8 GPUs of 64 for pp x dp: 3 stages do not divide them
    (["--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--pp", "3"], "--pp"),
    (["--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--pp", "8", "--layers", "4"],
     "--pp")])
def test_bad_input_is_one_line(flags, hint):
    run = plan(*flags)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert hint in run.stderr


MESH_FIXTURE = common.ROOT / "tests" / "fixtures" / "records_mesh.jsonl"


def mesh_layout(rec: dict) -> planner.Layout:
    """The planner's picture of the decoder a record trained, from its size preset and model."""
    size = common.SIZES[rec["size"]]
    layout = planner.llama_layout if rec["model"] == "llama" else planner.gpt_layout
    return layout(rec["params"], size.n_layers, size.d_model, size.vocab_size, rec["seq_len"])


def test_the_composed_layouts_are_what_their_scripts_measured():
    """FSDP x TP and PP x FSDP x TP: the planned state against the measured `state_mb` (the
    busiest rank's) and the planned bytes of each mesh dim against what rank 0 handed to that
    dim's process group, for both decoders at whatever size and mesh the fixture ran."""
    checked = set()
    for rec in common.load_results(MESH_FIXTURE):
        if rec.get("status") != "ok" or rec["script"] not in ("optimized_fsdp_tp",
                                                               "optimized_pipeline_3d"):
            continue
        layout, mesh, dtype = mesh_layout(rec), rec["mesh"], rec["dtype"]
        if rec["script"] == "optimized_fsdp_tp":
            # each rank's batch_size sequences: the TP group works on tp of them together
            state = planner.fsdp_tp_state(layout, mesh["dp"], mesh["tp"], dtype)
            sent = planner.fsdp_tp_sent(layout, mesh["dp"], mesh["tp"], dtype,
                                       micro_batch=rec["batch_size"])
        else:
            # a dp rank's pp x tp x batch_size sequences in m micro-batches, a TP group's each:
            # a GPU's share of one, the planner's micro-batch, is pp x batch_size / m
            m = rec["microbatches"]
            micro_batch, rest = divmod(mesh["pp"] * rec["batch_size"], m)
            assert rest == 0, "the planner counts whole sequences a GPU"
            state = planner.pp_fsdp_tp_state(layout, mesh["pp"], mesh["dp"], mesh["tp"], dtype)
            sent = planner.pp_fsdp_tp_sent(layout, mesh["pp"], mesh["dp"], mesh["tp"], m, dtype,
                                          micro_batch=micro_batch)
        label = f"{rec['script']} --model {rec['model']}"
        assert state / 2**20 == pytest.approx(rec["state_mb"], rel=0.05), label
        assert sent.keys() == rec["comm_mb_by_dim"].keys(), label
        for dim, measured in rec["comm_mb_by_dim"].items():
            assert sent[dim] / 2**20 == pytest.approx(measured, rel=0.02), f"{label}: {dim}"
        checked.add((rec["script"], rec["model"]))
    assert checked == {(script, model) for script in ("optimized_fsdp_tp", "optimized_pipeline_3d")
                       for model in ("gpt", "llama")}


def test_tp_over_one_gpu_is_fsdp():
    layout = planner.llama_layout(7e9, 32, 4096, 32000, 4096)
    assert planner.fsdp_tp_state(layout, 8, 1) == planner.state_per_gpu("FSDP full", 7e9, 8)
    assert planner.fsdp_tp_sent(layout, 8, 1)["tp"] == 0
    # sharding over pp x dp x tp: the first stage's blocks 1/pp of them, its table split dp x tp
    three_d = planner.pp_fsdp_tp_state(layout, 2, 4, 8)
    assert three_d == pytest.approx(16 * ((7e9 - 2 * 32000 * 4096 - 65 * 4096) / 64
                                          + 32000 * 4096 / 32 + 65 * 4096 / 8))


def test_tp_traffic_stays_in_the_node():
    """Across 8 nodes, the composed rows' bytes across nodes are FSDP's and the pipeline's: TP's
    stay on NVLink, and the table shows each dim's."""
    run = plan("--params", "70e9", "--gpus", "64", "--gpu-mem", "80", "--layers", "80",
               "--hidden", "8192", "--llama", "--pp", "4")
    assert run.returncode == 0, run.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in run.stdout.splitlines()
            if line.startswith("| ") and " x TP" in line]
    assert len(rows) == 4
    for row in rows:
        by_dim = dict(part.rsplit(" ", 1) for part in row[10].split(": ")[1].split(" / "))
        assert float(row[8]) == pytest.approx(sum(float(by_dim[d]) for d in ("FSDP", "PP")
                                                  if d in by_dim), abs=0.02)
        assert float(row[7]) == pytest.approx(sum(map(float, by_dim.values())), abs=0.03)
    assert all(row[10].startswith("pp 4 x dp 2 x tp 8, m 8") for row in rows[2:])


def test_the_decision_matrix_cases():
    run = plan("--cases")
    assert run.returncode == 0, run.stderr
    picks = {line.split(" (")[0]: line.split("): ", 1)[1].split(":")[0]
             for line in run.stdout.splitlines() if " GPUs (" in line}
    assert picks == {
        "ResNet-50 on 8 GPUs": "DDP", "GPT-2 1.5B on 4 GPUs": "DDP",
        # ZeRO-1 fits 7B (58 GB: fp32 Adam state over 8, bf16 weights and grads whole) and sends
        # DDP's bytes, two thirds of FSDP's: sharding the weights too is not needed
        "LLaMA-7B on 8 GPUs": "ZeRO-1",
        "LLaMA-70B on 64 GPUs": "PP x FSDP x TP (pp 2 x dp 4 x tp 8, m 4) with activation "
                                "checkpointing"}
