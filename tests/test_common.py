"""Unit tests for common.py: timing statistics, sharding, memory counting, workload, report."""

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
import helpers
from helpers import report_rows, run_then_leave
from report import cli, results_table, runs


def tiny_args(*extra: str) -> argparse.Namespace:
    args = common.parser(None).parse_args(["--size", "tiny", "--steps", "3", "--warmup", "1",
                                           *extra])
    args.dtype = "fp32"
    return args


def cpu_topology(rank: int = 0, world: int = 1) -> common.Topology:
    return common.Topology(rank, rank, world, world, 1, "gloo", torch.device("cpu"))


# --- timing -----------------------------------------------------------------------------------
def test_summarize_times_median_nearest_rank_p90_and_quartiles():
    median, p90, (q1, q3) = common.summarize_times([i / 1000 for i in range(10, 0, -1)])  # 1..10 ms
    assert median == pytest.approx(5.5)
    assert p90 == pytest.approx(9.0)
    assert (q1, q3) == pytest.approx((3.25, 7.75))  # 3 + 0.25 x (4 - 3), 7 + 0.75 x (8 - 7)


def test_summarize_times_single_step_and_empty():
    median, p90, iqr = common.summarize_times([0.25])
    assert (median, p90, *iqr) == pytest.approx((250.0, 250.0, 250.0, 250.0))
    with pytest.raises(ValueError):
        common.summarize_times([])


# --- sharding and data ------------------------------------------------------------------------
def test_rank_slices_partition_the_global_batch():
    batch = common.global_token_batch(common.SIZES["tiny"], 16, 8, step=3, seed=0)
    slices = [common.rank_slice(batch, r, 4) for r in range(4)]
    assert all(s.shape == (2, 17) for s in slices)
    assert torch.equal(torch.cat(slices), batch)


def test_n_ranks_see_exactly_the_samples_of_one_rank_with_n_times_the_batch():
    one_rank = common.workload(tiny_args("--batch-size", "6"), cpu_topology())[1]
    three_ranks = [common.workload(tiny_args("--batch-size", "2"), cpu_topology(r, 3))[1]
                   for r in range(3)]
    for step, (inputs, targets) in enumerate(one_rank):
        assert torch.equal(inputs, torch.cat([rank[step][0] for rank in three_ranks]))
        assert torch.equal(targets, torch.cat([rank[step][1] for rank in three_ranks]))


def test_steps_differ_and_seed_changes_the_data():
    size = common.SIZES["tiny"]
    a = common.global_token_batch(size, 16, 4, step=0, seed=0)
    assert not torch.equal(a, common.global_token_batch(size, 16, 4, step=1, seed=0))
    assert not torch.equal(a, common.global_token_batch(size, 16, 4, step=0, seed=1))
    assert torch.equal(a, common.global_token_batch(size, 16, 4, step=0, seed=0))


def test_tokens_follow_the_permutation_about_ninety_percent_of_the_time():
    size = common.SIZES["small"]
    tokens = common.global_token_batch(size, 128, 32, step=0, seed=0)
    table = torch.randperm(size.vocab_size, generator=torch.Generator().manual_seed(0))
    follows = (tokens[:, 1:] == table[tokens[:, :-1]]).float().mean().item()
    assert 0.87 < follows < 0.93


def test_the_loss_falls_on_the_synthetic_data():
    args = tiny_args("--steps", "30", "--batch-size", "8", "--lr", "3e-3")
    model, batches = common.workload(args, cpu_topology())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for inputs, targets in batches:
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(128.0)).item(), abs=0.2)
    assert losses[-1] < losses[0] - 1.5


def test_resnet_workload_returns_a_loss_for_images():
    args = tiny_args("--model", "resnet")
    model, batches = common.workload(args, cpu_topology())
    images, labels = batches[0]
    assert images.shape == (4, 3, 16, 16) and labels.shape == (4,)
    assert model(images, labels).ndim == 0


def test_the_gpts_pipeline_layers_are_its_own_modules_in_forward_order():
    torch.manual_seed(0)
    model = common.GPT(common.SIZES["tiny"], 16)
    names_before = [name for name, _ in model.named_parameters()]
    layers = model.pipeline_layers()
    assert len(layers) == len(model.blocks) + 2 and layers[1] is model.blocks[0]
    assert layers[0].tok_emb.weight is layers[-1].head.weight is model.tok_emb.weight  # tied
    assert [name for name, _ in model.named_parameters()] == names_before  # nothing registered
    tokens = torch.randint(common.SIZES["tiny"].vocab_size, (2, 17))
    x = tokens[:, :-1]
    for layer in layers[:-1]:
        x = layer(x)
    assert torch.equal(layers[-1](x, tokens[:, 1:]), model(tokens[:, :-1], tokens[:, 1:]))


