"""Launch tests: 04_zero under torchrun with 2 CPU processes at `tiny`.

Seven launches shared through one module-scoped fixture, on the GPT: the DDP baseline, ZeRO-1 and
PyTorch's own ZeRO-1; on the Llama: the DDP baseline, ZeRO-2, ZeRO-3 (with --summary) and FSDP2
as ZeRO-3, each compared with the baseline of its own model; one of ZeRO-3 with its optimizer
offloaded, on the Llama, against ZeRO-3's; two of Muon on the Llama, DDP with torch.optim.Muon
and Muon on FSDP2's shards (at once); and two short traced ZeRO-1 launches at `small` (a
profiler crash they once hit). tests/test_muon.py runs the Muon scripts in-process at 2, 3 and
4 ranks. tests/test_zero.py runs every stage on
the GPT in-process (3 ranks, 1, clipped at 2).
"""

import math
import shutil

import pytest

import common
from helpers import (
    assert_bad_input_is_one_line,
    assert_within_its_tolerance,
    finish,
    finish_all,
    torchrun,
)

FOLDER = common.ROOT / "04_zero"
LLAMA = ["--model", "llama"]
RUNS = {  # name: (script, flags)
    "ddp": ("baseline_zero", []),
    "zero1": ("optimized_zero1", []),
    "pytorch1": ("optimized_zero_pytorch", []),
    "ddp llama": ("baseline_zero", LLAMA),
    "zero2": ("optimized_zero2", LLAMA),
    "zero3": ("optimized_zero3", [*LLAMA, "--summary"]),
    "pytorch3": ("optimized_zero_pytorch", [*LLAMA, "--stage", "3"]),
}
STAGE = {"ddp": 0, "ddp llama": 0, "zero1": 1, "zero2": 2, "zero3": 3, "pytorch1": 1,
         "pytorch3": 3}
BASELINE = {name: "ddp llama" if "--model" in flags else "ddp"
            for name, (_, flags) in RUNS.items()}
TINY = common.SIZES["tiny"]


def llama_counts() -> tuple[int, int]:
    """The tiny Llama's parameters in one block, and outside the blocks (embedding, final norm,
    head). Built and dropped here: a model alive at import would be live tensor memory in every
    test after it (tests/test_common.py counts those)."""
    model = common.Llama(TINY)
    block = sum(p.numel() for p in common.transformer_blocks(model)[0].parameters())
    return block, sum(p.numel() for p in model.parameters()) - TINY.n_layers * block


BLOCK, ROOT = llama_counts()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, files = {}, {}
    for name, (script, flags) in RUNS.items():
        files[name] = tmp_path_factory.mktemp(name) / "results.jsonl"
        if name == "zero3":  # --summary finds the baseline's peak in the results file
            shutil.copy(files["ddp llama"], files[name])
        console = finish(torchrun(FOLDER / f"{script}.py", files[name], *flags))
        out[name] = (common.load_results(files[name])[-1], console)
    assert all(len(common.load_results(files[name])) == 1 for name in RUNS if name != "zero3")
    return out


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(RUNS))
def test_state_and_bytes_are_their_formulas_counted_from_the_tensors(runs, name):
    rec, _ = runs[name]
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["stage"] == STAGE[name]
    assert rec["model"] == ("llama" if BASELINE[name] == "ddp llama" else "gpt")
    assert len(rec["losses"]) == 8 and all(math.isfinite(x) for x in rec["losses"])
    assert rec["loss_tolerance"] == (None if STAGE[name] == 0 else 1e-5)  # fp32: exact
    # each formula from the parameter count; what was allocated exceeds it by padding alone
    padding = rec["theory"].get("padding_mb_max", 0)
    for key in ("state_mb", "params_mb", "grads_mb", "optim_mb"):
        assert -0.005 <= rec[key] - rec["theory"][key] <= 4 * padding + 0.005, key  # to 0.01 MB
    assert rec["theory"]["state_mb"] == pytest.approx(  # the formula's P is the model's
        {0: 16, 1: 8 + 8 / 2, 2: 4 + 12 / 2, 3: 16 / 2}[rec["stage"]] * rec["params"] / 2**20,
        abs=0.001)
    assert rec["state_mb"] == pytest.approx(
        rec["params_mb"] + rec["grads_mb"] + rec["optim_mb"], abs=0.01)  # rounded to 0.01
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "pytorch1", "pytorch3"])
def test_each_stage_trains_like_ddp_on_its_model_to_float_rounding(runs, name):
    base = runs[BASELINE[name]][0]
    assert_within_its_tolerance(runs[name][0], base)
    assert relative_diff(runs[name][0]["losses"], base["losses"]) <= 1e-5


