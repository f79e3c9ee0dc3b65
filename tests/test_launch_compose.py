"""Composed parallelism at `tiny`: 03_fsdp/optimized_fsdp_tp.py on a (dp 2, tp 2) mesh of 4 CPU
processes and 05_pipeline/optimized_pipeline_3d.py on (pp 2, dp 2, tp 2) and (pp 2, dp 4, tp 1)
of 8 and (pp 2, dp 1, tp 2) of 4, each against DDP on the same global batch, GPT and Llama,
clipping the gradient; a DCP checkpoint saved at (dp 2, tp 2) resumed at (dp 1, tp 4) and as
plain FSDP over 4 ranks with DDP's losses. The READMEs' 2-D and 3-D lines, as they stand, on
HuggingFace models (tests/hf_models.py: Llama, Qwen2, Mistral, sdpa and eager; row-wise biases,
a short sliding window, a scaled rotary; bf16 weights), ranks seeded apart, against PyTorch's
DDP, and refusing Phi-3's fused projections; parallelize refusing ranks that hold different
weights and plans that do not fit the model; each degree a mesh script takes refused where the
model cannot split; the default tp; the 3-D baseline skipping with the 3-D run.

The runs of a world are forked from one Python (`python -m report smoke`, as `make smoke` runs them;
the README lines' ranks from this one): torch imported once, not once a rank, which on 2 cores
is most of a launch's time."""

import dataclasses
import json
import multiprocessing
import os
from argparse import Namespace

import hf_models
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import common
from helpers import (
    as_rank,
    assert_bad_input_is_one_line,
    assert_skipped_with_why,
    assert_within_its_tolerance,
    forked_runs,
    load_recipe,
    readme_python_block,
)
from report import results_table

FSDP_TP = common.ROOT / "03_fsdp" / "optimized_fsdp_tp.py"
PIPELINE_3D = common.ROOT / "05_pipeline" / "optimized_pipeline_3d.py"
BASELINE_3D = common.ROOT / "05_pipeline" / "baseline_pipeline_3d.py"
CLIP = "--clip-grad-norm 0.5"
SAVED_AT = 3  # the 2-D run saves after step 3 of its 5 (3 timed after 2 warm-up)
# split_problem's refusal of a plan that does not fit: its advice, and Phi-3's layer against
# decoder_layer_plan (it fuses q, k, v and gate, up)
ADVICE = ("pass a plan that names each of its modules with weights, a fused projection split "
          "into its parts first")
FUSED_REFUSED = (
    f"the layer plan does not fit Phi3DecoderLayer: it lacks self_attn.q_proj, self_attn.k_proj, "
    f"self_attn.v_proj, mlp.gate_proj, mlp.up_proj, which the plan names; it holds weights in "
    f"self_attn.qkv_proj, mlp.gate_up_proj, which the plan does not name: {ADVICE}")


def tiny_runs(runs: list[str], nproc: int, out) -> list[dict]:
    """Each run (a script and its flags) at `nproc` ranks, tiny, 3 timed steps after 2 warm-up
    unless its flags say otherwise; their records, in order, every one ok."""
    records = forked_runs(runs, nproc, out, ["--size", "tiny", "--steps", "3", "--warmup", "2",
                                             "--timeout", "120"])
    assert [r["status"] for r in records] == ["ok"] * len(runs), records
    return records


@pytest.fixture(scope="module")
def on_4_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("compose4")
    saved = f"--checkpoint-dir {out / 'checkpoints'}"
    # the script's own flags in its parser's order, as its record's variant names them
    runs = [f"03_fsdp/baseline_fsdp.py {CLIP}",
            f"03_fsdp/optimized_fsdp_tp.py {CLIP} {saved} --checkpoint-every {SAVED_AT}",
            f"03_fsdp/optimized_fsdp_tp.py --tp 4 {CLIP} {saved} --resume --steps 4 --warmup 1",
            f"03_fsdp/optimized_fsdp_tp.py --tp 1 {CLIP} {saved} --resume --steps 4 --warmup 1",
            f"03_fsdp/baseline_fsdp.py --model llama {CLIP}",
            f"03_fsdp/optimized_fsdp_tp.py --model llama {CLIP}",
            # pp 2 x tp 2 leaves dp 1; a dp rank's batch, pp x tp x 4, is the 4 x 4 of DDP's
            f"05_pipeline/optimized_pipeline_3d.py --model llama {CLIP}"]
    return dict(zip(["ddp", "2d", "tp4", "fsdp", "ddp llama", "2d llama", "3d llama"],
                    tiny_runs(runs, 4, out), strict=True))


