"""08_moe's "Use it in your trainer": the README's lines, as written, train HuggingFace MoE models
expert-parallel in 2 gloo processes (ep = 2), ranks seeded apart: tiny Qwen3-MoE, Qwen2-MoE (a
shared expert with its own gate; its first layer dense) and Mixtral, their experts fused in 3-D
parameters, `sdpa` and `eager` in fp32 and `sdpa` in bf16. Each rank holds half of every MoE
layer's experts and sends rows to the other, and every step's loss is plain DDP's training the
whole model on the same batches. The dense families and the two models with a feature some
recipes do not implement (hf_models) have no experts: refused in one line. One spawn for all:
each process imports `transformers` once."""

import copy
import functools
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import common
from helpers import readme_python_block, run_then_leave

FOLDER = common.ROOT / "08_moe"
README = FOLDER / "README.md"
STEPS = 4
WORLD = 2
EXPERTS = 4  # a MoE layer's, top-2: 2 a rank
TOLERANCE = 1e-5  # relative, fp32: an expert's rows batched with the other rank's, sums regrouped
GRAD_TOLERANCE = 1e-5  # the last step's, on weights 3 steps equal to fp32 rounding
# bf16, relative, the losses only: DDP sums each rank's bf16 gradient, expert parallelism an
# expert's rows of both ranks in one matmul; a few steps of bf16 rounding (2^-8 = 3.9e-3) then
# part the weights, and the gradients of single values with them. Measured: at most 3e-5
BF16_TOLERANCE = 1e-3
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
# (family, attention, dtype): every family in both attentions in fp32, and in bf16 once
MOE_CASES = [*[(family, attn, torch.float32) for family in MOE_FAMILIES
               for attn in ("sdpa", "eager")],
             *[(family, "sdpa", torch.bfloat16) for family in MOE_FAMILIES]]
REFUSED = "no block has an mlp.experts: expert parallelism needs a MoE model"


def tiny_moe(family: str, attn_implementation: str = "sdpa",
             dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A HuggingFace MoE CausalLM from a config in code (no download): 4 experts top-2 of width
    16 in each MoE layer, hidden 32, 4 heads, 2 KV heads; initialised from the current torch
    seed. Qwen2-MoE: 3 layers, the first dense (`mlp_only_layers`), and a shared expert."""
    import transformers

    shape = dict(vocab_size=common.SIZES["tiny"].vocab_size, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2, max_position_embeddings=64,
                 attn_implementation=attn_implementation)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**shape, head_dim=8, num_experts=EXPERTS,
                                             moe_intermediate_size=16, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **{**shape, "num_hidden_layers": 3}, num_experts=EXPERTS, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, intermediate_size=64, mlp_only_layers=[0])
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**shape, num_local_experts=EXPERTS,
                                            intermediate_size=16)
        model = transformers.MixtralForCausalLM(config)
    return model.to(dtype)


def ddp_losses(model: torch.nn.Module, batches) -> tuple[list[float], torch.nn.Module]:
    """The reference: PyTorch's DDP on a copy of the whole model (every expert on every rank,
    rank 0's weights), AdamW, the README loop's loss; this rank's loss each step, and the model
    trained, holding its last step's gradients."""
    import hf_models

    ddp = DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = hf_models.hf_loss(ddp, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ddp.module


def grad_difference(trained: torch.nn.Module, reference: torch.nn.Module, rank: int) -> float:
    """The largest difference between the last step's gradient of this rank's experts (each
    parameter of its fused slice) and the reference's of the same experts, relative to the
    largest of the latter."""
    worst = 0.0
    for ours, whole in zip(trained.model.layers, reference.model.layers, strict=True):
        if not hasattr(whole.mlp, "experts"):
            continue
        for name, p in ours.mlp.experts.local.named_parameters():
            want = whole.mlp.experts.get_parameter(name).grad[rank * len(p):(rank + 1) * len(p)]
            worst = max(worst, ((p.grad - want).abs().max() / want.abs().max()).item())
    return worst


def differs_across_ranks(model: torch.nn.Module) -> bool:
    """Whether the ranks' models differ: each parameter's float64 sum, gathered."""
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in model.parameters()])
    every = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sums)
    return not all(torch.equal(every[0], other) for other in every[1:])


