"""07_context's "Use it in your trainer": the README's lines, as written, train tiny HuggingFace
models context-parallel in 2 gloo processes (cp = 2, through transformers' `AttentionInterface`),
with `ContextAttention` the ring's class and then Ulysses': every hf_models.CASES case (Llama,
Qwen2, Mistral; `sdpa` and `eager`) and the two models with a feature some recipes do not
implement (fused projections, scaled rotary: the model's own layers and rotary run, so both
train), ranks seeded apart, every step's loss, averaged over the cp ranks, PyTorch's DDP's on the
same model and global batch. What the attentions do not compute is refused in one line: a
sliding window shorter than the sequence, attention dropout, a padding mask given to the model,
heads Ulysses cannot split. One spawn for all of it: each process imports `transformers` once."""

import copy
import functools
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import readme_python_block, run_then_leave

FOLDER = common.ROOT / "07_context"
README = FOLDER / "README.md"
STEPS = 4
TOLERANCE = 1e-5  # relative: the ring regroups the softmax sums by block (fp32 rounding)
# relative, bf16 weights against DDP in bf16: the ring's blocks round to bf16 apart
BF16_TOLERANCE = 1e-2
KINDS = ("ring", "ulysses")


def cp_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the cp ranks: the whole batch's mean (equal token counts)."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def refusal(call) -> str:
    """The message of the ValueError `call()` raises (every rank raises it, before sending)."""
    try:
        call()
    except ValueError as err:
        return str(err)
    return "accepted"


def train_with_the_readme_lines(rank: int, world: int, port: int, out_file: str) -> None:
    """The README's lines on each model with each class, beside DDP; then what they refuse."""
    import hf_models  # here: `transformers` costs every process that imports it seconds

    torch.set_num_threads(1)  # 2 processes on 2 cores: more threads only fight
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sys.path.insert(0, str(FOLDER))  # where the trainer copied the recipes
    from optimized_context_ring import RingAttention
    from optimized_context_ulysses import UlyssesAttention

    classes = {"ring": RingAttention, "ulysses": UlyssesAttention}
    block = readme_python_block(README)
    # the same whole sequences on both cp ranks: one global batch of 4, seq_len 32; DDP's
    # reference splits that batch's sequences over the ranks instead
    whole = hf_models.token_batches(STEPS, 0, 1, per_rank=4)
    split = hf_models.token_batches(STEPS, rank, world)
    models = {str(case): dict(family=case.family, attn_implementation=case.attn, tied=case.tied)
              for case in hf_models.CASES}
    models.update({name: dict(family=name) for name in hf_models.UNSUPPORTED})
    models.update({f"{family} bf16": dict(family=family, dtype=torch.bfloat16)
                   for family in hf_models.FAMILIES})  # bf16 weights, kept bf16

    def readme_lines(kind: str, model: torch.nn.Module) -> dict:
        namespace = {"model": model, "batches": whole, "ContextAttention": classes[kind]}
        exec(block, namespace)
        return namespace

    found = {}
    for name, model_args in models.items():
        torch.manual_seed(rank)  # ranks seeded apart: DDP starts them from rank 0's weights
        model = hf_models.tiny_model(**model_args)
        ddp = hf_models.ddp_losses(model, split)  # on a copy
        seeded_apart = hf_models.seeded_apart(model)
        for kind in KINDS:
            lines = readme_lines(kind, copy.deepcopy(model))  # `model` stays untrained
            found[kind, name] = {"readme": cp_mean(lines["losses"]), "ddp": ddp,
                                 "seeded_apart": seeded_apart,
                                 "dtypes": {p.dtype for p in lines["model"].parameters()}}
    refused = {}
    for kind in KINDS:  # each refused at the first forward, on every rank alike
        mistral = dict(family="mistral", sliding_window=16)  # under the 32-token sequences
        for what, model_args in [("window", mistral), ("dropout", dict(attention_dropout=0.1))]:
            model = hf_models.tiny_model(**model_args)
            refused[kind, what] = refusal(functools.partial(readme_lines, kind, model))
        lines = readme_lines(kind, hf_models.tiny_model())
        trained, inputs = lines["model"].module, whole[0][0]
        positions = common.sequence_positions(inputs.shape[1], rank, world,
                                              lines["attention"].zigzag)
        padded = torch.ones_like(inputs, dtype=torch.bool)
        padded[0, -3:] = False  # in one rank's shard only: every rank must refuse, or hang
        for what, mask in [("ones", torch.ones_like(padded)), ("padding", padded)]:
            refused[kind, what] = refusal(functools.partial(
                trained, input_ids=inputs[:, positions], position_ids=positions[None],
                attention_mask=mask[:, positions]))
    three_heads = torch.zeros(1, 3, 8, 16)
    refused["ulysses", "heads"] = refusal(
        lambda: UlyssesAttention(dist.group.WORLD)(three_heads, three_heads, three_heads))
    if rank == 0:
        torch.save({"models": list(models), "found": found, "refused": refused}, out_file)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_trainer") / "found.pt"
    mp.spawn(functools.partial(run_then_leave, train_with_the_readme_lines),
             args=(2, common.free_port(), str(out)), nprocs=2)
    return torch.load(out)


def test_the_readme_lines_take_the_attention_from_the_trainer_and_no_model_family():
    block = readme_python_block(README)
    assert "attention = ContextAttention(group)" in block and "attention.zigzag" in block
    assert "position_ids=positions" in block and "labels=" not in block
    assert not any(name in block for name in ("Llama", "Qwen", "Mistral", "import optimized"))


@pytest.mark.parametrize("kind", KINDS)
def test_the_readme_lines_train_every_model_context_parallel_like_ddp(trained, kind):
    runs = {name: run for (k, name), run in trained["found"].items() if k == kind}
    assert set(runs) == set(trained["models"])  # hf_models.CASES, then its UNSUPPORTED
    assert {name.split("-")[0].removesuffix(" bf16") for name in runs} == {
        "llama", "qwen2", "mistral", "fused", "rope scaling"}
    for name, run in runs.items():
        readme, ddp, bf16 = run["readme"], run["ddp"], name.endswith("bf16")
        assert run["seeded_apart"], name
        assert run["dtypes"] == {torch.bfloat16 if bf16 else torch.float32}, name
        differences = [abs(a - b) / b for a, b in zip(readme, ddp, strict=True)]
        assert max(differences) <= (BF16_TOLERANCE if bf16 else TOLERANCE), (name, readme, ddp)
        assert readme[-1] < readme[0], name


@pytest.mark.parametrize("kind", KINDS)
def test_what_the_attention_does_not_compute_is_refused_in_one_line(trained, kind):
    refused = trained["refused"]
    name = {"ring": "RingAttention", "ulysses": "UlyssesAttention"}[kind]
    assert refused[kind, "window"] == (
        f"{name}: sliding_window 16 is shorter than the 32-token sequence: this attention sees "
        "every earlier token; set sliding_window=None in the config")
    assert refused[kind, "dropout"] == (
        f"{name}: dropout 0.1 (attention_dropout): set attention_dropout=0 in the config")
    assert refused[kind, "ones"] == "accepted"  # a mask of ones masks nothing
    assert refused[kind, "padding"].startswith("attention_mask with padding")
    for message in refused.values():
        assert "\n" not in message


def test_ulysses_refuses_heads_its_group_cannot_split_in_one_line(trained):
    assert trained["refused"]["ulysses", "heads"] == (
        "UlyssesAttention: cp 2 does not divide the 3 attention heads and 3 KV heads: each rank "
        "takes whole heads, use a cp group that divides both")