@pytest.fixture(scope="module")
def on_8_ranks(tmp_path_factory):
    # two sequences a rank: the global batch of the 4-rank DDP runs (4 x 4), so the 3-D Llama
    # is held to the 4-rank Llama DDP run as well
    flags = f"{CLIP} --batch-size 2"
    runs = [f"05_pipeline/baseline_pipeline_3d.py {flags}",
            f"05_pipeline/optimized_pipeline_3d.py {flags}",
            f"05_pipeline/optimized_pipeline_3d.py --tp 1 {flags}"]
    return dict(zip(["ddp", "3d", "3d tp1"],
                    tiny_runs(runs, 8, tmp_path_factory.mktemp("compose8")), strict=True))


def assert_measured_is_theory(rec: dict) -> None:
    """State within 5% of its theory, and every mesh dim's bytes equal to its own."""
    assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.05)
    assert rec["comm_mb_by_dim"].keys() == rec["mesh"].keys()
    for dim, predicted in rec["theory"]["comm_mb_by_dim"].items():
        assert rec["comm_mb_by_dim"][dim] == pytest.approx(predicted, rel=0.01, abs=2e-3), dim


def assert_trains_like_ddp(losses: list[float], ddp: list[float]) -> None:
    """The same losses as DDP's on the same global batch, to 1e-5 relative (fp32)."""
    assert len(losses) == len(ddp)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ddp, strict=True)), \
        (losses, ddp)


@pytest.mark.parametrize("model", ["", " llama"])
def test_fsdp_x_tp_trains_like_ddp_with_the_state_and_bytes_of_its_theory(on_4_ranks, model):
    rec, ddp = on_4_ranks[f"2d{model}"], on_4_ranks[f"ddp{model}"]
    assert rec["mesh"] == {"dp": 2, "tp": 2} and rec["clip_grad_norm"] == 0.5
    assert_within_its_tolerance(rec, ddp)
    assert_trains_like_ddp(rec["losses"], ddp["losses"])
    # the logits stay split by vocabulary: the tp bytes hold no gather of them (theory has none)
    assert_measured_is_theory(rec)
    assert rec["comm_mb_by_dim"]["dp"] > 0 and rec["comm_mb_by_dim"]["tp"] > 0
    # each rank holds about a quarter of DDP's state: what TP replicates (the norms) aside
    assert rec["state_mb"] == pytest.approx(ddp["state_mb"] / 4, rel=0.05)


@pytest.mark.parametrize("layout, mesh", [("tp4", {"dp": 1, "tp": 4}),
                                          ("fsdp", {"dp": 4, "tp": 1})])
def test_a_checkpoint_saved_at_dp2_tp2_resumes_at_another_layout(on_4_ranks, layout, mesh):
    """DCP reshards on load: the (dp 2, tp 2) run's shards, read at (dp 1, tp 4) or as plain
    FSDP over 4 ranks, continue with the losses of the run that was never stopped, and of DDP:
    the meshes (1, 4) and (4, 1) train like DDP."""
    saver, resumed = on_4_ranks["2d"], on_4_ranks[layout]
    assert resumed["mesh"] == mesh and resumed["resumed_from"] == SAVED_AT
    uninterrupted = saver["losses"][SAVED_AT:]
    assert len(resumed["losses"]) == len(uninterrupted) == 2
    diff = results_table.max_loss_diff(resumed["losses"], uninterrupted)
    assert diff <= resumed["loss_tolerance"]
    assert_trains_like_ddp(resumed["losses"], on_4_ranks["ddp"]["losses"][SAVED_AT:])
    assert_measured_is_theory(resumed)


@pytest.mark.parametrize("run, mesh, ddp", [
    ("3d", {"pp": 2, "dp": 2, "tp": 2}, "ddp"),
    ("3d tp1", {"pp": 2, "dp": 4, "tp": 1}, "ddp"),
    ("3d llama", {"pp": 2, "dp": 1, "tp": 2}, "ddp llama")])