def train_with_the_readme_lines(rank: int, world: int, port: int, out_file: str) -> None:
    import hf_models  # here: `transformers` costs every process that imports it seconds

    torch.set_num_threads(1)  # 2 processes on 2 cores: more threads only fight
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sys.path.insert(0, str(FOLDER))  # where the trainer copied the recipe
    from optimized_moe_ep import ExpertParallel

    block = readme_python_block(README)
    batches = hf_models.token_batches(STEPS, rank, world)  # this rank's own sequences
    found = {}
    for family, attn, dtype in MOE_CASES:
        torch.manual_seed(rank)  # seeded apart: the block starts every rank from rank 0's
        model = tiny_moe(family, attn, dtype)
        seeded_apart = differs_across_ranks(model)
        reference, trained = ddp_losses(model, batches)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for layer in model.model.layers if hasattr(layer.mlp, "experts")
                      for p in layer.mlp.experts.parameters())
        namespace = {"model": model, "batches": batches}
        exec(block, namespace)
        moes = [layer.mlp.experts for layer in namespace["model"].module.model.layers
                if hasattr(layer.mlp, "experts")]
        found[(family, attn, str(dtype))] = {
            "seeded_apart": seeded_apart, "readme": namespace["losses"], "reference": reference,
            "grad_difference": grad_difference(namespace["model"].module, trained, rank),
            "swapped": [isinstance(e, ExpertParallel) for e in moes],
            "local_experts": [e.local.gate_up_proj.shape[0] for e in moes],
            "sent_rows": [e.exchanged[0] for e in moes],
            "params": sum(p.numel() for p in namespace["model"].parameters()),
            "expert_params": sum(p.numel() for p in namespace["expert_params"]),
            "dtypes": {str(p.dtype) for p in namespace["model"].parameters()},
            "whole": (total, experts)}
    # the dense families and the models with a feature other recipes refuse: no experts
    for family in (*hf_models.FAMILIES, *hf_models.UNSUPPORTED):
        torch.manual_seed(rank)
        try:
            exec(block, {"model": hf_models.tiny_model(family), "batches": batches})
            found[family] = "accepted"
        except ValueError as err:
            found[family] = str(err)
    gathered = [None] * world
    dist.all_gather_object(gathered, found)
    if rank == 0:
        torch.save(gathered, out_file)
    dist.destroy_process_group()


def test_the_readme_lines_train_moe_models_expert_parallel_like_ddp(tmp_path):
    block = readme_python_block(README)
    assert "reduce_expert_grads(" in block and "shard_experts(" in block
    assert "labels=" not in block
    out = tmp_path / "found.pt"
    mp.spawn(functools.partial(run_then_leave, train_with_the_readme_lines),
             args=(WORLD, common.free_port(), str(out)),
             nprocs=WORLD)
    by_rank = torch.load(out)
    for rank, found in enumerate(by_rank):
        for (family, attn, dtype), run in ((case, found[case]) for case in
                                           ((f, a, str(d)) for f, a, d in MOE_CASES)):
            name = (family, attn, dtype, rank)
            fp32 = dtype == str(torch.float32)
            readme, reference = run["readme"], run["reference"]
            assert run["seeded_apart"], name  # the ranks built different weights
            assert max(abs(a - b) / b for a, b in zip(readme, reference, strict=True)) \
                <= (TOLERANCE if fp32 else BF16_TOLERANCE), (name, readme, reference)
            assert readme[-1] < readme[0], (name, readme)
            # AdamW would not see a gradient off by a constant factor: the last step's expert
            # gradients are DDP's mean, reduce_expert_grads' division included
            assert not fp32 or run["grad_difference"] <= GRAD_TOLERANCE, (name, run)
            assert run["dtypes"] == {dtype}, (name, run["dtypes"])  # bf16 weights kept
            # 4 experts in each of 2 MoE layers (Qwen2-MoE's third is dense), 2 a rank: the
            # rank's parameters are the dense part and half the experts, and its experts sent
            # rows to the other rank's
            total, experts = run["whole"]
            assert run["swapped"] == [True, True] and run["local_experts"] == [2, 2], (name, run)
            assert run["expert_params"] * WORLD == experts, (name, run["expert_params"], experts)
            assert run["params"] == total - experts + experts // WORLD, (name, run["params"])
            assert all(rows > 0 for rows in run["sent_rows"]), (name, run["sent_rows"])
        for family in ("llama", "qwen2", "mistral", "fused", "rope scaling"):
            assert found[family] == REFUSED, (family, rank, found[family])
    for case in MOE_CASES:  # the ranks trained different data
        key = (case[0], case[1], str(case[2]))
        assert by_rank[0][key]["readme"] != by_rank[1][key]["readme"], key