def test_the_llama_has_huggingfaces_names_grouped_query_attention_and_an_untied_head():
    size = common.SIZES["tiny"]
    model = common.Llama(size)
    names = {name for name, _ in model.named_parameters()}
    head_dim = size.d_model // size.n_heads
    layer = model.model.layers[0]
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"} <= names
    assert not any(name.endswith("bias") for name in names)
    assert size.n_kv_heads < size.n_heads  # grouped: fewer KV heads than query heads
    assert layer.self_attn.k_proj.weight.shape == (size.n_kv_heads * head_dim, size.d_model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_the_llamas_grouped_attention_equals_attention_over_repeated_kv_heads():
    torch.manual_seed(0)
    attn = common.LlamaAttention(32, n_heads=4, n_kv_heads=2, attention=common.causal_sdpa)
    x = torch.randn(2, 5, 32)
    full = common.LlamaAttention(32, n_heads=4, n_kv_heads=4, attention=common.causal_sdpa)
    with torch.no_grad():
        full.q_proj.weight.copy_(attn.q_proj.weight)
        full.o_proj.weight.copy_(attn.o_proj.weight)
        for mine, theirs in [(full.k_proj, attn.k_proj), (full.v_proj, attn.v_proj)]:
            # KV head h serves query heads 2h and 2h + 1
            mine.weight.copy_(theirs.weight.view(2, 1, 8, 32).expand(2, 2, 8, 32).reshape(32, 32))
    assert torch.allclose(attn(x), full(x), atol=1e-6)


def test_sdpa_groups_the_kv_heads_itself_and_other_attentions_get_them_repeated(monkeypatch):
    """The default attention is handed the KV heads as they are (SDPA's grouped-query path: no
    copy of K and V); an attention written for equal head counts, each KV head repeated."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    torch.manual_seed(0)
    attn = common.LlamaAttention(32, n_heads=4, n_kv_heads=2, attention=common.causal_sdpa)
    x = torch.randn(2, 5, 32, requires_grad=True)
    grouped = attn(x)
    grouped.sum().backward()
    assert seen == [(4, 2, 2)]
    attn.attention = lambda q, k, v: sdpa(q, k, v, is_causal=True)  # needs equal head counts
    seen.clear()
    repeated = attn(x)
    assert torch.allclose(grouped, repeated, atol=1e-6)
    attn.attention = lambda q, k, v: recording(q, k, v, is_causal=True)
    attn(x)
    assert seen == [(4, 4, 4)]


def test_the_rotary_table_is_built_once_for_every_layer_and_step(monkeypatch):
    """Two calls a layer, two layers, two steps: one table, built from the shape. It needs no
    grad and, built under inference_mode, still serves a training step."""
    built = []
    build = common.rotary_table
    monkeypatch.setattr(common, "rotary_table", lambda *key: built.append(key) or build(*key))
    common.cached_rotary_table.cache_clear()
    torch.manual_seed(0)
    model = common.Llama(common.SIZES["tiny"])
    tokens = torch.randint(common.SIZES["tiny"].vocab_size, (2, 17))
    with torch.inference_mode():
        model(tokens[:, :-1], tokens[:, 1:])
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    head_dim = model.model.layers[0].self_attn.head_dim
    assert built == [(16, head_dim, torch.device("cpu"), torch.float32, 10_000.0)]
    assert not any(t.requires_grad or t.is_inference() for t in common.cached_rotary_table(
        *built[0]))
    common.cached_rotary_table.cache_clear()


def test_the_cached_rotary_table_is_the_one_computed_each_call():
    """The table as apply_rotary computed it on every call, to the bit: losses unchanged."""
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    freq = 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    angle = torch.outer(torch.arange(7, dtype=torch.float32), freq)
    angle = torch.cat([angle, angle], dim=-1)
    first, second = x.chunk(2, dim=-1)
    expected = x * angle.cos().to(x.dtype) + torch.cat([-second, first], dim=-1) * \
        angle.sin().to(x.dtype)
    assert torch.equal(common.apply_rotary(x, base=500), expected)
    assert not torch.equal(common.apply_rotary(x), expected)  # the base is part of the key


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_the_llama_computes_huggingfaces_llama(attn_implementation):
    """common.Llama's weights in a transformers LlamaForCausalLM of its shapes (HuggingFace's
    default rotary, base 10,000, rotate_half's layout; repeat_kv, in eager attention written
    out): the same loss and gradients, to float rounding."""
    import hf_models

    torch.manual_seed(0)
    ours = common.Llama(common.SIZES["tiny"])
    theirs = hf_models.tiny_llama(attn_implementation, tied=False)
    theirs.load_state_dict(ours.state_dict())
    tokens = common.global_token_batch(common.SIZES["tiny"], 16, 2, 0, seed=0)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, expected = ours(x, y), hf_models.hf_loss(theirs, x, y)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    expected.backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rotary_positions_rotate_pairs_and_keep_norms():
    x = torch.randn(1, 2, 6, 8)
    rotated = common.apply_rotary(x)
    assert torch.equal(rotated[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    # relative: the product of two rotated vectors depends on their distance only
    q, k = torch.randn(8), torch.randn(8)
    rq, rk = (common.apply_rotary(v.expand(1, 1, 6, 8))[0, 0] for v in (q, k))
    assert torch.allclose(rq[3] @ rk[1], rq[4] @ rk[2], atol=1e-5)


def test_the_llamas_pipeline_layers_compute_its_forward():
    torch.manual_seed(0)
    model = common.Llama(common.SIZES["tiny"])
    layers = model.pipeline_layers()
    assert layers[0] is model.model.embed_tokens and layers[1] is model.model.layers[0]
    assert layers[-1].head is model.lm_head
    tokens = torch.randint(common.SIZES["tiny"].vocab_size, (2, 17))
    x = tokens[:, :-1]
    for layer in layers[:-1]:
        x = layer(x)
    assert torch.equal(layers[-1](x, tokens[:, 1:]), model(tokens[:, :-1], tokens[:, 1:]))
    assert sum(len(stage) for stage in model.pipeline_stages(3)) == len(layers)


def test_the_adapter_finds_the_parts_of_each_model_by_identity():
    size = common.SIZES["tiny"]
    gpt, llama = common.GPT(size, 16), common.Llama(size)
    resnet = common.Classifier("resnet18", common.NUM_CLASSES)
    assert common.transformer_blocks(gpt) == list(gpt.blocks)
    assert common.transformer_blocks(llama) == list(llama.model.layers)
    assert common.transformer_blocks(resnet) == [resnet.net.layer1, resnet.net.layer2,
                                                 resnet.net.layer3, resnet.net.layer4]
    assert common.input_embedding(gpt) is gpt.tok_emb
    assert common.output_head(gpt).weight is common.input_embedding(gpt).weight  # tied
    assert common.input_embedding(llama) is llama.model.embed_tokens
    assert common.output_head(llama) is llama.lm_head
    assert common.input_embedding(resnet) is None and common.output_head(resnet) is resnet.net.fc
    assert common.transformer_blocks(resnet.net) == common.transformer_blocks(resnet)  # unwrapped
    timm_like = torch.nn.Module()  # blocks in a Sequential, as timm's ViT keeps them
    timm_like.blocks = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert common.transformer_blocks(timm_like) == list(timm_like.blocks)


def test_a_model_without_known_blocks_gets_one_line_naming_what_to_pass():
    with pytest.raises(ValueError, match="pass the list of its repeated blocks") as err:
        common.transformer_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert "\n" not in str(err.value)


def test_a_trainer_of_ones_own_gets_its_topology_from_the_environment_alone(monkeypatch):
    for name in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(common.os, "environ", dict(common.os.environ))  # setup writes to it
    topo = common.setup(timeout_s=30)
    try:
        assert (topo.rank, topo.world_size, topo.backend) == (0, 1, "gloo")
    finally:
        torch.distributed.destroy_process_group()


# --- parameter and memory counting ------------------------------------------------------------
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_gpt_param_count_matches_the_built_model(size):
    model = common.GPT(common.SIZES[size], 64)
    built = sum(p.numel() for p in model.parameters())  # parameters() yields the tied weight once
    assert built == helpers.gpt_param_count(common.SIZES[size], 64)


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_llama_param_count_matches_the_built_model(size):
    built = sum(p.numel() for p in common.Llama(common.SIZES[size]).parameters())
    assert built == helpers.llama_param_count(common.SIZES[size])


def test_large_preset_is_near_one_billion_parameters():
    assert 0.9e9 < helpers.gpt_param_count(common.SIZES["large"], 1024) < 1.1e9
    assert 0.9e9 < helpers.llama_param_count(common.SIZES["large"]) < 1.1e9


def test_state_mb_counts_params_grads_and_adam_state():
    model = torch.nn.Linear(100, 50)  # 5050 parameters in two tensors
    opt = torch.optim.AdamW(model.parameters())
    assert common.state_mb(model, opt) == pytest.approx(5050 * 4 / 2**20)
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    # params + grads + exp_avg + exp_avg_sq, plus AdamW's scalar float32 `step` per tensor
    assert common.state_mb(model, opt) == pytest.approx((4 * 5050 * 4 + 2 * 4) / 2**20)


def test_tensor_mb_counts_a_tensor_reached_twice_once_but_distinct_views_apart():
    w = torch.zeros(256, 1024)  # 1 MiB
    assert common.tensor_mb([w, w, w.view(-1)]) == pytest.approx(1.0)
    assert common.tensor_mb([w[:128], w[128:]]) == pytest.approx(1.0)  # two halves of a buffer
    assert common.tensor_mb([w, torch.zeros(256, 1024)]) == pytest.approx(2.0)


def test_peak_tensor_memory_holds_a_known_allocation_pattern_within_5_percent():
    model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB of parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()  # 1 MiB of gradients
    opt.step()  # 2 MiB of Adam moments
    held = torch.zeros(2**20)  # 4 MiB alive before the step, outside the model: "other"

    def step():
        first = torch.ones(2**21)  # 8 MiB
        second = first * 2  # 8 MiB more while the first lives: the step's peak
        del first, second
        return torch.zeros(())

    _, memory = common.peak_tensor_memory(step, (model, opt), torch.device("cpu"))
    assert memory["total"] == pytest.approx(1 + 1 + 2 + 4 + 16, rel=0.05)
    assert (memory["params"], memory["grads"]) == (pytest.approx(1), pytest.approx(1))
    assert memory["optim"] == pytest.approx(2, rel=0.01)
    assert memory["activations"] == pytest.approx(16)
    assert memory["other"] == pytest.approx(4, rel=0.05)
    del held


def test_ring_allreduce_bytes():
    assert common.ring_allreduce_mb(2**20, 1) == 0
    assert common.ring_allreduce_mb(2**20, 2) == pytest.approx(1.0)
    assert common.ring_allreduce_mb(2**20, 4) == pytest.approx(1.5)


# --- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [(["--size", "huge"], "--size"),
                                        (["--steps", "-3"], "--steps"),
                                        (["--batch-size", "two"], "--batch-size")])
def test_bad_flags_exit_2_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        common.parser(None).parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


def test_long_context_flag_defaults_come_from_the_preset():
    args = common.parser(None, long_context=True).parse_args(["--size", "small"])
    assert (args.seq_len, args.batch_size) == (common.SIZES["small"].long_seq_len,
                                               common.SIZES["small"].long_batch_size)
    args = common.parser(None).parse_args(["--size", "small", "--seq-len", "64"])
    assert (args.seq_len, args.batch_size) == (64, common.SIZES["small"].batch_size)


# --- SLURM --------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, first", [("gpu[07-09,12],cpu1", "gpu07"), ("n1,n2", "n1"),
                                             ("rack[2-3]-node[010-011]", "rack2-node010"),
                                             ("localhost", "localhost")])
def test_first_slurm_host(nodelist, first):
    assert common.first_slurm_host(nodelist) == first


def test_slurm_tasks_per_node_expands_repeats():
    assert [common.slurm_tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert common.slurm_tasks_on_node("4", 0) == 4


def test_torchrun_env_from_slurm_for_the_second_task_of_the_second_node():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "123456"}
    derived = common.torchrun_env_from_slurm(env)
    assert derived == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert common.torchrun_env_from_slurm({**env, "SLURM_NTASKS_PER_NODE": "3",
                                           "MASTER_PORT": "29400"})["MASTER_PORT"] == "29400"


# --- report -----------------------------------------------------------------------------------
def _row(script, baseline=None, status="ok", **fields):
    rec = {"folder": "01_ddp", "script": script, "baseline": baseline, "status": status,
           "reason": None, "size": "tiny", "model": "gpt", "world_size": 2, "device": "cpu"}
    if status == "ok":
        rec.update(step_ms=100.0, step_ms_p90=110.0, tokens_per_s=1000.0, peak_mem_mb=800.0,
                   state_mb=10.0, comm_mb=2.0, losses=[5.0, 4.0], theory={"comm_mb": 2.0})
    rec.update(fields)
    return rec


def test_report_shows_ok_failed_and_skipped_rows():
    records = [
        _row("baseline_ddp", step_ms=999.0),  # superseded by the next baseline_ddp record
        _row("baseline_ddp"),
        _row("optimized_ddp", "baseline_ddp", step_ms=80.0, peak_mem_mb=400.0,
             losses=[5.0, 4.00002], loss_tolerance=1e-4),
        _row("baseline_ddp_flash", status="failed", reason="RuntimeError: boom"),
        _row("optimized_ddp_flash", "baseline_ddp_flash", status="skipped",
             reason="needs CUDA"),
    ]
    text = results_table.render_report(records)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4  # header, rule, one row per script (latest record only)
    assert len({line.count("|") for line in table}) == 1  # no cell breaks the markdown table
    assert len(table[0].split("|")) - 2 <= 8  # a table that fits a screen
    optimized = report_rows(text)["optimized_ddp"]
    assert optimized["speedup"] == "1.25x"  # 100 ms / 80 ms
    assert optimized["peak MB (x)"] == "400 (0.50x)"  # 400 MB / 800 MB
    assert optimized["max Δloss"] == "2.00e-05 (ok)"
    assert report_rows(text)["baseline_ddp_flash"]["status"] == "failed: RuntimeError: boom"
    assert report_rows(text)["optimized_ddp_flash"]["status"] == "skipped: needs CUDA"
    assert "999.0" not in text
    wide = results_table.render_report(records, wide=True)  # every column, the status inline
    assert "| failed: RuntimeError: boom" in wide and "| 2.00e-05 (ok)" in wide


def test_a_row_compared_with_another_than_its_folders_baseline_names_it_and_shows_its_note():
    """03's FP8 row sits after baseline_fsdp's rows but is compared with optimized_fsdp: its
    script cell says so; a run's `note` (what the host changed of it) ends its status."""
    note = "no weight gathered in float8: the 64 rows of blocks.0.fc do not split over 3 ranks"
    records = [_row("baseline_fsdp"), _row("optimized_fsdp", "baseline_fsdp", step_ms=50.0),
               _row("optimized_fsdp_fp8", "optimized_fsdp", step_ms=100.0, note=note)]
    rows = report_rows(results_table.render_report(records))
    assert set(rows) == {"baseline_fsdp", "optimized_fsdp", "optimized_fsdp_fp8 vs optimized_fsdp"}
    fp8 = rows["optimized_fsdp_fp8 vs optimized_fsdp"]
    assert fp8["speedup"] == "0.50x"  # 50 ms / 100 ms: against optimized_fsdp
    assert fp8["status"] == f"ok; {note}"
    assert rows["optimized_fsdp"]["status"] == "ok"


