"""Launch tests: 05_pipeline under torchrun with CPU processes at `tiny`.

Six launches shared through one module-scoped fixture (the naive baseline, GPipe, 1F1B,
torch.distributed.pipelining's GPipe and 1F1B, and 1F1B at 3 ranks with an odd m), each checked
against the unsplit model trained in this process on the same batches.
"""

import pytest
import torch

import common
from helpers import TINY, assert_bad_input_is_one_line, finish, only_record, torchrun

FOLDER = common.ROOT / "05_pipeline"
SCRIPTS = ["baseline_pipeline", "optimized_pipeline_gpipe", "optimized_pipeline_1f1b"]
M = 4  # micro-batches at tiny, 2 sequences each
RUNS = {script: (script, 2, []) for script in SCRIPTS} | {  # torch.distributed.pipelining's,
    "torch gpipe": ("optimized_pipeline_pytorch", 2, []),  # and a middle rank with an odd m
    "torch 1f1b": ("optimized_pipeline_pytorch", 2, ["--schedule", "1f1b"]),
    "1f1b at 3 ranks": ("optimized_pipeline_1f1b", 3, ["--microbatches", "3", "--batch-size", "6"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (script, nproc, flags) in RUNS.items():
        results = tmp_path_factory.mktemp(script) / "results.jsonl"
        flags = ["--batch-size", str(2 * M), "--microbatches", str(M), *flags]
        console = finish(torchrun(FOLDER / f"{script}.py", results, *flags, nproc=nproc))
        out[name] = (only_record(results), console)
    return out


@pytest.fixture(scope="module")
def unsplit_losses():
    """The whole GPT on one process, the same batches, AdamW: what every schedule must match
    (by batch size)."""
    out = {}
    for batch in (2 * M, 6):
        args = common.parser(None).parse_args([*TINY, "--batch-size", str(batch)])
        args.dtype = "fp32"
        topo = common.Topology(0, 0, 1, 1, 1, "gloo", torch.device("cpu"))
        model, batches = common.workload(args, topo, dp_rank=0, dp_world=1)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        out[batch] = []
        for inputs, targets in batches:
            opt.zero_grad()
            loss = model(inputs, targets)
            loss.backward()
            opt.step()
            out[batch].append(loss.item())
    return out


@pytest.mark.parametrize("script", list(RUNS))
def test_every_schedule_trains_the_unsplit_model(runs, unsplit_losses, script):
    rec, _ = runs[script]
    assert rec["status"] == "ok" and rec["world_size"] == rec["stages"] == RUNS[script][1]
    reference = unsplit_losses[rec["batch_size"]]
    assert max(abs(a - b) / b for a, b in zip(rec["losses"], reference, strict=True)) <= 1e-5
    assert rec["params"] == common.gpt_param_count(common.SIZES["tiny"], 32)  # all stages


@pytest.mark.parametrize("script", [*SCRIPTS, "1f1b at 3 ranks"])
def test_records_carry_a_real_timeline_and_its_bubble_beside_theory(runs, script):
    rec, console = runs[script]
    m, p = rec["microbatches"], rec["stages"]
    assert m == {"baseline_pipeline": 1, "1f1b at 3 ranks": 3}.get(script, M)
    assert rec["tokens_per_s"] > 0
    timeline = rec["timeline"]
    assert len(timeline) == p
    for actions in timeline:  # every micro-batch's F and B, each taking time, in order
        assert sorted((kind, mb) for kind, mb, *_ in actions) == \
            sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(end > start for *_, start, end in actions)
        assert all(a[3] <= b[2] for a, b in zip(actions[:-1], actions[1:], strict=True))
    assert 0 < rec["bubble"] < 1 and 0 < rec["theory"]["bubble"] < 1
    assert rec["theory"]["bubble_uniform"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-4)
    assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], rel=1e-3)
    assert all(f"rank  {r} |" in console for r in range(p))


def test_1f1b_holds_at_most_p_micro_batches_gpipe_all_m(runs):
    gpipe, one_f_one_b = runs["optimized_pipeline_gpipe"][0], runs["optimized_pipeline_1f1b"][0]
    assert gpipe["inflight_max"] == gpipe["theory"]["inflight_max"] == M
    assert one_f_one_b["inflight_max"] == one_f_one_b["theory"]["inflight_max"] == 2
    assert one_f_one_b["memory"]["activations"] < gpipe["memory"]["activations"]


@pytest.mark.parametrize("script, flags, world, hint", [
    ("optimized_pipeline_1f1b", ["--batch-size", "6", "--microbatches", "4"], "1",
     "--microbatches"),
    ("optimized_pipeline_1f1b", ["--size", "tiny"], "5", "fewer processes"),  # 4 layers
    ("optimized_pipeline_1f1b", ["--model", "resnet", "--batch-size", "8"], "1", "--model gpt"),
    ("baseline_pipeline", ["--size", "tiny"], "5", "fewer processes"),  # any m splits its batch
    ("baseline_pipeline", ["--model", "resnet", "--batch-size", "8"], "1", "--model gpt"),
    ("optimized_pipeline_pytorch", ["--batch-size", "6", "--microbatches", "4"], "1",
     "--microbatches"),
])
def test_bad_input_exits_2_with_one_line(script, flags, world, hint, tmp_path):
    assert_bad_input_is_one_line(FOLDER / f"{script}.py", flags, hint, tmp_path,
                                 WORLD_SIZE=world)


@pytest.mark.parametrize("mine, theirs", [("optimized_pipeline_gpipe", "torch gpipe"),
                                          ("optimized_pipeline_1f1b", "torch 1f1b")])
def test_the_hand_written_schedule_trains_like_torchs_own(runs, mine, theirs):
    ours, torchs = runs[mine][0], runs[theirs][0]
    assert max(abs(a - b) / b for a, b in zip(ours["losses"], torchs["losses"], strict=True)) \
        <= 1e-5
    assert ("--schedule 1f1b" in torchs["variant"]) == (theirs == "torch 1f1b")
    assert ours["comm_mb"] == pytest.approx(torchs["comm_mb"], rel=1e-3)  # the same tensors