@pytest.mark.parametrize("mine, theirs", [("zero1", "pytorch1"), ("zero3", "pytorch3")])
def test_the_hand_written_stage_trains_like_pytorchs_own(runs, mine, theirs):
    assert relative_diff(runs[mine][0]["losses"], runs[theirs][0]["losses"]) <= 1e-5
    assert runs[theirs][0]["variant"] == (None if theirs == "pytorch1" else "--stage 3")


def per_value(rec: dict, key: str) -> float:
    """Bytes a rank holds of `key` per parameter of its model (the two models differ in size)."""
    return rec[key] * 2**20 / rec["params"]


def test_each_stage_shards_one_more_kind_of_state(runs):
    ddp, z1, z2, z3 = (runs[n][0] for n in ("ddp", "zero1", "zero2", "zero3"))
    assert per_value(ddp, "optim_mb") > 1.9 * per_value(z1, "optim_mb")
    assert per_value(z1, "grads_mb") > 1.9 * per_value(z2, "grads_mb")
    assert per_value(z2, "params_mb") > 1.9 * per_value(z3, "params_mb")
    states = [per_value(rec, "state_mb") for rec in (ddp, z1, z2, z3)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4


def test_the_peak_shows_a_full_gradient_only_where_one_is_kept(runs):
    ddp, z1, llama, z2, z3 = (runs[n][0] for n in ("ddp", "zero1", "ddp llama", "zero2",
                                                      "zero3"))
    assert z1["memory"]["grads"] == pytest.approx(4 * ddp["params"] / 2**20, rel=0.02)  # kept
    for rec in (z2, z3):  # the buckets being filled or reduced (here 2 blocks are all of them)
        assert 0 < rec["memory"]["grads"] <= 4 * (2 * BLOCK + ROOT) / 2**20
        assert rec["memory"]["grads"] < 0.9 * 4 * llama["params"] / 2**20
    assert z1["memory"]["optim"] == pytest.approx(ddp["memory"]["optim"] / 2, rel=0.02)
    assert ddp["peak_mem_mb"] > z1["peak_mem_mb"]
    assert llama["peak_mem_mb"] > z2["peak_mem_mb"] and z3["peak_mem_mb"] < llama["peak_mem_mb"]


def test_zero3_holds_its_shards_and_at_most_two_blocks_and_the_root_in_full(runs):
    z3 = runs["zero3"][0]
    assert z3["theory"]["gathered_mb"] == pytest.approx(4 * (2 * BLOCK + ROOT) / 2**20,
                                                        abs=0.001)  # fp32: 4 bytes a value
    assert z3["gathered_mb"] == pytest.approx(z3["memory"]["params"] - z3["params_mb"], abs=0.01)
    assert 0 < z3["gathered_mb"] <= z3["theory"]["gathered_mb"] * 1.01


def test_summary_prints_each_ranks_state_beside_its_formula(runs):
    rec, console = runs["zero3"]
    assert rec["variant"] is None  # --summary changes what is printed, not what runs
    table = [line for line in console.splitlines() if line.startswith("|")]
    assert "params MB" in table[0] and "comm MB/step" in table[0]
    rows = {line.split("|")[1].strip(): line for line in table[2:]}
    assert set(rows) == {"0", "1"}
    params = f"{rec['params_mb']:,.2f} ({rec['theory']['params_mb']:,.2f})"
    assert params in rows["0"] and "measured (formula)" in console
    assert f"({runs['ddp llama'][0]['peak_mem_mb']:,.1f})" in rows["0"]  # the baseline's peak


@pytest.mark.parametrize("script", sorted(path.stem for path in FOLDER.glob("*.py")
                                           if "muon" not in path.stem))  # AdamW's: it clips
@pytest.mark.parametrize("value", ["0", "-1"])
def test_every_script_refuses_a_clip_norm_not_above_zero_in_one_line(script, value, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", ["--clip-grad-norm", value],
                                 "--clip-grad-norm", tmp_path)


@pytest.mark.parametrize("flags, hint", [
    (["--cpu-offload"], "--cpu-offload is FSDP2's: add --stage 3"),
    (["--stage", "3", "--cpu-offload", "--clip-grad-norm", "1"],
     "--clip-grad-norm with --cpu-offload")])
def test_pytorchs_zero_refuses_flags_that_do_not_go_together_in_one_line(flags, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / "optimized_zero_pytorch.py", flags, hint, tmp_path)


def test_a_traced_run_survives_the_all_gathers_in_flight_when_the_trace_ends(tmp_path):
    """ZeRO-1 leaves its all-gathers in flight after each step. Those of the last traced step
    held the stopped profiler's state, and dropping them segfaulted (2 runs in 3 at `small`,
    before timed_steps waited for them): two short traced runs."""
    for attempt in range(2):
        results = tmp_path / f"results{attempt}.jsonl"
        finish(torchrun(FOLDER / "optimized_zero1.py", results, "--size", "small", "--trace",
                        "--warmup", "4", "--steps", "1"))
        assert len(list((tmp_path / "traces").glob("04_zero_optimized_zero1_rank*.json"))) == 2
        assert common.load_results(results)[0]["status"] == "ok"


# --- ZeRO-3 with its optimizer offloaded (optimized_zero3_offload.py) ------------------------
@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """One launch: the Llama, as the zero3 run above, its AdamW in host memory."""
    results = tmp_path_factory.mktemp("offload") / "results.jsonl"
    console = finish(torchrun(FOLDER / "optimized_zero3_offload.py", results, *LLAMA))
    return common.load_results(results)[-1], console


def test_offloaded_zero3_trains_like_zero3_with_its_optimizer_in_host_memory(runs, offloaded):
    rec, _ = offloaded
    zero3, _ = runs["zero3"]
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["model"] == "llama"
    assert rec["baseline"] == "optimized_zero3" and rec["loss_tolerance"] == 1e-5
    assert relative_diff(rec["losses"], zero3["losses"]) <= 1e-5
    for key in ("state_mb", "device_state_mb", "host_state_mb", "host_link_mb", "comm_mb"):
        assert rec[key] == pytest.approx(rec["theory"][key], abs=0.005), key
    # the device keeps the compute shard alone (fp32 here: 4 bytes), the host 12 bytes a value
    assert rec["device_state_mb"] == pytest.approx(4 * rec["params"] / 2 / 2**20, abs=0.005)
    assert rec["host_state_mb"] == pytest.approx(3 * rec["device_state_mb"], abs=0.005)
    assert rec["state_mb"] == pytest.approx(rec["device_state_mb"], abs=0.005)  # the device's
    assert rec["device_state_mb"] + rec["host_state_mb"] == pytest.approx(zero3["state_mb"],
                                                                          abs=0.01)


# --- Muon: DDP with torch.optim.Muon, and Muon on FSDP2's shards by owners -------------------
@pytest.fixture(scope="module")
def muon(tmp_path_factory):
    """Two launches at once, on the Llama: baseline_muon and optimized_fsdp_muon."""
    files = {script: tmp_path_factory.mktemp(script) / "results.jsonl"
             for script in ("baseline_muon", "optimized_fsdp_muon")}
    consoles = finish_all([lambda s=s, f=f: torchrun(FOLDER / f"{s}.py", f, *LLAMA)
                           for s, f in files.items()])
    return {script: (common.load_results(f)[-1], console)
            for (script, f), console in zip(files.items(), consoles, strict=True)}


def test_muon_on_fsdp2s_shards_trains_like_ddp_with_torchs_muon_under_torchrun(muon):
    (base, _), (rec, console) = muon["baseline_muon"], muon["optimized_fsdp_muon"]
    assert base["status"] == rec["status"] == "ok" and rec["world_size"] == 2
    assert rec["baseline"] == "baseline_muon" and rec["model"] == "llama"
    assert_within_its_tolerance(rec, base)
    assert relative_diff(rec["losses"], base["losses"]) <= 1e-5
    for r in (base, rec):  # state and bytes counted from the tensors and the collectives
        for key in ("state_mb", "params_mb", "grads_mb", "optim_mb", "comm_mb"):
            assert r[key] == pytest.approx(r["theory"][key], abs=0.01), (r["script"], key)
        assert r["optimizer_ms"] > 0 and r["optimizer_ms"] < r["step_ms"]
    assert rec["comm_by_op"]["alltoall/2"][1] == 2  # two all-to-alls a step: out and back
    assert rec["theory"]["ns_gflop_rank"] < base["theory"]["ns_gflop_rank"]
    assert "optimized_fsdp_muon: " in console