def test_a_loss_difference_over_tolerance_is_the_rows_status():
    records = [_row("baseline_ddp"),
               _row("optimized_ddp", "baseline_ddp", losses=[5.0, 4.5], loss_tolerance=1e-4)]
    row = report_rows(results_table.render_report(records))["optimized_ddp"]
    assert row["max Δloss"] == "5.00e-01 (> 0.0001)" and row["status"] == "over tolerance"
    assert results_table.over_tolerance(records[1], records[0])
    assert not results_table.over_tolerance({**records[1], "loss_tolerance": 0.6}, records[0])
    assert not results_table.over_tolerance(records[1], None)  # nothing to compare with


def test_report_does_not_compare_runs_with_other_settings():
    records = [_row("baseline_ddp", batch_size=4),
               _row("optimized_ddp", "baseline_ddp", batch_size=8, step_ms=50.0)]
    text = results_table.render_report(records)
    assert "not compared: baseline ran with other batch_size" in text
    assert "2.00x" not in text
    # the same settings, but two timed steps a side: too few for a speedup to rest on
    records = [_row("baseline_ddp", steps=2), _row("optimized_ddp", "baseline_ddp", steps=2,
                                                  step_ms=50.0)]
    row = report_rows(results_table.render_report(records))["optimized_ddp"]
    assert row["speedup"] == "" and row["max Δloss"] == "0.00e+00" and row["status"] == \
        "ok; no speedup: 2 timed steps, fewer than a speedup rests on (5)"


