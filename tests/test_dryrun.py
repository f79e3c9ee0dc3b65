"""Dry runs (`--dry-run N`): a script's own path as one rank of N under the fake process group and
fake tensors. They equal the real run where this host can run one (world 2 on gloo), they run a
published shape at 1,024 ranks, and they find what CPU runs cannot (AdamW's GPU path)."""

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch

import common
from report import plan_cases, plan_input, planner
from tests import helpers
from tests.helpers import TINY, cpu_env, finish_all, only_record, torchrun

# (script, flags, world): a script of each folder that dry-runs, at tiny, checked against a real
# world this host runs on gloo
EQUAL_TO_THE_REAL_RUN = [
    ("01_ddp/baseline_ddp.py", [], 2), ("03_fsdp/optimized_fsdp.py", [], 2),
    ("03_fsdp/optimized_fsdp_tp.py", ["--model", "llama"], 4),
    ("04_zero/optimized_zero2.py", [], 2), ("05_pipeline/optimized_pipeline_1f1b.py", [], 2),
    ("06_symmem/baseline_symmem_training.py", [], 2), ("08_moe/optimized_moe_ep.py", ["--fsdp"], 2),
    ("04_zero/optimized_zero3.py", [], 8), ("07_context/optimized_context_ring.py", ["--fsdp"], 2)]


def start_dry_run(script: str, results, *flags: str) -> subprocess.Popen:
    """`script --dry-run ...` begun in its own Python (the fake mode stays on until it ends),
    for finish_all."""
    return subprocess.Popen([sys.executable, script, "--results", str(results), *flags],
                            cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cpu_env())


# Every strategy `make plan` offers that dry-runs: the script and flags that run it at `large`
# (a Llama of 1B; `small`'s MoE for EP, a shape with no shared expert, which the planner does not
# count) at a world the planner would plan it at, and the planner's flags for what that run
# computes (a pipeline's micro-batches, a TP or CP group's sequences).
LARGE = ["--size", "large", "--model", "llama"]
PLANNED_DRY_RUNS = {
    "ZeRO-1": ("04_zero/optimized_zero1.py", [*LARGE, "--dry-run", "8"], {}),
    "ZeRO-2": ("04_zero/optimized_zero2.py", [*LARGE, "--dry-run", "8"], {}),
    "ZeRO-3": ("04_zero/optimized_zero3.py", [*LARGE, "--dry-run", "8"], {}),
    "ZeRO-3 + offload": ("04_zero/optimized_zero3_offload.py", [*LARGE, "--dry-run", "8"], {}),
    "FSDP full": ("03_fsdp/optimized_fsdp.py", [*LARGE, "--dry-run", "8"], {}),
    "FSDP + LoRA": ("03_fsdp/optimized_fsdp_lora.py", [*LARGE, "--dry-run", "8"],
                    {"lora_rank": 8}),
    "FSDP grad-op": ("03_fsdp/optimized_fsdp.py",
                     [*LARGE, "--dry-run", "8", "--reshard-after-forward", "false"], {}),
    "FSDP hybrid": ("03_fsdp/optimized_fsdp.py", [*LARGE, "--dry-run", "16", "--hsdp", "2"],
                    {}),
    "pipeline": ("05_pipeline/optimized_pipeline_1f1b.py",
                 [*LARGE, "--dry-run", "8", "--microbatches", "16", "--batch-size", "64"],
                 {"micro_batches": 16}),
    "TP": ("06_symmem/baseline_symmem_tp.py", [*LARGE, "--dry-run", "8", "--batch-size", "32"],
           {}),
    "FSDP x TP": ("03_fsdp/optimized_fsdp_tp.py", [*LARGE, "--dry-run", "8", "--tp", "8"], {}),
    "FSDP x CP": ("07_context/optimized_context_ring.py", [*LARGE, "--dry-run", "8", "--fsdp"],
                  {"cp": 8}),
    "PP x FSDP x TP": ("05_pipeline/optimized_pipeline_3d.py",
                       [*LARGE, "--dry-run", "16", "--tp", "8"], {"pp": 2, "micro_batches": 4}),
    "EP x FSDP": ("08_moe/optimized_moe_ep.py",
                  ["--size", "small", "--model", "moe", "--dry-run", "8", "--fsdp"], {}),
    "ZeRO-1 + Muon": ("04_zero/optimized_zero1_muon.py", [*LARGE, "--dry-run", "8"],
                      {"muon": True}),
    "FSDP + Muon": ("04_zero/optimized_fsdp_muon.py", [*LARGE, "--dry-run", "8"], {"muon": True}),
}
# Muon's owners hold whole matrices, which the planner splits evenly: a run's state and bytes
# are the busiest owner's and carry the slices' padding, within this of the planner's
OWNERS_TOLERANCE = {"ZeRO-1 + Muon": 0.02, "FSDP + Muon": 0.01}
# ... and those that do not, each with why: DDP's reducer; 06's TP spans every rank it is given
CANNOT_DRY_RUN = {"DDP": "DDP cannot dry-run", "EP": "DDP cannot dry-run",
                  "DDP + Muon": "DDP cannot dry-run",
                  "TP x DP": "no script runs it: 06's TP spans the world"}


