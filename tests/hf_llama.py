"""A real HuggingFace model for the "Use it in your trainer" tests: a tiny `LlamaForCausalLM`
built from a config in code (no download), in the shapes of `common.SIZES["tiny"]`, and the
loss a trainer of one's own computes from its output. `transformers` is a test dependency only:
no recipe imports it.

The README loops compute the loss from the model's output, as a HuggingFace trainer must (the
targets are already shifted, so never `labels=`, which HuggingFace shifts again):

    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import common

SIZE = common.SIZES["tiny"]
SEQ_LEN = 32
# The two ways a user's model comes that differ for a recipe: the fused kernel (causal by
# itself) with an untied head, and the written-out attention (causal only through the mask
# HuggingFace builds) with the head tied to the embedding.
VARIANTS = [("sdpa", False), ("eager", True)]


def tiny_llama(attn_implementation: str = "sdpa", tied: bool = False,
               dtype: torch.dtype = torch.float32, size: common.Size = SIZE) -> LlamaForCausalLM:
    """A LlamaForCausalLM of `size`'s shapes, initialised from the current torch seed."""
    config = LlamaConfig(
        vocab_size=size.vocab_size, hidden_size=size.d_model,
        intermediate_size=common.llama_ffn_dim(size.d_model),
        num_hidden_layers=size.n_layers, num_attention_heads=size.n_heads,
        num_key_value_heads=size.n_kv_heads, max_position_embeddings=size.long_seq_len,
        tie_word_embeddings=tied, attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config).to(dtype)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def hf_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The README loops' loss: cross-entropy of the model's logits against shifted targets."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_batches(steps: int, rank: int, world: int, per_rank: int = 2,
                  seq_len: int = SEQ_LEN) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) share of each step's global batch of `per_rank * world`
    sequences: the same global batches at any world size."""
    batches = []
    for step in range(steps):
        tokens = common.global_token_batch(SIZE, seq_len, per_rank * world, step, seed=0)
        tokens = common.rank_slice(tokens, rank, world)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def ddp_losses(model: torch.nn.Module, batches, lr: float = 1e-3,
               group: dist.ProcessGroup | None = None) -> list[float]:
    """The reference: PyTorch's DDP over `group` on a copy of `model` (it starts every rank
    from the group's first rank's weights), AdamW, the README loops' loss; each step's loss on
    this rank, averaged over the group."""
    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = hf_loss(ddp, inputs, targets)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / dist.get_world_size(group))
    return losses