def test_a_baseline_that_did_not_run_is_what_its_optimized_rows_say():
    # a failed run's record is written before its flags are known: it has no dtype, batch size..
    flags = {"dtype": "fp32", "batch_size": 4, "steps": 20}
    records = [_row("baseline_ddp", status="failed", reason="RuntimeError: boom"),
               _row("optimized_ddp", "baseline_ddp", **flags),
               _row("baseline_ddp_flash", status="skipped", reason="needs CUDA"),
               _row("optimized_ddp_flash", "baseline_ddp_flash", **flags),
               _row("optimized_ddp_lone", "baseline_ddp_lone", **flags)]
    rows = report_rows(results_table.render_report(records))
    assert rows["optimized_ddp"]["status"] == "ok; not compared: baseline failed"
    assert rows["optimized_ddp_flash"]["status"] == "ok; not compared: baseline skipped"
    assert rows["optimized_ddp_lone"]["status"] == \
        "ok; not compared: no baseline_ddp_lone run on this setup"
    assert all(row["speedup"] == "" and "other" not in row["status"] for label, row in rows.items()
               if label.startswith("optimized"))


def test_a_run_is_compared_with_its_baselines_run_of_the_same_flags_else_its_default():
    heavy = {"batch_size": 1, "seq_len": 32, "variant": "--batch-size 1 --seq-len 32"}
    records = [_row("baseline_symmem_training", step_ms=200.0, batch_size=4, seq_len=128),
               _row("baseline_symmem_training", step_ms=60.0, **heavy),
               _row("optimized_symmem_training", "baseline_symmem_training", step_ms=30.0,
                    **heavy),
               _row("optimized_symmem_training", "baseline_symmem_training", step_ms=160.0,
                    batch_size=4, seq_len=128, variant="--replicated-optimizer"),
               # a flag the baseline lacks beside one it shares: the baseline's run with it
               _row("baseline_zero", step_ms=100.0, clip_grad_norm=0.5,
                    variant="--clip-grad-norm 0.5"),
               _row("baseline_zero", step_ms=400.0),
               _row("optimized_zero_pytorch", "baseline_zero", step_ms=50.0, clip_grad_norm=0.5,
                    variant="--stage 3 --clip-grad-norm 0.5"),
               _row("optimized_zero1", "baseline_zero", step_ms=50.0, clip_grad_norm=1.0,
                    variant="--clip-grad-norm 1.0")]
    rows = {label: row for label, row in report_rows(results_table.render_report(records)).items()
            if label.startswith("optimized")}
    speedups = {label: row["speedup"] for label, row in rows.items()}
    assert speedups == {"optimized_symmem_training --batch-size 1 --seq-len 32": "2.00x",
                        "optimized_symmem_training --replicated-optimizer": "1.25x",
                        "optimized_zero_pytorch --stage 3 --clip-grad-norm 0.5": "2.00x",
                        "optimized_zero1 --clip-grad-norm 1.0": ""}
    assert rows["optimized_zero1 --clip-grad-norm 1.0"]["status"].endswith(
        "not compared: baseline ran with other clip_grad_norm")
    # the baseline run it pairs with died: that is the reason, not the default run's settings
    records[1] = _row("baseline_symmem_training", status="failed", reason="boom",
                      variant=heavy["variant"])
    records.append(_row("optimized_symmem_training", "baseline_symmem_training", step_ms=40.0,
                        **{**heavy, "variant": heavy["variant"] + " --replicated-optimizer"}))
    rows = report_rows(results_table.render_report(records))
    for label in ("optimized_symmem_training --batch-size 1 --seq-len 32",
                  "optimized_symmem_training --batch-size 1 --seq-len 32 --replicated-optimizer"):
        assert rows[label]["status"].endswith("not compared: baseline failed"), label