def sequences_a_gpu(strategy: str, rec: dict) -> int:
    """The planner's micro-batch, sequences a GPU computes at once, for what `rec` ran: a TP
    group's batch over its GPUs, a pipeline's micro-batch, a CP group's batch (one a rank)."""
    if strategy == "TP":
        return rec["batch_size"] // rec["world_size"]
    if strategy == "pipeline":
        return rec["batch_size"] // rec["microbatches"]
    if strategy == "FSDP x CP":
        return rec["batch_size"] * rec["cp"]
    if strategy == "PP x FSDP x TP":
        mesh = rec["mesh"]
        return mesh["pp"] * rec["batch_size"] // rec["microbatches"]
    return rec["batch_size"]


def planner_flags(strategy: str, rec: dict, configured: dict) -> argparse.Namespace:
    """The planner's flags for a dry run's record: its shape (the size's), world and sequences."""
    size = common.SIZES[rec["size"]]
    moe = rec["model"] == "moe"
    return argparse.Namespace(**{
        **plan_input.FLAG_DEFAULTS, "params": float(rec["params"]), "gpus": rec["world_size"],
        "layers": size.n_layers, "hidden": size.d_model, "vocab": size.vocab_size,
        "seq_len": rec["seq_len"], "llama": True, "ffn": size.llama_ffn,
        "heads": size.n_heads, "kv_heads": size.n_kv_heads, "head_dim": size.attention_head_dim,
        "micro_batch": sequences_a_gpu(strategy, rec),
        **({"experts": size.n_experts, "top_k": size.top_k, "expert_ffn": size.expert_ffn}
           if moe else {}),
        **configured})


# The other single dry runs the tests below read, started with those above in one pool: the
# 1,024-rank one first (the longest), FSDP as rank 0 and rank 2 of 3, FP8, and what cannot
# dry-run (each records why)
CANNOT_DRY_RUN_SCRIPTS = {
    "01_ddp/optimized_ddp.py": "DDP cannot dry-run",
    # its own check of --warmup, which a dry run's two steps fail, waits for DDP's word
    "02_compression/optimized_compression_powersgd.py": "DDP cannot dry-run",
    "05_pipeline/optimized_pipeline_pytorch.py": "learns each stage's shapes"}
OTHER_DRY_RUNS = {
    "llama2-70b at 1024": ("03_fsdp/optimized_fsdp_tp.py",
                           ["--size", "llama2-70b", "--dry-run", "1024", "--tp", "8"]),
    **{f"fsdp as rank {rank} of 3": ("03_fsdp/optimized_fsdp.py",
                                      ["--dry-run", "3", "--dry-rank", str(rank)])
       for rank in (0, 2)},
    "fp8": ("03_fsdp/optimized_fsdp_fp8.py", [*TINY, "--dry-run", "2"]),
    **{script: (script, [*TINY, "--dry-run", "2"]) for script in CANNOT_DRY_RUN_SCRIPTS}}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """{name: (record, console)} of every run in OTHER_DRY_RUNS and PLANNED_DRY_RUNS, two at a
    time (each is one process on one core)."""
    out = tmp_path_factory.mktemp("dry")
    runs = {**OTHER_DRY_RUNS, **{name: run[:2] for name, run in PLANNED_DRY_RUNS.items()}}
    consoles = finish_all([lambda i=i, run=run: start_dry_run(run[0], out / f"{i}.jsonl", *run[1])
                           for i, run in enumerate(runs.values())])
    return {name: (only_record(out / f"{i}.jsonl"), console)
            for i, (name, console) in enumerate(zip(runs, consoles, strict=True))}


