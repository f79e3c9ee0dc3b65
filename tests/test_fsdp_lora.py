"""LoRA (03_fsdp/optimized_fsdp_lora.py), in this process: the adapters' count against the
formula, the adapted model starting as the base, `merge()` keeping the logits, the patterns on
the project's models and on HuggingFace models (fused projections too), HuggingFace peft's
LoRA training to the same losses; and the fine-tuning task and checkpoint loading in common."""

import copy

import pytest
import torch
import torch.nn as nn

import common
from helpers import load_recipe

lora = load_recipe(common.ROOT / "03_fsdp" / "optimized_fsdp_lora.py")
TINY = common.SIZES["tiny"]


def decoder(name: str, size: common.Size = TINY) -> nn.Module:
    torch.manual_seed(0)
    return common.GPT(size, size.seq_len) if name == "gpt" else common.Llama(size)


def batch(size: common.Size = TINY, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = common.global_token_batch(size, size.seq_len, 4, step, seed=0)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name, mlp, adapted", [
    ("gpt", False, ["attn.qkv", "attn.proj"]),
    ("gpt", True, ["attn.qkv", "attn.proj", "fc", "fc_proj"]),
    ("llama", False, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj"]),
    ("llama", True, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
])
def test_lora_adapts_the_named_linears_and_trains_r_times_their_fan_in_plus_out(name, mlp,
                                                                                adapted):
    model = decoder(name)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = lora.apply_lora(model, lora.ATTENTION + (lora.MLP if mlp else ()), rank=4)
    assert [n.split(".", 2 if name == "gpt" else 3)[-1] for n in names[:len(adapted)]] == adapted
    assert len(names) == TINY.n_layers * len(adapted)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(
        4 * (linears[n].in_features + linears[n].out_features) for n in names)
    assert all(isinstance(model.get_submodule(n), lora.LoRALinear) for n in names)
    assert all(model.get_submodule(n).base is linears[n] for n in names)  # the same weights


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_at_small_rank_8_the_adapters_are_under_2_per_cent_and_send_under_5(name, world):
    """Under 2% of the weights train, and their gradients' reduce-scatter is under 5% of full
    fine-tuning's; a rank's state is 4 bytes a frozen weight and 16 an adapter's, over N."""
    model = decoder(name, common.SIZES["small"])
    total = sum(p.numel() for p in model.parameters())
    lora.apply_lora(model, rank=8)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable / total < 0.02
    predicted = lora.theory(model, common.transformer_blocks(model), world, 8, 4)
    full = predicted["full_finetune_reduce_scatter_mb"]
    assert predicted["comm_by_kind_mb"]["reduce_scatter"] < 0.05 * full
    assert predicted["trainable_params"] == trainable
    assert predicted["state_mb"] == pytest.approx((4 * total + 16 * trainable) / world / 2**20,
                                                  rel=0.01)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_adapted_model_starts_as_the_base_and_merge_keeps_its_logits(name):
    model = decoder(name)
    inputs, targets = batch()
    base_loss = model(inputs, targets).item()
    lora.apply_lora(model, lora.ATTENTION + lora.MLP)
    assert model(inputs, targets).item() == base_loss  # B is zero: the base model's outputs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        model(*batch(step=step)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        adapted = model(inputs, targets).item()
        head = common.output_head(model)
        logits = {}
        hook = head.register_forward_hook(lambda m, i, out: logits.setdefault(len(logits), out))
        model(inputs, targets)
        lora.merge_lora(model)
        model(inputs, targets)
        hook.remove()
    assert adapted != base_loss  # the adapters trained
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, projections", [
    ("llama", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
    ("fused", ["self_attn.o_proj", "self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"]),
])
def test_lora_adapts_a_hf_models_projections_fused_or_not_refuses_patterns_matching_none(
        family, projections):
    """Phi-3's fused q/k/v and gate/up projections are Linears like any: adapted whole. The
    patterns are alternatives; a list of them matching no Linear is refused in one line."""
    hf_models = pytest.importorskip("hf_models")
    model = hf_models.tiny_model(family)
    names = lora.apply_lora(model, lora.ATTENTION + lora.MLP)
    assert names[:len(projections)] == [f"model.layers.0.{n}" for n in projections]
    assert len(names) == len(projections) * TINY.n_layers
    assert not model.lm_head.weight.requires_grad and not model.model.norm.weight.requires_grad
    type_name = type(model).__name__
    with pytest.raises(ValueError, match=rf"^no Linear of {type_name} is named like \['\*wq'\]"):
        lora.apply_lora(hf_models.tiny_model(family), ["*wq"])


def test_hand_written_lora_trains_a_hf_models_as_peft_does():
    """HuggingFace peft's LoraConfig on the same projections, rank and alpha, its A set to ours:
    the same losses, step for step, to float rounding."""
    peft = pytest.importorskip("peft")
    hf_models = pytest.importorskip("hf_models")
    torch.manual_seed(0)
    base = hf_models.tiny_llama()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    names = lora.apply_lora(ours, rank=4, alpha=8)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name in names:
            theirs.base_model.model.get_submodule(name).lora_A["default"].weight.copy_(
                ours.get_submodule(name).lora_a)
    batches = hf_models.token_batches(4, 0, 1)
    losses = {}
    for key, model in [("ours", ours), ("peft", theirs)]:
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert sum(p.numel() for p in trainable) == 4 * sum(
            base.get_submodule(n).in_features + base.get_submodule(n).out_features
            for n in names)
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        losses[key] = []
        for inputs, targets in batches:
            loss = hf_models.hf_loss(model, inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert losses["ours"][-1] < losses["ours"][0]
    assert losses["ours"] == pytest.approx(losses["peft"], rel=1e-5)


def test_the_fine_tuning_task_moves_a_64th_of_the_pattern_and_stays_a_permutation():
    vocab = common.SIZES["small"].vocab_size
    first, second = common.token_pattern(vocab, 0), common.token_pattern(vocab, 0, True)
    assert sorted(second.tolist()) == list(range(vocab))
    moved = (first != second).sum().item()
    assert 0.5 * vocab / 64 < moved <= vocab / 64
    assert torch.equal(second, common.token_pattern(vocab, 0, True))  # drawn from the seed
    a = common.global_token_batch(TINY, 16, 4, 0, seed=0)
    b = common.global_token_batch(TINY, 16, 4, 0, seed=0, finetune=True)
    assert not torch.equal(a, b)  # other sequences, from seed + 1


def test_init_from_refuses_a_folder_without_a_checkpoint_in_one_line(tmp_path):
    with pytest.raises(common.SetupError, match="no checkpoint there: run 03_fsdp/"):
        common.init_weights_from(decoder("gpt"), str(tmp_path))
    assert common.init_weights_from(decoder("gpt"), "scratch") is None