@pytest.mark.parametrize("ours, theirs, noise", [
    ([75.0, 90.0], [95.0, 130.0], False),  # faster, and its middle half below the baseline's
    ([75.0, 96.0], [95.0, 130.0], True),
    ([100.0, 110.0], [95.0, 130.0], True),  # inside it
    ([120.0, 140.0], [95.0, 130.0], True),  # slower, overlapping from above
    ([131.0, 140.0], [95.0, 130.0], False),
    (None, [95.0, 130.0], False),  # recorded before spreads were: not marked either way
])
def test_a_speedup_is_within_noise_when_the_runs_middle_halves_overlap(ours, theirs, noise):
    assert results_table.within_noise(_row("optimized_ddp", "baseline_ddp", step_ms_iqr=ours),
                               _row("baseline_ddp", step_ms_iqr=theirs)) is noise


@pytest.mark.parametrize("load, cpus, world, nnodes, busy", [
    ([2.2, 2.4], 2, 2, 1, False),  # 2 ranks on 2 cores: the run's own load
    ([2.1, 3.1], 2, 2, 1, True),  # one busy process beside them, seen at the end
    ([3.2, 2.3], 2, 2, 1, True),  # or still there as the timed steps began
    ([4.3, 4.4], 2, 4, 1, False),  # 4 ranks on 2 cores load it with 4 by themselves
    ([4.6, 4.4], 2, 4, 1, True),
    ([6.0, 6.0], 2, 8, 2, True),  # 8 ranks on 2 nodes: 4 on this host
    ([9.0, 9.0], 64, 8, 1, False),  # 8 GPU ranks on a 64-core host
    (None, None, 2, 1, False),  # recorded before hosts' load was: not marked either way
])
def test_a_host_is_busy_when_its_load_exceeds_its_cores_or_the_runs_own_ranks(
        load, cpus, world, nnodes, busy):
    assert results_table.busy_host(_row("baseline_ddp", load_avg=load, cpus=cpus, world_size=world,
                                 nnodes=nnodes)) is busy


def test_a_speedup_within_the_runs_spread_and_a_busy_host_are_marked_and_explained():
    base = _row("baseline_ddp", step_ms_iqr=[95.0, 130.0], load_avg=[2.0, 2.2], cpus=2)
    apart = _row("optimized_ddp", "baseline_ddp", step_ms=80.0, step_ms_iqr=[75.0, 90.0],
                 load_avg=[2.1, 2.3], cpus=2)

    def table(*records):
        text = results_table.render_report(list(records))
        return report_rows(text), " ".join(text.split())  # the notes, wrapped, as one line

    rows, text = table(base, apart)
    assert rows["optimized_ddp"]["speedup"] == "1.25x" and rows["optimized_ddp"]["status"] == "ok"
    assert results_table.NOISE_NOTE not in text  # the note comes with a mark only
    rows, text = table(base, dict(apart, step_ms_iqr=[75.0, 96.0]))  # overlaps [95, 130]
    assert rows["optimized_ddp"]["speedup"] == "~1.25x" and results_table.NOISE_NOTE in text
    rows, text = table(dict(base, load_avg=[2.1, 3.1]), apart)
    assert rows["baseline_ddp"]["status"] == "ok (busy host)"
    assert rows["optimized_ddp"]["status"] == "ok"
    assert results_table.NOISE_NOTE in text