@pytest.mark.parametrize("strategy", PLANNED_DRY_RUNS)
def test_every_planned_strategy_dry_runs_to_the_planners_figures(dry_runs, strategy):
    """The planner's row for a strategy, at the dry run's world, shape and exact parameter count,
    is what the script does as rank 0: the same state and bytes (to FSDP's padding, which the
    planner leaves out) and, within DRY_RUN_ACTIVATIONS_TOLERANCE, the peak beyond the state."""
    rec = dry_runs[strategy][0]
    assert rec["status"] == "ok", rec["reason"]
    figures = plan_cases.beside_dry_run(planner_flags(strategy, rec, PLANNED_DRY_RUNS[strategy][2]),
                                     strategy, rec)
    dry, planned = zip(*figures.values(), strict=True)
    assert dry[0] == pytest.approx(planned[0], rel=OWNERS_TOLERANCE.get(strategy, 1e-4)), "state"
    assert dry[2] == pytest.approx(planned[2], rel=OWNERS_TOLERANCE.get(strategy, 1e-4)), "sent"
    assert dry[1] == pytest.approx(planned[1], rel=plan_cases.DRY_RUN_ACTIVATIONS_TOLERANCE), \
        "activations"


def test_fsdp_holds_its_root_gathered_at_the_peak(dry_runs):
    """`dry_run.gathered_mb`, the parameters at the peak beyond the state's: at FSDP full's (its
    loss's backward) the root, which FSDP2 keeps gathered from forward to backward, in bf16 (the
    token table, the head and the final norm), and no block (each resharded after its forward)."""
    size, rec = common.SIZES["large"], dry_runs["FSDP full"][0]
    root = 2 * (2 * size.vocab_size * size.d_model + size.d_model)
    assert rec["dry_run"]["gathered_mb"] * 2**20 == pytest.approx(root, rel=1e-3)


def test_every_strategy_the_planner_offers_dry_runs_or_says_why():
    offered = {entry["strategy"] for entry in planner.planned_strategies()}
    assert offered == set(PLANNED_DRY_RUNS) | set(CANNOT_DRY_RUN)


@pytest.fixture(scope="module")
def real_and_dry(tmp_path_factory) -> list[tuple[dict, dict]]:
    """Each of EQUAL_TO_THE_REAL_RUN run for real (torchrun, fp32) and dry as rank 0 of as many,
    both measuring the same step, the last of two warm-up steps; all started as slots free."""
    out = tmp_path_factory.mktemp("dryrun")
    finish_all([start for i, (s, f, n) in enumerate(EQUAL_TO_THE_REAL_RUN) for start in (
        lambda i=i, s=s, f=f, n=n: torchrun(common.ROOT / s, out / f"real{i}.jsonl", *f,
                                            "--steps", "1", nproc=n),
        lambda i=i, s=s, f=f, n=n: start_dry_run(s, out / f"dry{i}.jsonl", *TINY, *f,
                                                 "--dry-run", str(n), "--dtype", "fp32"))])
    return [(only_record(out / f"real{i}.jsonl"), only_record(out / f"dry{i}.jsonl"))
            for i in range(len(EQUAL_TO_THE_REAL_RUN))]


@pytest.mark.parametrize("i", range(len(EQUAL_TO_THE_REAL_RUN)),
                         ids=[f"{s} at {n}" for s, _, n in EQUAL_TO_THE_REAL_RUN])
def test_a_dry_run_equals_the_real_run(real_and_dry, i):
    real, dry = real_and_dry[i]
    assert dry["dry_run"]["world"] == real["world_size"] and dry["losses"] == []
    assert dry["step_ms"] is None
    assert dry["state_mb"] == real["state_mb"]
    # MoE's token exchange is as large as its routing, which the dry run stands in for (even)
    routed = {op for op in real["comm_by_op"] if op.startswith("alltoall")}
    assert {op: v for op, v in dry["comm_by_op"].items() if op not in routed} == \
        {op: v for op, v in real["comm_by_op"].items() if op not in routed}
    assert dry["comm_mb"] == pytest.approx(real["comm_mb"], rel=0.05 if routed else 0)
    assert bool(routed) == ("routing" in dry["dry_run"]["stand_ins"])
    assert dry["peak_mem_mb"] == pytest.approx(real["peak_mem_mb"], rel=0.10)
    assert dry["dry_run"]["flops"] > 0


