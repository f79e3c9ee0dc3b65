"""Launch tests: 08_moe's scripts under torchrun at `tiny`, against the baseline's run.

Five launches, shared by the assertions (a module-scoped fixture): the DDP baseline and expert
parallelism on 2 processes (ep 2), then both on 4 (ep 4), and expert parallelism on a dp 2 x ep 2
mesh with the dense part sharded by FSDP2. The layer against every expert on every rank is
tests/test_moe.py's; the README's trainer lines tests/test_moe_trainer.py's.
"""

import functools
import math

import pytest

import common
import helpers
from helpers import assert_within_its_tolerance, finish_all, only_record, torchrun
from report import results_table

FOLDER = common.ROOT / "08_moe"
TINY = common.SIZES["tiny"]
# name -> (script, processes, flags)
RUNS = {"baseline": ("baseline_moe", 2, []),
        "ep 2": ("optimized_moe_ep", 2, []),
        "baseline 4": ("baseline_moe", 4, []),
        "ep 4": ("optimized_moe_ep", 4, []),
        "dp 2 x ep 2 fsdp": ("optimized_moe_ep", 4, ["--ep", "2", "--fsdp"])}
BASELINE_OF = {"ep 2": "baseline", "ep 4": "baseline 4", "dp 2 x ep 2 fsdp": "baseline 4"}


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
    assert rec["model"] == "moe" and rec["moe_balance"] == "bias"
    assert rec["params"] == helpers.moe_param_counts(TINY)[0]
    assert len(rec["losses"]) == 8 and all(math.isfinite(x) for x in rec["losses"])
    assert rec["losses"][-1] < rec["losses"][0]
    for figure in ("comm_mb", "state_mb"):
        assert rec[figure] == pytest.approx(rec["theory"][figure], abs=1e-2), figure
    tokens = nproc * TINY.batch_size * TINY.seq_len
    even = tokens * TINY.top_k / TINY.n_experts
    assert rec["theory"]["busiest_expert_tokens"] == even  # an even load's
    assert even <= rec["busiest_expert_tokens"] <= tokens  # a token meets an expert once
    assert 1.0 <= rec["expert_load"] <= rec["expert_load_step"] <= TINY.n_experts / TINY.top_k


@pytest.mark.parametrize("name", list(BASELINE_OF))
def test_expert_parallelism_trains_like_the_baseline_to_float_rounding(runs, name):
    rec, base = runs[name], runs[BASELINE_OF[name]]
    assert_within_its_tolerance(rec, base)
    assert results_table.why_not_compared(rec, base) is None
    worst = max(abs(a - b) / b for a, b in zip(rec["losses"], base["losses"], strict=True))
    assert worst <= 1e-5, f"{name}: {worst:.2g} relative"
    # the same routing, so the same load, counted over all ranks
    assert rec["expert_load_by_layer"] == pytest.approx(base["expert_load_by_layer"], abs=1e-3)


@pytest.mark.parametrize("name", list(BASELINE_OF))
def test_the_all_to_alls_send_their_theory_and_the_experts_are_not_replicated(runs, name):
    rec, base = runs[name], runs[BASELINE_OF[name]]
    ep = {"ep 2": 2, "ep 4": 4, "dp 2 x ep 2 fsdp": 2}[name]
    assert (rec["ep"], rec["mesh"]) == (ep, [rec["world_size"] // ep, ep])
    assert rec["alltoall_mb"] == pytest.approx(rec["theory"]["alltoall_mb"], abs=1e-3)
    assert rec["alltoall_mb"] > 0
    assert rec["state_mb"] < base["state_mb"]  # E/ep of the experts, and of their Adam state
