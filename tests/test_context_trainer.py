"""07_context's "Use it in your trainer": the README's lines, as written, train a tiny HuggingFace
`LlamaForCausalLM` context-parallel in 2 gloo processes (cp = 2, the ring through transformers'
`AttentionInterface`), ranks seeded apart, and every step's loss, averaged over the cp ranks, is
one process's training the same model on the whole sequences: `sdpa` with an untied head,
`eager` with a tied one, and once with the block's Ulysses line in place of the ring's. One
spawn for all of it: each process imports `transformers` once."""

import copy
import functools
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import readme_python_block, run_then_leave

FOLDER = common.ROOT / "07_context"
README = FOLDER / "README.md"
RING_LINE = "attention, zigzag = RingAttention(group), True"
ULYSSES_LINE = "attention, zigzag = UlyssesAttention(group), False"
STEPS = 4
TOLERANCE = 1e-5  # relative: the ring regroups the softmax sums by block (fp32 rounding)


def whole_sequence_losses(model: torch.nn.Module, batches) -> list[float]:
    """The reference: one process, the whole sequences, AdamW, the README loops' loss."""
    import hf_models

    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = hf_models.hf_loss(model, inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def cp_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the cp ranks: the whole batch's mean (equal token counts)."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def train_with_the_readme_lines(rank: int, world: int, port: int, out_file: str) -> None:
    import hf_models  # here: `transformers` costs every process that imports it seconds

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sys.path.insert(0, str(FOLDER))  # where the trainer copied the recipes
    from optimized_context_ulysses import UlyssesAttention

    block = readme_python_block(README)
    # the same whole sequences on both cp ranks: one global batch of 4, seq_len 32
    batches = hf_models.token_batches(STEPS, 0, 1, per_rank=4)
    found = {}
    runs = [("ring", attn, tied, block) for attn, tied in hf_models.VARIANTS]
    runs.append(("ulysses", "sdpa", False, block.replace(RING_LINE, ULYSSES_LINE)))
    for kind, attn, tied, lines in runs:
        torch.manual_seed(rank)  # ranks seeded apart: DDP starts them from rank 0's weights
        model = hf_models.tiny_llama(attn, tied)
        reference = whole_sequence_losses(model, batches) if rank == 0 else None
        namespace = {"model": model, "batches": batches, "UlyssesAttention": UlyssesAttention}
        exec(lines, namespace)
        found[kind, attn, tied] = {"readme": cp_mean(namespace["losses"]),
                                   "reference": reference}
    if rank == 0:
        torch.save(found, out_file)
    dist.destroy_process_group()


def test_the_readme_lines_train_hf_models_context_parallel_like_one_process(tmp_path):
    block = readme_python_block(README)
    assert RING_LINE in block and "# Ulysses: UlyssesAttention(group), False" in block
    assert "position_ids=positions" in block and "labels=" not in block
    out = tmp_path / "found.pt"
    mp.spawn(functools.partial(run_then_leave, train_with_the_readme_lines),
             args=(2, common.free_port(), str(out)), nprocs=2)
    found = torch.load(out)
    assert set(found) == {("ring", "sdpa", False), ("ring", "eager", True),
                          ("ulysses", "sdpa", False)}
    for run, losses in found.items():
        readme, reference = losses["readme"], losses["reference"]
        assert max(abs(a - b) / b for a, b in zip(readme, reference, strict=True)) <= TOLERANCE, \
            (run, readme, reference)
        assert readme[-1] < readme[0], run