def test_a_llama_70b_fsdp_tp_dry_run_at_1024_ranks(dry_runs):
    """The seed guide's largest row at a world no CPU has: FSDP x TP over 1,024 ranks, rank 0
    holding 1/1,024 of Llama 2 70B's state (16 bytes a parameter: fp32 weights, gradients
    and two AdamW moments), and sending over its TP group of 8."""
    rec, out = dry_runs["llama2-70b at 1024"]
    params = helpers.llama_param_count(common.SIZES["llama2-70b"])
    assert rec["params"] == params == 68_976_648_192  # Llama 2 70B's, from its config.json
    assert rec["dry_run"]["rank"] == 0 and rec["mesh"] == {"dp": 128, "tp": 8}
    assert rec["state_mb"] == pytest.approx(16 * params / 1024 / 2**20, rel=0.01)
    assert rec["dry_run"]["host_rss_mb"] < 8 * 1024
    assert "dry run as rank 0 of 1024" in out
    # the planner's FSDP x TP row at this world, the seed case's flags (Llama 2 70B's shape) and
    # the exact parameter count: the same state and bytes, and its activations
    flags = next(f for n, f, _ in plan_cases.CASES if n == "LLaMA-70B on 64 GPUs")
    args = argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, **flags, "gpus": 1024})
    figures = plan_cases.beside_dry_run(args, "FSDP x TP", rec)
    dry, planned = zip(*figures.values(), strict=True)
    assert dry[0] == pytest.approx(planned[0], rel=1e-3) and \
        dry[2] == pytest.approx(planned[2], rel=1e-3)
    assert dry[1] == pytest.approx(planned[1], rel=plan_cases.DRY_RUN_ACTIVATIONS_TOLERANCE)
    row = next(r for r in planner.plan_strategies(argparse.Namespace(
        **{**vars(args), "params": float(params)})) if r["strategy"] == "FSDP x TP" and not
        r["checkpointing"])
    assert row["mesh"] == "dp 128 x tp 8"
    assert {dim: mb * 2**20 for dim, mb in rec["comm_mb_by_dim"].items()} == \
        pytest.approx(row["by_dim"], rel=1e-3)
    print(f"1,024-rank Llama 2 70B dry run: {rec['dry_run']['host_s']:.0f} s")


def test_the_rank_played_is_the_one_asked_for(dry_runs):
    """FSDP shards dim 0 in chunks of ceil(rows / world), the last rank's short where it does
    not divide: played as rank 2 of 3, `small` holds less than as rank 0 (its 1,024-token table:
    342, 342 and 340 rows; its 256-wide norms: 86, 86 and 84)."""
    first, last = (dry_runs[f"fsdp as rank {rank} of 3"][0] for rank in (0, 2))
    assert (first["dry_run"]["rank"], last["dry_run"]["rank"]) == (0, 2)
    assert last["state_mb"] < first["state_mb"]


def test_the_dry_run_finds_adamws_gpu_crash_on_mixed_parameters(tmp_path):
    """08's EP x FSDP as it stood before its fix: one AdamW over FSDP's DTensors and the plain
    experts. On CPU AdamW steps one tensor at a time and trains; on a GPU its default, foreach,
    refuses the mix. The dry run takes the GPU's path and fails as a GPU would."""
    before_the_fix = (
        "import sys, torch\n"
        "from tests.helpers import load_recipe\n"
        "import common\n"
        "ep = load_recipe(common.ROOT / '08_moe/optimized_moe_ep.py')\n"
        "ep.adamw = lambda model, experts, **kw: torch.optim.AdamW(model.parameters(), **kw)\n"
        f"sys.argv = ['08_moe/optimized_moe_ep.py', *{TINY!r}, '--fsdp', '--dry-run', '4',\n"
        f"            '--results', {str(tmp_path / 'r.jsonl')!r}]\n"
        "ep.main()\n")
    proc = subprocess.run([sys.executable, "-c", before_the_fix], cwd=common.ROOT, text=True,
                          capture_output=True, timeout=120, env=cpu_env(PYTHONPATH=str(
                              common.ROOT)))
    assert proc.returncode != 0 and "mixed torch.Tensor and DTensor" in proc.stderr, \
        proc.stderr[-2000:]