def test_report_cli_survives_an_empty_and_a_truncated_file(tmp_path):
    results = tmp_path / "results.jsonl"
    out = tmp_path / "report.md"
    cmd = [sys.executable, "-m", "report", "--results", str(results), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
    assert "No results yet" in run.stdout
    results.write_text(json.dumps(_row("baseline_ddp")) + "\n" + '{"folder": "01_dd')
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
    assert run.returncode == 0 and "baseline_ddp" in out.read_text()


def test_list_names_every_script_with_its_summary():
    text = cli.list_scripts()
    scripts = sorted(common.ROOT.glob("[0-9][0-9]_*/*.py"))
    assert len(scripts) > 20
    for script in scripts:
        (line,) = [row for row in text.splitlines() if row.split()[:1] == [script.name]]
        assert len(line.split(maxsplit=1)[1]) > 20  # the docstring's first sentence


def test_mark_failed_adds_a_row_only_when_the_run_left_none(tmp_path):
    results, log = tmp_path / "results.jsonl", tmp_path / "run.log"
    log.write_text("Traceback (most recent call last):\n  ...\nValueError: bad\n"
                   "rank 1 failed: ValueError: bad\n" + TORCHRUN_SUMMARY.format(code=1))
    script = common.ROOT / "01_ddp" / "baseline_ddp.py"
    cmd = [sys.executable, "-m", "report", "mark-failed", str(script),
           "--since", "0", "--world-size", "2", "--exit-code", "1", "--log", str(log),
           "--", "--size", "tiny", "--results", str(results)]
    first = subprocess.run(cmd, check=True, capture_output=True, text=True,
                           cwd=common.ROOT)
    assert first.stdout == "rank 1 failed: ValueError: bad\n"
    assert runs.mark_failed(script, ["--size", "tiny", "--results", str(results)], 0, 1, log,
                              2) == "rank 1 failed: ValueError: bad"
    rows = common.load_results(results)
    assert len(rows) == 1  # the first call's row now counts as this run's record
    assert rows[0]["status"] == "failed" and rows[0]["size"] == "tiny"
    assert rows[0]["world_size"] == 2 and rows[0]["script"] == "baseline_ddp"
    assert rows[0]["reason"] == "rank 1 failed: ValueError: bad"


def test_mark_failed_keeps_the_row_of_a_run_that_recorded_itself_then_crashed(tmp_path):
    results, log = tmp_path / "results.jsonl", tmp_path / "run.log"
    log.write_text(TORCHRUN_SUMMARY.format(code=-6))  # aborted in teardown, after recording
    rec = {**_row("baseline_ddp"), "time": "2100-01-01T00:00:00+00:00", "variant": None}
    results.write_text(json.dumps(rec) + "\n")
    line = runs.mark_failed(common.ROOT / "01_ddp" / "baseline_ddp.py",
                              ["--results", str(results)], 0, 1, log, 2)
    assert line == "rank 1 was killed by signal 6, after recording ok"
    assert [r["status"] for r in common.load_results(results)] == ["ok"]


def test_mark_failed_records_a_run_whose_flags_its_script_refused(tmp_path):
    """`ARGS='--size huge'`: the recorder reads the flags leniently instead of failing too."""
    results, log = tmp_path / "results.jsonl", tmp_path / "run.log"
    log.write_text("baseline_ddp.py: error: argument --size: invalid choice: 'huge'\n")
    runs.mark_failed(common.ROOT / "01_ddp" / "baseline_ddp.py",
                       ["--size", "huge", "--results", str(results)], 0, 2, log, 2)
    (row,) = common.load_results(results)
    assert (row["status"], row["size"]) == ("failed", "huge")
    assert row["reason"] == "baseline_ddp.py: error: argument --size: invalid choice: 'huge'"


TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
baseline_ddp.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_11:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4241)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_11:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
"""


# torchrun's own failure: its static rendezvous could not listen on MASTER_PORT (another run
# holds it), so no rank started and no rank's failure is listed (torch 2.x's log, trimmed)
TORCHRUN_BUSY_PORT = (
    "*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, ...\n"
    "*****************************************\n"
    "Traceback (most recent call last):\n"
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File ".venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1138, in main\n'
    "    run(args)\n"
    '  File ".venv/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/'
    'static_tcp_rendezvous.py", line 67, in next_rendezvous\n'
    "    self._store = TCPStore(  # type: ignore[call-arg]\n"
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: {port}, useIpv6: false, code: -98, name: {name}, message: address "
    "already in use\n")


@pytest.mark.parametrize("output, code, line", [
    (TORCHRUN_BUSY_PORT.format(port=29500, name="EADDRINUSE"), 1,
     "port 29500 is busy (another run on this host?), no rank started: choose another with "
     "MASTER_PORT=<n> (unset, a one-node run takes a free one)"),
    (TORCHRUN_BUSY_PORT.format(port=29500, name="EACCES"), 1,  # any other failure of torchrun's
     "torchrun failed before any rank started: DistNetworkError: The server socket has failed "
     "to listen on any local network address. port: 29500, useIpv6: false, code: -98, name: "
     "EACCES, message: address already in use"),
    ("noise\noptimized_ddp.py: error: --accum 3 does not split\n" + TORCHRUN_SUMMARY.format(code=2),
     2, "optimized_ddp.py: error: --accum 3 does not split"),
    ("Traceback...\nRuntimeError: x\nrank 0 failed: RuntimeError: x\nrank 1 failed: Other: y\n",
     1, "rank 0 failed: RuntimeError: x"),  # the first rank to fail, not the echoes
    (TORCHRUN_SUMMARY.format(code=-9), 1, "rank 1 was killed by signal 9"),  # the root cause
    (TORCHRUN_SUMMARY.format(code=3), 1, "rank 1 exited with code 3"),
    ("", 139, "a rank exited with code 139"),
])
def test_a_failed_runs_line_is_its_scripts_own_error(output, code, line):
    assert runs.failure_line(output, code) == line


# --- outcomes ---------------------------------------------------------------------------------
def test_run_main_records_a_skip_and_a_failure(tmp_path, monkeypatch, capfd):
    results = tmp_path / "results.jsonl"
    monkeypatch.setattr(common.run_state, "args", tiny_args("--results", str(results)))
    monkeypatch.setattr(common.run_state, "topo", cpu_topology())
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "03_fsdp" / "optimized_fsdp.py")])

    def needs_cuda():
        raise common.Skip("needs CUDA for FP8")

    def breaks():
        raise RuntimeError("NCCL error\nlong traceback text")

    common.run_main(needs_cuda)  # returns normally: a skip is not an error
    with pytest.raises(RuntimeError):
        common.run_main(breaks)
    assert "rank 0 failed: RuntimeError: NCCL error\n" in capfd.readouterr().err  # the line shown
    skipped, failed = common.load_results(results)
    assert (skipped["status"], skipped["reason"]) == ("skipped", "needs CUDA for FP8")
    assert (failed["status"], failed["reason"]) == ("failed", "RuntimeError: NCCL error")
    assert (failed["folder"], failed["script"]) == ("03_fsdp", "optimized_fsdp")
    assert failed["size"] == "tiny" and failed["device"] == "cpu"
    assert "skipped: needs CUDA for FP8" in results_table.render_report([skipped])


def test_a_closed_stdout_drops_the_prints_not_the_run(tmp_path, monkeypatch):
    """`python 01_ddp/optimized_ddp.py | head -5`: once the reader has gone a print raises
    BrokenPipeError; the run goes on to its end, records no failure, and its stdout is back."""
    results = tmp_path / "results.jsonl"
    monkeypatch.setattr(common.run_state, "args", tiny_args("--results", str(results)))
    monkeypatch.setattr(common.run_state, "topo", cpu_topology())
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "01_ddp" / "optimized_ddp.py")])
    read_end, write_end = os.pipe()
    os.close(read_end)  # `head` has read its lines and left
    with open(write_end, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        reached = []

        def prints_then_finishes():
            for step in range(3):
                print(f"step {step}", flush=True)
            common.log(cpu_topology(), "summary")
            reached.append("the end")

        common.run_main(prints_then_finishes)
        assert reached == ["the end"] and sys.stdout is closed_pipe
    assert common.load_results(results) == []


def test_check_flags_parses_and_exits_before_the_run(tmp_path):
    """What `make` runs with ARGS before a launch: good flags exit 0 and record nothing."""
    results = tmp_path / "results.jsonl"
    with pytest.raises(SystemExit) as exited:
        common.parser(None).parse_args(["--size", "tiny", "--results", str(results),
                                        "--check-flags"])
    assert exited.value.code == 0 and not results.exists()
    # flags that parse but disagree fail the check, as they would fail every launch
    with pytest.raises(SystemExit) as exited:
        common.parser(None).parse_args(["--size", "tiny", "--trace", "--warmup", "1",
                                        "--check-flags"])
    assert exited.value.code == 2
    # a script that skips this model records nothing in a check: the flags are fine
    skipping = common.parser(None, skips={"resnet": "why"})
    with pytest.raises(SystemExit) as exited:
        skipping.parse_args(["--model", "resnet", "--results", str(results), "--check-flags"])
    assert exited.value.code == 0 and not results.exists()


def test_a_skip_from_the_model_is_recorded_as_its_variant(monkeypatch):
    """A run that skips its --model before the shape is parsed still names its own flags: `make
    smoke` finds the record of `optimized_moe_ep.py --long-run` by them (it failed the run as
    unrecorded when the skip carried no variant)."""
    monkeypatch.setattr(common.run_state, "args", None)  # put back after the test
    skipping = common.parser(None, skips={"llama": "why"})
    skipping.add_argument("--long-run", action="store_true")
    with pytest.raises(common.Skip, match="why"):
        skipping.parse_args(["--model", "llama", "--long-run"])
    assert common.run_state.args.variant == "--long-run"
    with pytest.raises(common.Skip):
        skipping.parse_args(["--model", "llama"])
    assert common.run_state.args.variant is None


def test_a_diverged_run_is_an_error_not_a_result(monkeypatch):
    # torchrun's variables for a world of one, undone after the test (later tests launch
    # subprocesses that must not inherit them)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common.free_port())).items():
        monkeypatch.setenv(name, value)
    args = tiny_args("--steps", "2", "--timeout", "30")
    topo = common.setup(args)
    try:
        batches = [(torch.zeros(1), torch.zeros(1))] * 3
        losses = iter([1.0, 2.0, float("nan")])
        with pytest.raises(FloatingPointError, match="not finite from step 3"):
            common.timed_steps(lambda x, y: torch.tensor(next(losses)), batches, args, topo)
    finally:
        torch.distributed.destroy_process_group()


def test_a_record_keeps_its_step_spread_its_hosts_load_and_the_versions_that_change_results(
        tmp_path, monkeypatch, capsys):
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common.free_port())).items():
        monkeypatch.setenv(name, value)
    loads = iter([1.25, 3.5])  # the first timed step's 1-minute average, then the last's
    monkeypatch.setattr(common.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    args = tiny_args("--steps", "6", "--warmup", "2", "--results", str(tmp_path / "r.jsonl"))
    topo = common.setup(args)
    try:
        model, batches = common.workload(args, topo)
        stats = common.timed_steps(lambda x, y: model(x, y), batches, args, topo)
        rec = common.record(args, topo, stats, baseline=None, model=model, optimizer=None,
                            comm_mb=None, theory={}, note="the host changed this run")
    finally:
        torch.distributed.destroy_process_group()
    assert rec == common.load_results(args.results)[0]
    # what the host changed of the run ends its summary line, where the user looks
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert " ms/step " in summary and summary.endswith("; the host changed this run"), summary
    assert rec["load_avg"] == [1.25, 3.5] and rec["cpus"] == os.cpu_count()
    q1, q3 = rec["step_ms_iqr"]
    assert q1 <= rec["step_ms"] <= q3 <= rec["step_ms_p90"] + 1e-3
    assert rec["torchao"] == importlib.metadata.version("torchao")
    assert rec["torchvision"] == importlib.metadata.version("torchvision")
    # every key a record carries is in the schema `python -m report --help` prints
    named = set(re.findall(r"[a-z_0-9]+", cli.RESULTS_SCHEMA))
    assert set(rec) <= named, set(rec) - named


def test_a_package_that_is_not_installed_records_no_version(monkeypatch):
    def not_torchao(package):
        if package == "torchao":
            raise importlib.metadata.PackageNotFoundError(package)
        return "0.29.1"

    monkeypatch.setattr(importlib.metadata, "version", not_torchao)
    rec = common.base_record(None, None, None, "failed", "boom")
    assert (rec["torchao"], rec["torchvision"]) == (None, "0.29.1")


def test_report_compares_rows_only_on_the_same_link_and_shows_measured_beside_theory():
    records = [_row("baseline_ddp"), _row("baseline_ddp", link="1gbit", step_ms=400.0),
               _row("optimized_ddp", "baseline_ddp", link="1gbit", step_ms=200.0,
                    compression=3.9, theory={"comm_mb": 0.5, "compression": 3.94})]
    text = results_table.render_report(records)
    optimized = report_rows(text)["optimized_ddp"]  # the table's setup is the loopback's
    assert optimized["speedup"] == "2.00x"  # 400 ms / 200 ms, not 100 / 200
    assert "compression 3.94 (measured 3.9)" in " ".join(text.split())
    wide = next(line for line in results_table.render_report(records, wide=True).splitlines()
                if "| optimized_ddp " in line)
    assert "tiny @1gbit" in wide and "2.00x" in wide
    assert "compression=3.94 (measured 3.9)" in wide
    assert "comm_mb=0.5;" in wide  # comm MB has its own column


@pytest.mark.parametrize("flags, variant", [
    ([], None), (["--batch-size", "4", "--seq-len", "128"], None),  # small's own, given
    (["--seq-len", "32", "--batch-size", "1"], "--batch-size 1 --seq-len 32"),
    (["--lr", "0.01", "--batch-size", "2"], "--batch-size 2"),  # other shared flags do not
])
def test_another_batch_or_sequence_length_names_the_runs_variant(flags, variant):
    assert common.parser(None).parse_args(["--size", "small", *flags]).variant == variant
    # as the Makefile's bookkeeping finds a run's record from its flags, the script's own after
    assert runs._flags_of(["--size", "small", *flags, "--replicated-optimizer"])[1] == \
        " ".join(filter(None, [variant, "--replicated-optimizer"]))


def test_a_variants_trace_is_named_after_it_as_its_log_is(tmp_path, monkeypatch):
    class Profiler:  # stands in for torch.profiler.profile: writes what it is asked to
        def export_chrome_trace(self, path):
            Path(path).write_text("{}")

    monkeypatch.setattr(sys, "argv", [str(common.ROOT / "04_zero" / "optimized_zero_pytorch.py")])
    for variant in ("--stage 3", None):
        args = argparse.Namespace(results=tmp_path / "results.jsonl", variant=variant, warmup=4)
        common._export_trace(Profiler(), args, cpu_topology(rank=1, world=2))
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "04_zero_optimized_zero_pytorch--stage3_rank1.json",
        "04_zero_optimized_zero_pytorch_rank1.json"]


def _reduce_scatter_equals_gloos_own(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    for numel in (1, 1000, 65_537):  # padded to whole chunks as ZeRO and FSDP pad them
        chunk = -(-numel // world)
        x = torch.zeros(chunk * world)
        x[:numel] = torch.randint(-1000, 1000, (numel,), generator=gen).float()  # exact sums
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            ours, theirs = torch.empty(chunk), torch.empty(chunk)
            with common.CollectiveBytes() as sent:
                common.reduce_scatter(ours, x, op=op)
            assert set(sent.by_kind) == {"alltoall float32"}  # not gloo's all-reduce of a copy
            assert sent.bytes == (world - 1) / world * x.nbytes  # what a ring reduce-scatter sends
            common.reduce_scatter_single(theirs, x.clone())  # gloo's: all-reduce, keep a slice
            if op == dist.ReduceOp.AVG:
                theirs.div_(world)
            assert torch.equal(ours, theirs), (numel, op)
            pending = common.reduce_scatter(ours := torch.empty(chunk), x, op=op, async_op=True)
            assert pending.wait() and pending.is_completed() and torch.equal(ours, theirs)
        in_place = x.clone()  # ZeRO-1: the output is the input's own chunk
        mine = in_place[rank * chunk:(rank + 1) * chunk]
        common.reduce_scatter(mine, in_place)
        common.reduce_scatter_single(theirs := torch.empty(chunk), x.clone())
        assert torch.equal(mine, theirs), numel
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_on_gloo_equals_reduce_scatter_tensor(world):
    torch.multiprocessing.spawn(functools.partial(run_then_leave, _reduce_scatter_equals_gloos_own),
                                args=(world, common.free_port()), nprocs=world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_sequence_positions_cut_every_position_once(world, zigzag):
    shards = [common.sequence_positions(24, r, world, zigzag) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(24))
    assert {len(s) for s in shards} == {24 // world}
    if zigzag:  # rank r: chunks r and 2w-1-r, so each rank's mean position is the same
        assert {s.float().mean().item() for s in shards} == {11.5}


def test_a_sequence_that_does_not_cut_refuses_in_one_line():
    with pytest.raises(ValueError, match=r"--seq-len 30 does not cut into 8 equal chunks .*"
                                         r"multiple of 8"):
        common.sequence_positions(30, 0, 4)


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_a_model_given_its_own_positions_computes_the_same_loss(model_name):
    """positions 0..T-1 passed explicitly are the default, to the bit (rotary's table built from
    them equals the cached one); a shard's positions reach the embeddings or the rotary angles."""
    size = common.SIZES["tiny"]
    torch.manual_seed(0)
    model = common.GPT(size, 16) if model_name == "gpt" else common.Llama(size)
    tokens = common.global_token_batch(size, 16, 2, 0, seed=0)
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert torch.equal(model(x, y), model(x, y, positions=torch.arange(16)))
    # a zigzag shard (chunks 0 and 3 of 4): a gap in the positions, which rotary sees too
    shard = common.sequence_positions(16, 0, 2)
    xs, ys = x[:, shard], y[:, shard]
    assert not torch.equal(model(xs, ys, positions=shard), model(xs, ys))


def test_a_free_port_block_is_free_and_outside_the_ephemeral_range():
    # gloo's pairs and every client socket bind port 0 and get a port in the ephemeral range: a
    # test's store at port + k, chosen there, was once taken between the check and the bind
    ephemeral = common._ephemeral_ports()
    port = common.free_port(block=40)
    assert port + 40 <= ephemeral.start or port >= ephemeral.stop
    with contextlib.ExitStack() as sockets:
        for k in range(40):
            sockets.enter_context(socket.socket()).bind(("127.0.0.1", port + k))
