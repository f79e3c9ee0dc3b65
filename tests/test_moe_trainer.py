"""08_moe's "Use it in your trainer": the README's lines, as written, train two MoE models
expert-parallel in 2 gloo processes (ep = 2): a tiny HuggingFace `Qwen3MoeForCausalLM` (its
experts fused in 3-D parameters, each rank's copied into modules of their own) and the
project's MoE Llama (its experts a list, sliced), with the block's own line for the project's
loss. Each rank holds half of every layer's experts and sends rows to the other, and every
step's loss is plain DDP's training the whole model on the same batches. One spawn for both:
each process imports `transformers` once."""

import copy
import functools
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import common
from helpers import readme_python_block, run_then_leave

FOLDER = common.ROOT / "08_moe"
README = FOLDER / "README.md"
HF_LOSS_LINES = ("    logits = model(input_ids=inputs).logits  # the project's Llama: loss = "
                 "model(inputs, targets)\n"
                 "    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())\n")
LLAMA_LOSS_LINE = "    loss = model(inputs, targets)\n"
STEPS = 4
GRAD_TOLERANCE = 1e-5  # the last step's, on weights 3 steps equal to fp32 rounding
WORLD = 2
TOLERANCE = 1e-5  # relative: an expert's rows batched with the other rank's, sums regrouped


def tiny_qwen3_moe() -> torch.nn.Module:
    """A Qwen3MoeForCausalLM from a config in code (no download), 4 experts top-2 in each of 2
    layers, initialised from the current torch seed."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=common.SIZES["tiny"].vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=64, attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(config)


def hf_loss(model, inputs, targets):
    return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1).float(),
                           targets.flatten())


def llama_loss(model, inputs, targets):
    return model(inputs, targets)


def ddp_losses(model: torch.nn.Module, batches, loss_of) -> tuple[list[float], torch.nn.Module]:
    """The reference: PyTorch's DDP on a copy of the whole model (every expert on every rank),
    AdamW, the README loop's loss; this rank's loss each step, and the model trained, holding
    its last step's gradients."""
    ddp = DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ddp, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ddp.module


def expert_grad(experts: torch.nn.Module, e: int) -> torch.Tensor:
    """Expert e's gradient, flat, in its parameters' order: a module of the list, or its slices
    of HuggingFace's fused `gate_up_proj` and `down_proj` (the README's `Expert`'s order)."""
    if isinstance(experts, torch.nn.ModuleList):
        return torch.cat([p.grad.flatten() for p in experts[e].parameters()])
    return torch.cat([experts.gate_up_proj.grad[e].flatten(), experts.down_proj.grad[e].flatten()])


def grad_difference(trained: torch.nn.Module, reference: torch.nn.Module, rank: int) -> float:
    """The largest difference between the last step's gradient of each of this rank's experts
    and the reference's of the same expert, relative to the largest of the latter."""
    worst = 0.0
    for ours, whole in zip(trained.model.layers, reference.model.layers, strict=True):
        for j, expert in enumerate(ours.mlp.experts):
            want = expert_grad(whole.mlp.experts, rank * len(ours.mlp.experts) + j)
            got = torch.cat([p.grad.flatten() for p in expert.parameters()])
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def expert_numel(model: torch.nn.Module) -> int:
    """Values of the model's routed experts: every `mlp.experts` module's parameters."""
    return sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())


def train_with_the_readme_lines(rank: int, world: int, port: int, out_file: str) -> None:
    import hf_models  # here: `transformers` costs every process that imports it seconds

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sys.path.insert(0, str(FOLDER))  # where the trainer copied the recipe
    from optimized_moe_ep import ExpertParallel

    block = readme_python_block(README)
    batches = hf_models.token_batches(STEPS, rank, world)  # this rank's own sequences
    runs = {"qwen3_moe": (tiny_qwen3_moe, hf_loss, block),
            "llama": (lambda: common.Llama(common.SIZES["tiny"], moe_balance="none"),
                      llama_loss, block.replace(HF_LOSS_LINES, LLAMA_LOSS_LINE))}
    found = {}
    for name, (build, loss_of, lines) in runs.items():
        torch.manual_seed(0)  # the same weights on every rank, as one checkpoint loaded
        model = build()
        reference, trained = ddp_losses(model, batches, loss_of)
        total, experts = sum(p.numel() for p in model.parameters()), expert_numel(model)
        namespace = {"model": model, "batches": batches}
        exec(lines, namespace)
        layers = [layer.mlp.experts for layer in namespace["model"].module.model.layers]
        found[name] = {
            "readme": namespace["losses"], "reference": reference,
            "grad_difference": grad_difference(namespace["model"].module, trained, rank),
            "swapped": [isinstance(e, ExpertParallel) for e in layers],
            "local_experts": [len(e) for e in layers],
            "sent_rows": [e.exchanged[0] for e in layers],
            "params": sum(p.numel() for p in namespace["model"].parameters()),
            "expert_params": sum(p.numel() for p in namespace["expert_params"]),
            "whole": (total, experts)}
    gathered = [None] * world
    dist.all_gather_object(gathered, found)
    if rank == 0:
        torch.save(gathered, out_file)
    dist.destroy_process_group()


def test_the_readme_lines_train_moe_models_expert_parallel_like_ddp(tmp_path):
    block = readme_python_block(README)
    assert HF_LOSS_LINES in block and "reduce_expert_grads(" in block
    assert "labels=" not in block
    out = tmp_path / "found.pt"
    mp.spawn(functools.partial(run_then_leave, train_with_the_readme_lines),
             args=(WORLD, common.free_port(), str(out)),
             nprocs=WORLD)
    by_rank = torch.load(out)
    for rank, found in enumerate(by_rank):
        assert set(found) == {"qwen3_moe", "llama"}
        for name, run in found.items():
            readme, reference = run["readme"], run["reference"]
            assert max(abs(a - b) / b for a, b in zip(readme, reference, strict=True)) \
                <= TOLERANCE, (name, rank, readme, reference)
            assert readme[-1] < readme[0], (name, rank, readme)
            # AdamW would not see a gradient off by a constant factor: the last step's expert
            # gradients are DDP's mean, reduce_expert_grads' division included
            assert run["grad_difference"] <= GRAD_TOLERANCE, (name, rank, run["grad_difference"])
            # 4 experts a layer, 2 a rank: the rank's parameters are the dense part and half
            # the experts, and its experts sent rows to the other rank's
            total, experts = run["whole"]
            assert run["swapped"] == [True, True] and run["local_experts"] == [2, 2], run
            assert run["expert_params"] * WORLD == experts, (name, run["expert_params"], experts)
            assert run["params"] == total - experts + experts // WORLD, (name, run["params"])
            assert all(rows > 0 for rows in run["sent_rows"]), (name, run["sent_rows"])
    for name in ("qwen3_moe", "llama"):  # the ranks trained different data
        assert by_rank[0][name]["readme"] != by_rank[1][name]["readme"], name
