"""Real HuggingFace models for the "Use it in your trainer" tests, built from configs in code (no
download) in the shapes of `common.SIZES["tiny"]`: three dense families a user brings (Llama;
Qwen2, whose q/k/v projections carry biases and whose rotary base is 1e6; Mistral, with its
sliding window), two models with a feature a recipe may not implement (Phi-3's fused
projections; a Llama whose rotary is scaled), and the loss a trainer of one's own computes from
their output. `transformers` is a test dependency only: no recipe imports it.

The README loops compute the loss from the model's output, as a HuggingFace trainer must (the
targets are already shifted, so never `labels=`, which HuggingFace shifts again):

    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
"""

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import common

SIZE = common.SIZES["tiny"]
SEQ_LEN = 32


class Case(NamedTuple):
    """One model a README block is run on: its family, attention implementation and head."""
    family: str
    attn: str
    tied: bool

    def __str__(self) -> str:
        return f"{self.family}-{self.attn}-{'tied' if self.tied else 'untied'}"


# Every README block runs on each: the fused kernel (causal by itself) and the written-out
# attention (causal only through the mask HuggingFace builds), tied and untied heads; Qwen2
# ties its head as its small checkpoints do.
CASES = [Case("llama", "sdpa", False), Case("llama", "eager", True),
         Case("qwen2", "sdpa", True), Case("qwen2", "eager", True),
         Case("mistral", "sdpa", False), Case("mistral", "eager", False)]
FAMILIES = ("llama", "qwen2", "mistral")
# Two models with a feature some recipes do not implement: each recipe trains them like DDP or
# refuses them in one line naming the feature, never ignores it.
UNSUPPORTED = {"fused": "qkv_proj", "rope scaling": "rope_type"}

_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM), "fused": (Phi3Config, Phi3ForCausalLM),
            "rope scaling": (LlamaConfig, LlamaForCausalLM)}
_FAMILY_CONFIG = {
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "mistral": {"head_dim": SIZE.d_model // SIZE.n_heads},  # Mistral's default is 128
    "rope scaling": {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 1e4}},
    "fused": {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0},  # Phi-3's are past
    # this vocabulary
}


def tiny_model(family: str = "llama", attn_implementation: str = "sdpa", tied: bool = False,
               dtype: torch.dtype = torch.float32, size: common.Size = SIZE,
               **config: object) -> PreTrainedModel:
    """A `family` CausalLM of `size`'s shapes, initialised from the current torch seed;
    `config` overrides its config's keys. Qwen2's q/k/v biases are drawn non-zero (HuggingFace
    initialises them to zero, which would hide a recipe that drops them)."""
    config_class, model_class = _CLASSES[family]
    settings = dict(
        vocab_size=size.vocab_size, hidden_size=size.d_model,
        intermediate_size=common.llama_ffn_dim(size.d_model),
        num_hidden_layers=size.n_layers, num_attention_heads=size.n_heads,
        num_key_value_heads=size.n_kv_heads, max_position_embeddings=size.long_seq_len,
        tie_word_embeddings=tied, attn_implementation=attn_implementation)
    settings.update(_FAMILY_CONFIG.get(family, {}))
    settings.update(config)
    model = model_class(config_class(**settings)).to(dtype)
    if family == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                               layer.self_attn.v_proj):
                    linear.bias.normal_(std=0.5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def readme_models(bf16: bool = True) -> dict[str, dict]:
    """The models a whole-model README block runs on, by name: tiny_model's arguments. Each of
    CASES (three families, sdpa and eager), each family's sdpa case in bf16 (unless `bf16` is
    False: an optimizer whose state and update are fp32's), and the UNSUPPORTED models: a
    recipe that wraps the whole model leaves its forward to it, so both must train like DDP."""
    models = {str(case): dict(family=case.family, attn_implementation=case.attn, tied=case.tied)
              for case in CASES}
    models.update({f"{case} bf16": {**models[str(case)], "dtype": torch.bfloat16}
                   for case in CASES if bf16 and case.attn == "sdpa"})
    models.update({name: dict(family=name) for name in UNSUPPORTED})
    return models


def tiny_llama(attn_implementation: str = "sdpa", tied: bool = False,
               dtype: torch.dtype = torch.float32, size: common.Size = SIZE) -> LlamaForCausalLM:
    """A LlamaForCausalLM of `size`'s shapes, initialised from the current torch seed."""
    return tiny_model("llama", attn_implementation, tied, dtype, size)


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


def seeded_apart(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Whether the ranks of `group` hold different weights (float64 sums per parameter): a
    recipe matching DDP, which starts every rank from the first's, proves nothing otherwise."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    first = sums.clone()
    dist.broadcast(first, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    differ = torch.tensor(float(not torch.equal(sums, first)))
    dist.all_reduce(differ, group=group)
    return differ.item() > 0