def test_pipeline_x_fsdp_x_tp_trains_like_ddp(on_8_ranks, on_4_ranks, run, mesh, ddp):
    """Any mesh whose product is the world, dims of 1 included: against DDP on the same global
    batch (8 ranks x 2 sequences, or 4 x 4)."""
    rec = {**on_4_ranks, **on_8_ranks}[run]
    base = on_8_ranks["ddp"] if rec["world_size"] == 8 else on_4_ranks[ddp]
    assert rec["mesh"] == mesh and rec["microbatches"] == 4
    # a default mesh without dp (4 ranks) says so in its record; one with dp, or a --tp given, not
    assert (rec["note"] is not None) == (run == "3d llama"), rec["note"]
    assert_within_its_tolerance(rec, base)
    assert_trains_like_ddp(rec["losses"], base["losses"])
    assert_measured_is_theory(rec)
    assert all(rec["comm_mb_by_dim"][dim] > 0 for dim, n in mesh.items() if n > 1)
    assert rec["theory"]["bubble_uniform"] == pytest.approx(1 / 5)
    # against DDP's 16 bytes a parameter on every rank: about 1 / (pp x dp x tp) of them, the
    # busiest stage's tables aside
    assert rec["state_mb"] < 4 / 3 * base["state_mb"] / (mesh["pp"] * mesh["dp"] * mesh["tp"])


def test_the_ddp_baseline_of_the_3d_run_is_ddp(on_8_ranks, on_4_ranks):
    """05's baseline_pipeline_3d at 8 ranks x 2 sequences trains as 03's baseline_fsdp at 4 x 4:
    the same global batch."""
    assert results_table.max_loss_diff(on_8_ranks["ddp"]["losses"],
                                       on_4_ranks["ddp"]["losses"]) <= 1e-5


@pytest.mark.parametrize("script, flags, world, hint", [
    # --tp, and dp = world / tp: each width a tp rank takes an equal share of
    (FSDP_TP, ["--tp", "3"], "4", "--tp 3 does not divide the 4 processes"),
    (FSDP_TP, ["--tp", "8"], "8", "--tp 8 does not divide the 4 heads"),
    (FSDP_TP, ["--tp", "4", "--model", "llama"], "4", "--tp 4 does not divide the 2 KV heads"),
    (FSDP_TP, ["--size", "medium", "--tp", "3"], "3", "--tp 3 does not divide the 32768 "
                                                      "vocabulary"),
    (FSDP_TP, ["--tp", "4", "--seq-len", "30"], "4", "--tp 4 does not divide the 30 sequence "
                                                     "positions"),
    # --pp (a decoder layer a stage: the 2 of tiny, not 4 with the embedding and the head),
    # --tp and dp = world / (pp x tp), --microbatches
    (PIPELINE_3D, ["--model", "llama", "--pp", "4", "--tp", "2"], "8",
     "--pp 4 is more stages than the 2 decoder layers of --size tiny: use --pp 2 or fewer"),
    (PIPELINE_3D, ["--pp", "2", "--tp", "3"], "16", "= 6 does not divide the 16 processes"),
    (PIPELINE_3D, ["--tp", "4", "--model", "llama"], "8", "--tp 4 does not divide the 2 KV "
                                                          "heads"),
    (PIPELINE_3D, ["--microbatches", "3"], "8", "do not split into --microbatches 3"),
    (PIPELINE_3D, ["--microbatches", "1"], "8", "--microbatches 1 is fewer than the --pp 2 "
                                                "stages, which 1F1B needs"),
])
def test_a_mesh_that_cannot_be_built_is_refused_in_one_line(script, flags, world, hint,
                                                            tmp_path):
    assert_bad_input_is_one_line(script, ["--size", "tiny", *flags], hint, tmp_path,
                                 WORLD_SIZE=world)


def test_a_tp_that_splits_no_equal_share_of_the_mlp_is_one_line(monkeypatch):
    """No --size has one (a tp dividing the heads divides the GPT's 4 d and the Llama's width,
    a multiple of 64): a size of 3 KV heads and a width of 256 has."""
    fsdp_tp = load_recipe(FSDP_TP)
    monkeypatch.setitem(common.SIZES, "tiny", dataclasses.replace(
        common.SIZES["tiny"], d_model=96, n_heads=6, n_kv_heads=3))
    assert fsdp_tp.tp_problem(Namespace(size="tiny", model="llama", seq_len=30), 3, 6) == (
        "--tp 3 does not divide the 256 MLP units of --size tiny: use a --tp that divides 256")