@pytest.mark.parametrize("script", CANNOT_DRY_RUN_SCRIPTS)
def test_what_cannot_dry_run_says_why_in_one_line(dry_runs, script):
    rec = dry_runs[script][0]
    assert rec["status"] == "skipped" and CANNOT_DRY_RUN_SCRIPTS[script] in rec["reason"] and \
        "\n" not in rec["reason"]


def test_fp8_dry_runs_its_float8_weights_with_their_precomputed_scales(dry_runs):
    """torchao's float8 weight, flattened, asks whether its scale is nonzero, which a fake one
    cannot say: the dry run flattens it as a GPU does, and names the stand-in."""
    rec = dry_runs["fp8"][0]
    assert rec["status"] == "ok" and "float8 weights" in rec["dry_run"]["stand_ins"]


def test_published_shapes_have_their_published_parameter_counts():
    """From each model's config.json: Llama 2 7B 6,738,415,616; Llama 3 8B 8,030,261,248."""
    assert helpers.llama_param_count(common.SIZES["llama2-7b"]) == 6_738_415_616
    assert helpers.llama_param_count(common.SIZES["llama3-8b"]) == 8_030_261_248
    total, active = helpers.moe_param_counts(common.SIZES["qwen3-30b-a3b"])
    assert total == pytest.approx(30.5e9, rel=0.01) and active == pytest.approx(3.3e9, rel=0.03)


def test_even_routing_spreads_every_slot():
    counts = common.even_routing(10, 2, 2)
    assert counts == [[3, 3], [2, 2]] and sum(map(sum, counts)) == 10


@pytest.mark.parametrize("flags, hint", [
    (["--dry-run", "4", "--dry-rank", "4"], "use 0 to 3"),
    (["--dry-rank", "1"], "use it with --dry-run"),
    (["--size", "llama3-8b", "--model", "moe"], "use --model llama"),
])
def test_bad_dry_run_flags_are_one_line(flags, hint):
    proc = subprocess.run([sys.executable, "01_ddp/baseline_ddp.py", "--check-flags", *flags],
                          cwd=common.ROOT, capture_output=True, text=True, timeout=60,
                          env=cpu_env())
    assert proc.returncode == 2 and hint in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_the_dry_run_table_shows_peak_by_kind_and_says_why_a_run_did_not(tmp_path):
    from report.dryrun import render_dry_runs
    ok = {"folder": "03_fsdp", "script": "optimized_fsdp", "variant": None, "size": "llama2-7b",
          "model": "llama", "world_size": 8, "status": "ok", "peak_mem_mb": 2048.0,
          "state_mb": 1024.0, "comm_mb": 512.0, "memory": {"params": 1024.0, "activations": 512},
          "dry_run": {"world": 8, "flops": 2e12, "host_s": 3.0, "stepped_params": 1e9,
                      "sent_mb": {"node": 0.0, "network": 512.0}}}
    skipped = {**ok, "script": "optimized_ddp", "status": "skipped", "reason": "DDP cannot"}
    text = render_dry_runs([json.loads(json.dumps(r)) for r in (ok, skipped)])
    # in the planner's units: 2,048 MB of 2^20 bytes are 2.1 GB of 10^9
    assert "| 2.1 (1.1 /  /  / 0.5 / ) GB" in text and "| 537 MB " in text and "| 1.1 GB " in text
    assert "01_ddp" not in text and "optimized_ddp (llama llama2-7b, world 8): skipped" in text


def test_a_dry_runs_step_on_a_gpu_is_its_flops_at_the_fitted_rate_plus_its_bytes():
    from report.gpus import GPUS
    from report.planner import achieved, dry_run_step
    dry = {"flops": 1e15, "stepped_params": 0, "sent_mb": {"node": 0.0, "network": 0.0}}
    alone = dry_run_step(dry)
    assert alone["compute_ms"] == pytest.approx(1e18 / (GPUS["h100"].bf16_flops *
                                                        achieved("eager")))
    slower = dry_run_step({**dry, "sent_mb": {"node": 0.0, "network": 1024.0}})
    faster = dry_run_step({**dry, "sent_mb": {"node": 1024.0, "network": 0.0}})
    assert alone["step_ms"] < faster["step_ms"] < slower["step_ms"]


