"""Launch tests: 07_context's scripts under torchrun at `tiny`, against the baseline's run.

Four launches, shared by the assertions (a module-scoped fixture): the DDP baseline, the ring and
Ulysses on 2 processes, and the ring on a dp 2 x cp 2 mesh sharded by FSDP2 on 4, each at the
baseline's global batch of 4 sequences. PyTorch's context_parallel skips on CPU before it joins
a group (tests/test_context_ulysses.py runs it in this process); the attention units against one
fused kernel are tests/test_context.py's and test_context_ulysses.py's, the README's trainer
lines tests/test_context_trainer.py's.
"""

import functools
import math

import pytest

import common
from helpers import assert_within_its_tolerance, finish_all, only_record, torchrun
from report import results_table

FOLDER = common.ROOT / "07_context"
TINY = common.SIZES["tiny"]
# name -> (script, processes, flags): every run trains 4 sequences of tiny's long length a step
RUNS = {"baseline": ("baseline_context", 2, []),
        "ring": ("optimized_context_ring", 2, []),
        "ulysses": ("optimized_context_ulysses", 2, []),
        "ring dp2 x cp2 fsdp": ("optimized_context_ring", 4, ["--cp", "2", "--fsdp",
                                                             "--batch-size", "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {name: tmp_path_factory.mktemp(script) / "results.jsonl"
               for name, (script, _, _) in RUNS.items()}
    finish_all([functools.partial(torchrun, FOLDER / f"{script}.py", results[name], *flags,
                                  nproc=nproc) for name, (script, nproc, flags) in RUNS.items()])
    return {name: only_record(results[name]) for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_each_run_records_a_sane_run(runs, name):
    rec = runs[name]
    script, nproc, _ = RUNS[name]
    assert (rec["status"], rec["script"], rec["world_size"]) == ("ok", script, nproc)
    assert len(rec["losses"]) == 8 and all(math.isfinite(x) for x in rec["losses"])
    assert rec["losses"][-1] < rec["losses"][0]
    assert rec["seq_len"] == TINY.long_seq_len
    # a rank's share of the global batch of 4 sequences: the baseline's 2 whole ones, a cp
    # rank's 1/cp of each of the 2 x cp its group trains (of 2 on the dp 2 x cp 2 mesh)
    assert rec["batch_size"] * nproc == 4
    assert rec["tokens_per_s"] * rec["step_ms"] / 1e3 == pytest.approx(4 * TINY.long_seq_len,
                                                                      rel=1e-3)
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=1e-3)


@pytest.mark.parametrize("name", ["ring", "ulysses", "ring dp2 x cp2 fsdp"])
def test_context_parallel_trains_like_the_baseline_to_float_rounding(runs, name):
    rec, base = runs[name], runs["baseline"]
    assert_within_its_tolerance(rec, base)
    if rec["world_size"] == base["world_size"]:  # the report sets them side by side
        assert results_table.why_not_compared(rec, base) is None
    worst = max(abs(a - b) / b for a, b in zip(rec["losses"], base["losses"], strict=True))
    assert worst <= 1e-5, f"{name}: {worst:.2g} relative"


def test_the_ring_sends_its_theory_and_zigzag_balances_the_causal_work(runs):
    rec = runs["ring"]
    assert (rec["cp"], rec["balance"], rec["overlap"]) == (2, "zigzag", True)
    assert rec["ring_mb"] == pytest.approx(rec["theory"]["ring_mb"], abs=1e-3) and rec["ring_mb"]
    assert rec["theory"]["attention_balance"] == 1.0  # equal pairs, from the positions
    # measured on CPU, max/min of the ranks' kernel time (1 or more by construction)
    assert isinstance(rec["attention_balance"], float) and rec["attention_balance"] >= 1.0
    assert rec["attention_gflop"] == pytest.approx(rec["theory"]["attention_gflop"], abs=1e-3)


def test_ulysses_sends_its_theory(runs):
    rec = runs["ulysses"]
    assert rec["cp"] == 2
    assert rec["ulysses_mb"] == pytest.approx(rec["theory"]["ulysses_mb"], abs=1e-3)


def test_fsdp_over_dp_and_cp_holds_a_quarter_of_the_state(runs):
    rec, base = runs["ring dp2 x cp2 fsdp"], runs["baseline"]
    assert rec["strategy"] == "FSDP x CP" and rec["cp"] == 2
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], abs=0.01)
    assert rec["state_mb"] == pytest.approx(base["state_mb"] / 4, rel=0.02)