def test_the_default_tp_divides_the_heads_the_kv_heads_and_a_node():
    """On an 8-GPU host the Llama's 2 KV heads allow tp 2 (a tp of 4 would refuse tiny); the
    GPT's 4 heads allow 4, with dp 2. The 3-D mesh on 4 GPUs: pp 2 x dp 1 x tp 2; on 2 none."""
    fsdp_tp, tiny = load_recipe(FSDP_TP), {"size": "tiny", "seq_len": 32}
    llama, gpt = Namespace(model="llama", **tiny), Namespace(model="gpt", **tiny)
    assert fsdp_tp.default_tp(llama, world=8, node=8) == 2
    assert fsdp_tp.default_tp(gpt, world=8, node=8) == 4
    assert fsdp_tp.default_tp(gpt, world=4, node=4) == 2  # dp 2 before tp 4 at dp 1
    assert fsdp_tp.default_tp(gpt, world=16, node=8, stages=2) == 4
    assert fsdp_tp.default_tp(gpt, world=4, node=4, stages=2) == 2
    assert fsdp_tp.default_tp(gpt, world=2, node=2, stages=2) is None


@pytest.mark.parametrize("script", [BASELINE_3D, PIPELINE_3D])
def test_the_3d_baseline_skips_where_the_3d_run_skips(script, tmp_path, monkeypatch):
    """On 2 processes (a 1-2 GPU host's `make pipeline`) no pp 2 x tp 2 mesh fits: the 3-D run
    skips, and its DDP baseline with it, for the same reason."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_skipped_with_why(script, ["--size", "tiny"], "a 3-D mesh of pp 2 x dp x tp >= 2",
                            tmp_path)


def tiny_of(model_class: type, config_class: type) -> torch.nn.Module:
    """A model of a family tests/hf_models.py does not build, in its shapes."""
    size = hf_models.SIZE
    return model_class(config_class(
        vocab_size=size.vocab_size, hidden_size=size.d_model, num_hidden_layers=size.n_layers,
        intermediate_size=common.llama_ffn_dim(size.d_model), num_attention_heads=size.n_heads,
        num_key_value_heads=size.n_kv_heads, head_dim=size.d_model // size.n_heads))


def test_a_plan_the_model_does_not_fit_is_one_line_naming_the_modules():
    """split_problem: a plan entry that matches no module, which parallelize_module would skip
    with a warning, and a module with weights that no entry names, which TP would leave whole
    on every rank, on every block (Phi-3's fused projections, Qwen3's norms inside attention,
    a last layer unlike the others, the GPT's own names) and at the ends; a tp that splits no
    whole heads. A stage that holds no block (the head alone) has none to check."""
    fsdp_tp = load_recipe(FSDP_TP)
    llama, plan = hf_models.tiny_model("llama"), fsdp_tp.decoder_layer_plan()
    layers, ends = list(llama.model.layers), fsdp_tp.ends_plan(["model.embed_tokens"],
                                                                "model.norm", "lm_head")
    assert fsdp_tp.split_problem(llama, layers, plan, ends, 2) is None
    assert fsdp_tp.split_problem(llama, layers, plan, ends, 4) == (
        "tp 4 does not split the 2 heads of self_attn.k_proj: pass a mesh whose tp dim "
        "divides 2")
    assert fsdp_tp.split_problem(llama, layers, plan, fsdp_tp.ends_plan(
        ["model.embed_tokens"], "model.norm", "output"), 2) == (
        f"the ends plan does not fit LlamaForCausalLM: it lacks output, which the plan names; "
        f"it holds weights in lm_head, which the plan does not name: {ADVICE}")
    fused = hf_models.tiny_model("fused")
    assert fsdp_tp.split_problem(fused, list(fused.model.layers), plan, ends, 2) == FUSED_REFUSED
    qwen3 = tiny_of(Qwen3ForCausalLM, Qwen3Config)
    assert fsdp_tp.split_problem(qwen3, list(qwen3.model.layers), plan, ends, 2) == (
        f"the layer plan does not fit Qwen3DecoderLayer: it holds weights in self_attn.q_norm, "
        f"self_attn.k_norm, which the plan does not name: {ADVICE}")
    # a block left out of `blocks` holds weights the ends plan does not name
    assert fsdp_tp.split_problem(llama, layers[:1], plan, ends, 2).startswith(
        "the ends plan does not fit LlamaForCausalLM: it holds weights in "
        "model.layers.1.self_attn.q_proj, ")
    llama.model.layers[-1] = fused.model.layers[-1]  # every block is checked, not the first only
    assert fsdp_tp.split_problem(llama, list(llama.model.layers), plan, ends, 2).startswith(
        "the layer plan does not fit Phi3DecoderLayer: ")
    gpt = common.GPT(common.SIZES["tiny"], 32)
    gpt_ends = fsdp_tp.ends_plan(["tok_emb", "pos_emb"], "ln_f", "head")
    assert fsdp_tp.split_problem(gpt, list(gpt.blocks), plan, gpt_ends, 2).startswith(
        "the layer plan does not fit Block: it lacks input_layernorm, self_attn.q_proj, ")
    head_alone = torch.nn.Sequential(llama.model.norm, llama.lm_head)
    assert fsdp_tp.split_problem(head_alone, [], plan, fsdp_tp.ends_plan([], "0", "1"), 2) is None


# --- the READMEs' lines on HuggingFace models, ranks forked from this process -------------------
README_STEPS = 3
# bf16 weights against DDP in bf16, absolute per step: the recipes allow 5e-2; 1e-3 keeps room
# and still fails a wrong start or mask
BF16_TOLERANCE = 1e-3
# The models both README blocks train like DDP, by name: every hf_models.CASES case; a Llama
# whose row-wise projections (o_proj, down_proj) carry biases too (replicated over tp: added
# once, not once a tp rank); a Mistral whose sliding window, 8, is shorter than the 32-token
# sequences (the model's own mask builder's); and a Llama with a scaled rotary (its
# rotary_emb's). bf16: one case a family.
TRAINED = [str(case) for case in hf_models.CASES] + ["row-wise biases", "window 8",
                                                      "rope scaling"]
BF16 = [hf_models.CASES[0], hf_models.CASES[2], hf_models.CASES[5]]


def readme_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model a run of the README blocks is named for, drawn from the current seed."""
    case = next((c for c in hf_models.CASES if str(c) == name), None)
    if case:
        return hf_models.tiny_model(*case, dtype=dtype)
    if name == "row-wise biases":
        model = hf_models.tiny_model("llama", dtype=dtype, attention_bias=True, mlp_bias=True)
        with torch.no_grad():  # HuggingFace's are zero: no test of where they are added
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(std=0.1)
        return model
    if name == "window 8":
        return hf_models.tiny_model("mistral", dtype=dtype, sliding_window=8)
    if name == "gemma2":  # its forward scales the embeddings and softcaps the logits
        return tiny_of(Gemma2ForCausalLM, Gemma2Config).to(dtype)
    return hf_models.tiny_model(name, dtype=dtype)  # "rope scaling", "fused"


def _readme_ranks(rank: int, world: int, port: int, out: str) -> None:
    """One rank: the 2-D lines (tp 2) and, on 4 ranks, the 3-D lines (pp 2 x dp 1 x tp 2), run
    as they stand, each on every TRAINED model (on 6 ranks, the 2-D lines on Qwen2 alone) and
    the BF16 ones, drawn from this rank's own seed, beside PyTorch's DDP on the same model and
    global batch (2 sequences a rank); on 4 ranks, both on Phi-3's fused projections and the
    3-D lines on Gemma 2, and first `parallelize` on a model the lines' broadcast has not made
    rank 0's. What each gave goes to out/rank<r>.json."""
    as_rank(rank, world, port)
    common.setup(timeout_s=120)
    two_d = readme_python_block(common.ROOT / "03_fsdp" / "README.md",
                                "### Use it in your trainer, on a 2-D mesh")
    three_d = readme_python_block(common.ROOT / "05_pipeline" / "README.md",
                                  "### Use it in your trainer, on a 3-D mesh")
    units_2d, units_3d = vars(load_recipe(FSDP_TP)), vars(load_recipe(PIPELINE_3D))
    dp_rank, dp = rank // 2, world // 2  # the 2-D lines' tp 2, the inner dim
    done = {}

    def drawn_on_this_rank(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        torch.manual_seed(rank)  # the lines start every rank from rank 0's weights
        return readme_model(name, dtype)

    def world_mean(losses: list[float]) -> list[float]:
        summed = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(summed)
        return (summed / world).tolist()

    def dtypes(module: torch.nn.Module) -> list[str]:
        return sorted({str(p.dtype) for p in module.parameters()})

    def run(lines: str, units: dict, model: torch.nn.Module, batches) -> dict:
        """The lines, beside the script's `units`, on the trainer's `model` and `batches`; what
        they left, or the one line they refused the model with."""
        given = {**units, "model": model, "batches": batches}
        try:
            exec(lines, given)
        except ValueError as refused:
            return {"refused": str(refused)}
        return given

    two_d_batches = hf_models.token_batches(README_STEPS, dp_rank, dp, per_rank=2 * world // dp)
    three_d_batches = hf_models.token_batches(README_STEPS, 0, 1, per_rank=2 * world)
    if world == 4:  # the 2-D units without the lines' broadcast, then Phi-3 through both
        model = drawn_on_this_rank(TRAINED[0])
        try:
            units_2d["parallelize"](
                model, units_2d["build_mesh"]("cpu", world, 2), list(model.model.layers),
                units_2d["decoder_layer_plan"](),
                units_2d["ends_plan"](["model.embed_tokens"], "model.norm", "lm_head"))
            done["not broadcast"] = None
        except ValueError as error:
            done["not broadcast"] = str(error)
        done["2d fused"] = run(two_d, units_2d, drawn_on_this_rank("fused"), two_d_batches)
        done["3d fused"] = run(three_d, units_3d, drawn_on_this_rank("fused"), three_d_batches)
        done["3d gemma2"] = run(three_d, units_3d, drawn_on_this_rank("gemma2"), three_d_batches)
    runs = [(name, name, torch.float32) for name in TRAINED] + \
        [(f"bf16 {case}", str(case), torch.bfloat16) for case in BF16] if world == 4 else \
        [(str(hf_models.CASES[2]),) * 2 + (torch.float32,)]
    for key, name, dtype in runs:
        model = drawn_on_this_rank(name, dtype)
        apart = hf_models.seeded_apart(model)  # else matching DDP would prove nothing
        ddp = hf_models.ddp_losses(model, hf_models.token_batches(README_STEPS, rank, world))
        lines = run(two_d, units_2d, model, two_d_batches)
        with torch.no_grad():  # no rank holds the whole vocabulary's logits
            logits = model(input_ids=two_d_batches[0][0]).logits
        done[f"2d {key}"] = {
            "losses": world_mean(lines["losses"]), "ddp": ddp, "dtypes": dtypes(model),
            "seeded apart": apart,
            "logits": [type(logits).__name__, [str(p) for p in logits.placements],
                       list(logits.to_local().shape)]}
        if world == 4:
            lines = run(three_d, units_3d, drawn_on_this_rank(name, dtype), three_d_batches)
            done[f"3d {key}"] = {"losses": lines["losses"], "ddp": ddp,
                                 "dtypes": dtypes(lines["stage"])}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(done, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def readme_ranks(tmp_path_factory):
    """The README lines' ranks: 4 (dp 2 x tp 2, and pp 2 x dp 1 x tp 2), then 6 (dp 3 x tp 2);
    each rank's results by world."""
    out, fork, found = tmp_path_factory.mktemp("readmes"), multiprocessing.get_context("fork"), {}
    for world in (4, 6):
        port = common.free_port()
        ranks = [fork.Process(target=_readme_ranks, args=(r, world, port, str(out / str(world))))
                 for r in range(world)]
        (out / str(world)).mkdir()
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=600)
        assert [p.exitcode for p in ranks] == [0] * world
        found[world] = [json.loads((out / str(world) / f"rank{r}.json").read_text())
                        for r in range(world)]
    return found


@pytest.mark.parametrize("world, name", [*((4, name) for name in TRAINED),
                                         (6, str(hf_models.CASES[2]))])
def test_the_readmes_2d_lines_train_each_model_seeded_apart_like_ddp(readme_ranks, world, name):
    """The lines as they stand on (dp 2, tp 2), and Qwen2 on (dp 3, tp 2): DDP's losses to
    1e-5; the head's logits a Shard(-1) DTensor, each rank its vocabulary's half."""
    for rank in readme_ranks[world]:
        run = rank[f"2d {name}"]
        assert run["seeded apart"]
        assert_trains_like_ddp(run["losses"], run["ddp"])
        # a dp rank's 4 sequences of 32 tokens, half of the 128 words' logits
        assert run["logits"] == ["DTensor", [str(Shard(2))], [4, 32, 64]]


@pytest.mark.parametrize("name", TRAINED)
def test_the_readmes_3d_lines_train_each_model_seeded_apart_like_ddp(readme_ranks, name):
    """The lines as they stand on pp 2 x dp 1 x tp 2: the last stage's losses, DDP's to 1e-5."""
    assert all(rank[f"2d {name}"]["seeded apart"] for rank in readme_ranks[4])  # same draws
    last = [rank[f"3d {name}"] for rank in readme_ranks[4][2:]]  # pp rank 1: ranks 2 and 3
    assert all(not rank[f"3d {name}"]["losses"] for rank in readme_ranks[4][:2])
    for run in last:
        assert_trains_like_ddp(run["losses"], run["ddp"])


@pytest.mark.parametrize("lines", ["2d", "3d"])
@pytest.mark.parametrize("case", BF16, ids=str)
def test_the_readmes_lines_keep_bf16_weights_bf16_and_train_like_ddp_in_bf16(readme_ranks,
                                                                              lines, case):
    """A bf16 model of each family (ranks seeded apart) through the 2-D lines and the 3-D
    lines: every rank's weights still bf16 after the steps, and each step's loss within
    BF16_TOLERANCE of PyTorch's DDP on the same bf16 model and global batch."""
    for rank in readme_ranks[4]:
        assert rank[f"2d bf16 {case}"]["seeded apart"]  # the 3-D lines' model: the same draw
        assert rank[f"{lines} bf16 {case}"]["dtypes"] == ["torch.bfloat16"]
    for rank in readme_ranks[4] if lines == "2d" else readme_ranks[4][2:]:  # 3-D: the last stage
        run = rank[f"{lines} bf16 {case}"]
        assert len(run["losses"]) == len(run["ddp"]) == README_STEPS
        assert results_table.max_loss_diff(run["losses"], run["ddp"]) <= BF16_TOLERANCE, run


@pytest.mark.parametrize("lines", ["2d", "3d"])
def test_the_readmes_lines_refuse_fused_projections_in_one_line_naming_them(readme_ranks,
                                                                           lines):
    """Phi-3's qkv_proj and gate_up_proj: a column-wise split of either would give a rank q's
    (or the gate's) rows alone, and parallelize_module would skip the plan's q_proj, ...
    with a warning; every rank refuses in one line naming the fused modules, before a step."""
    for rank in readme_ranks[4]:
        refused = rank[f"{lines} fused"]["refused"]
        assert refused == FUSED_REFUSED and hf_models.UNSUPPORTED["fused"] in refused


def test_the_readmes_3d_lines_refuse_a_forward_that_does_more_than_its_layers(readme_ranks):
    """Gemma 2's forward scales the embedding's output and softcaps the logits, which a stage
    calling the layers in order would skip: the check before the cut refuses it on every rank,
    in one line naming the model's class, before anything is split."""
    for rank in readme_ranks[4]:
        assert rank["3d gemma2"]["refused"] == (
            "Gemma2ForCausalLM's forward does more than its layers in order (embedding, decoder "
            "layers, norm, head): do the rest in DecoderStage")


def test_parallelize_refuses_ranks_that_hold_different_weights_in_one_line(readme_ranks):
    """Ranks seeded apart, `same_weights_on_every_rank` not called: each would keep its slice of
    its own initialisation, a patchwork; `parallelize` refuses on every rank, naming the call."""
    for rank in readme_ranks[4]:
        assert rank["not broadcast"] == (
            "the mesh's ranks hold different weights: call same_weights_on_every_rank(model, "
            "mesh) before parallelize")