def test_make_dryrun_runs_every_seed_case_the_planner_shows_beside_its_formula():
    makefile = (common.ROOT / "Makefile").read_text()
    seed_runs = makefile.split("DRY_SEED_RUNS = ")[1].split("\ndryrun:")[0]
    assert set(re.findall(r"'([^']+)'", seed_runs)) == \
        {run for _, run, _ in plan_cases.CASE_DRY_RUNS.values()}
    assert set(plan_cases.CASE_DRY_RUNS) <= {name for name, _, _ in plan_cases.CASES}


def test_plan_cases_shows_a_dry_run_beside_the_formula():
    """Its own figures at the dry run's parameter count; a missing, failed or older run says so."""
    name = "LLaMA-70B on 64 GPUs"
    flags = next(f for n, f, _ in plan_cases.CASES if n == name)
    args = argparse.Namespace(**{**plan_input.FLAG_DEFAULTS, **flags})
    strategy, run, _ = plan_cases.CASE_DRY_RUNS[name]
    rec = {"status": "ok", "params": 68_976_648_192, "state_mb": 16_445.6,
           "peak_mem_mb": 197_439.0, "comm_mb": 345_973.97,
           "dry_run": {"beyond_state_mb": 185_104.6}}
    line = plan_cases.dry_run_line(args, strategy, run, rec)
    assert "state 17.2 GB (planner 17.2)" in line
    assert "sent 362.78 GB a step (planner 362.78)" in line
    assert "its peak beyond the state 194.1 GB" in line
    assert "none yet (`make dryrun`)" in plan_cases.dry_run_line(args, strategy, run, None)
    assert "older than this planner" in plan_cases.dry_run_line(args, strategy, run,
                                                            {**rec, "dry_run": {}})
    recorded = {**rec, "folder": "03_fsdp", "script": "optimized_fsdp_tp", "size": "llama2-70b",
                "variant": "--tp 8", "world_size": 64}
    assert plan_cases.dry_run_record(run, [recorded]) == recorded
    assert plan_cases.dry_run_record(run, [{**recorded, "world_size": 8}]) is None


def test_a_dry_runs_rmsnorm_keeps_its_input_alone_and_trains_as_torchs():
    """The stand-in for CUDA's fused RMSNorm: torch's gradients, and of the input only the
    input kept for backward (the CPU composite keeps fp32 copies of it and of its output)."""
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    torch.nn.init.uniform_(norm.weight)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    norm = norm.to(torch.bfloat16)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = common._rms_norm_as_on_cuda(x, norm.normalized_shape, norm.weight, norm.eps)
    assert [t.dtype for t in kept] == [torch.bfloat16, torch.bfloat16]  # the input, the weight
    out.float().square().sum().backward()
    stood_in = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    norm(x).float().square().sum().backward()
    assert torch.equal(stood_in[0], x.grad) and torch.equal(stood_in[1], norm.weight.grad)


def test_the_planners_loss_bytes_are_what_the_loss_keeps(tmp_path):
    """LOSS_BYTES_PER_LOGIT measured again: the peak of bf16 logits' cross-entropy, forward and
    backward, over the logits it starts from, plainly and under loss_parallel over 8 ranks."""
    script = tmp_path / "loss.py"
    script.write_text(LOSS_PEAK)
    proc = subprocess.run([sys.executable, str(script)], cwd=common.ROOT, capture_output=True,
                          text=True, timeout=120, env=cpu_env(PYTHONPATH=str(common.ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == plan_input.LOSS_BYTES_PER_LOGIT


LOSS_PEAK = """
import json, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
mesh = init_device_mesh("cpu", (8,))
tokens, vocab, cpu = 4096, 32000, torch.device("cpu")

def peak_a_logit(split):
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.randn(tokens, vocab, dtype=torch.bfloat16)
        targets = torch.zeros(tokens, dtype=torch.long)
        if split:
            logits = distribute_tensor(logits, mesh, [Shard(1)])
        logits.requires_grad_()
        local = logits.to_local() if split else logits
        tracker = MemTracker()
        tracker.track_external(local)
        with tracker, (loss_parallel() if split else torch.enable_grad()):
            before = tracker.get_tracker_snapshot()[cpu]["Total"]
            F.cross_entropy(logits.float(), targets).backward()
        return round((tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before)
                     / local.numel())

print(json.dumps({"plain": peak_a_logit(False), "loss_parallel": peak_a_logit(True)}))
"""
