"""Unit tests for 02_compression's pure parts, and its hooks' collectives on 2 and 3 CPU ranks.

The collective checks run once per world size in spawned gloo processes (a module-scoped
fixture); each rank-0 process saves its measurements and the tests assert on them here. The
README's two "Use it in your trainer" blocks (PowerSGD, INT8) run as they are in the world of 2
after its checks, on every tiny HuggingFace model of tests/hf_models.py (three families, sdpa and
eager, bf16, the two with a feature some recipes do not implement) against PyTorch's DDP.
"""

import contextlib
import copy
import functools
import io
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import helpers
from helpers import as_rank, load_recipe, readme_python_block, run_then_leave
from report import results_table

FOLDER = common.ROOT / "02_compression"
int8 = load_recipe(FOLDER / "optimized_compression_int8.py")
powersgd = load_recipe(FOLDER / "optimized_compression_powersgd.py")
BLOCK = 256


# --- INT8: quantization and message layout ------------------------------------------------------
def test_quantize_error_stays_within_half_a_step_of_each_block():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn(64, BLOCK, generator=gen) * torch.logspace(-6, 3, 64).unsqueeze(1)
    blocks[5] = 0.0  # an all-zero block: scale 0, nothing to divide by
    blocks[7, 3] = 1e4  # an outlier spends its block's resolution, no other's
    original = blocks.clone()
    q, scales = torch.empty(64, BLOCK, dtype=torch.int8), torch.empty(64, 1)
    rounded = int8.quantize(blocks, q, scales, scratch=torch.empty_like(blocks))
    assert torch.equal(blocks, original)  # written into q and scales, the input left alone
    assert torch.equal(rounded, q.float())  # the scratch holds q exactly, ready to dequantize
    assert q.abs().max() == 127 and q.min() >= -127
    error = (blocks - int8.dequantize(q, scales, torch.empty_like(blocks))).abs()
    assert (error <= scales / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(dim=1)[blocks.abs().amax(dim=1) > 0] == 127).all()  # full range used
    assert error[5].max() == 0 and error[6].max() < error[7].max()


def test_dequantize_prefix_fills_the_bucket_up_to_its_end_inside_a_block_and_no_further():
    q = torch.randint(-127, 128, (3, BLOCK), dtype=torch.int8)
    scales = torch.rand(3, 1)
    out = torch.full((2 * BLOCK + 5 + 1,), 7.0)  # 2 blocks and 5 values, then a value to keep
    int8.dequantize_prefix(q, scales, out[:-1])
    assert torch.equal(out[:-1], (q.float() * scales).flatten()[:2 * BLOCK + 5])
    assert out[-1] == 7.0
    int8.dequantize_prefix(q, scales, out[:0])  # a piece wholly in the padding: nothing to do


@pytest.mark.parametrize("block", [BLOCK, 9])  # 9: rows and scales at odd byte offsets
def test_a_message_carries_values_then_fp32_scale_bytes_in_one_int8_row_per_peer(block):
    rows, blocks = 3, 4
    msg = int8.message(rows, blocks * block, block, torch.device("cpu"))
    assert msg.data.dtype == torch.int8 and msg.data.shape == (rows, blocks * block + 4 * blocks)
    q = torch.randint(-127, 128, (rows, blocks, block), dtype=torch.int8)
    scales = torch.rand(rows, blocks, 1)
    msg.values.copy_(q)
    msg.scales.copy_(scales)
    int8.pack_scales(msg)
    assert torch.equal(msg.data[:, :blocks * block].reshape(rows, blocks, block), q)
    assert torch.equal(msg.data[:, blocks * block:].contiguous().view(torch.float32),
                       scales.view(rows, blocks))
    received = int8.message(rows, blocks * block, block, torch.device("cpu"))
    received.data.copy_(msg.data)
    int8.unpack_scales(received)
    assert torch.equal(received.values, q) and torch.equal(received.scales, scales)
    msg.scales.zero_()  # packing one row leaves the others' bytes alone
    int8.pack_scales(msg, slice(1, 2))
    assert (msg.data[1, blocks * block:] == 0).all()
    assert torch.equal(msg.data[[0, 2]], received.data[[0, 2]])


# --- PowerSGD: the pure parts -----------------------------------------------------------------
@pytest.mark.parametrize("shape, rank, compress", [((64, 64), 4, True), ((8, 8), 4, False),
                                                   ((256,), 4, False), ((1024, 256), 64, True),
                                                   ((1024, 256), 128, False)])
def test_worth_compressing_needs_half_the_values_or_fewer(shape, rank, compress):
    assert powersgd.worth_compressing(powersgd.as_matrix(torch.zeros(shape)), rank) == compress


def test_highest_compressing_rank_is_the_smallest_matrixs_last_rank_worth_compressing():
    model = common.Llama(common.SIZES["tiny"])
    whole = [model.model.embed_tokens.weight, model.lm_head.weight]
    rank = powersgd.highest_compressing_rank(model, whole)
    assert rank == 10  # the 32 x 64 key and value projections: 2r(32 + 64) < 32 * 64
    kept = {id(p) for p in whole}
    matrices = [powersgd.as_matrix(p) for p in model.parameters() if p.dim() == 2
                and id(p) not in kept]
    assert all(powersgd.worth_compressing(m, rank) for m in matrices)
    assert not all(powersgd.worth_compressing(m, rank + 1) for m in matrices)
    # `small` (hidden size 256): the README's rank 32 compresses every matrix
    assert powersgd.highest_compressing_rank(common.Llama(common.SIZES["small"]), whole) == 42
    assert powersgd.highest_compressing_rank(torch.nn.Linear(4, 2)) == 1  # nothing to compress


def test_compression_theory_counts_matrices_and_uncompressed_tensors_from_the_shapes():
    size = common.SIZES["small"]
    model = common.GPT(size, size.seq_len)
    d, r = size.d_model, 4
    matrices = [(size.vocab_size, d), (size.seq_len, d)] + size.n_layers * [
        (3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    full = sum(n * m for n, m in matrices)
    uncompressed = helpers.gpt_param_count(size, size.seq_len) - full
    sent = sum(r * (n + m) for n, m in matrices) + uncompressed
    assert powersgd.compression_theory(model, r, []) == pytest.approx((full + uncompressed) / sent)
    assert 38 < (full + uncompressed) / sent < 42  # "about 40x at small"
    # the embedding/head sent whole: its r(n + m) replaced by its n * m
    embedding = size.vocab_size * d
    sent_without = sent - r * (size.vocab_size + d) + embedding
    assert powersgd.compression_theory(model, r, [model.tok_emb.weight]) == \
        pytest.approx((full + uncompressed) / sent_without)
    # the head is the same tensor: naming both keeps the one weight whole, counted once
    assert powersgd.compression_theory(model, r, [model.tok_emb.weight, model.head.weight]) == \
        pytest.approx((full + uncompressed) / sent_without)


def test_compression_theory_of_the_llama_keeps_its_untied_embedding_and_head_whole():
    size = common.SIZES["small"]
    model = common.Llama(size)
    d, r, kv, ffn = size.d_model, 4, size.n_kv_heads * size.d_model // size.n_heads, \
        common.llama_ffn_dim(size.d_model)
    embedding = head = (size.vocab_size, d)
    layer = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]
    full = helpers.llama_param_count(size)
    vectors = full - sum(n * m for n, m in [embedding, head, *size.n_layers * layer])
    sent = vectors + sum(r * (n + m) for n, m in size.n_layers * layer)
    whole = [model.model.embed_tokens.weight, model.lm_head.weight]
    assert powersgd.compression_theory(model, r, whole) == \
        pytest.approx(full / (sent + 2 * size.vocab_size * d))
    assert powersgd.compression_theory(model, r, []) == \
        pytest.approx(full / (sent + 2 * r * (size.vocab_size + d)))


# --- The long pair: PowerSGD once training has settled, judged by its final loss --------------
def long_pair() -> dict[str, list[list[str]]]:
    """`make compression`'s runs beyond one a script, as the Makefile's EXTRA_RUNS_compression
    lists them: script name -> the flags of each of its runs."""
    makefile = (common.ROOT / "Makefile").read_text()
    found = re.search(r"^EXTRA_RUNS_compression :=((?:.*\\\n)*.*)$", makefile, re.M)
    assert found, "the Makefile has no EXTRA_RUNS_compression"
    runs = {}
    for script, *flags in (run.split() for run in re.findall(r'"([^"]+)"', found[1])):
        runs.setdefault(Path(script).stem, []).append(flags)
    return runs


def test_make_compression_runs_the_baseline_and_powersgd_long_at_8x_fewer_bytes_or_more():
    runs = long_pair()
    assert set(runs) == {"baseline_compression", "optimized_compression_powersgd",
                         "optimized_compression_diloco"}
    assert runs["baseline_compression"] == [["--long-run"]]  # the same steps on both sides
    flags, = runs["optimized_compression_powersgd"]
    assert "--long-run" in flags and "--uncompressed" not in flags  # the embedding sent whole
    # in the order the record's variant lists them, by which `make smoke` finds the run's record
    assert flags == ["--rank", flags[1], "--long-run"]
    rank = int(flags[flags.index("--rank") + 1])
    size = common.SIZES["small"]  # the size `make compression` runs at
    model = common.GPT(size, size.seq_len)
    assert powersgd.compression_theory(model, rank, [model.tok_emb.weight]) >= 8
    # DiLoCo: 4 fragments at 25 steps; beside the long pair in fp32, in int8 and at the paper's
    # outer momentum, each --long-run last, as its variant lists it
    assert runs["optimized_compression_diloco"] == [
        ["--fragments", "4"], ["--long-run"], ["--quantize", "int8", "--long-run"],
        ["--outer-momentum", "0.9", "--long-run"]]


@pytest.mark.parametrize("argv, warmup, steps", [
    ([], 6, 19),  # the folder's 25 steps
    (["--long-run"], 10, 100),  # PowerSGD: 8 plain fp32 steps, 2 compressed untimed, 100 timed
    (["--long-run", "--steps", "3", "--warmup", "4"], 4, 3),  # given on the command line: wins
])
def test_long_run_sets_100_steps_unless_the_command_line_gives_them(monkeypatch, argv, warmup,
                                                                    steps):
    monkeypatch.setattr(sys, "argv", ["optimized_compression_powersgd.py", *argv])
    parser = common.parser(None)
    parser.set_defaults(warmup=6, steps=19)
    powersgd.add_long_run_flag(parser)
    args = parser.parse_args()
    assert (args.warmup, args.steps, args.long_run) == (warmup, steps, bool(argv))
    assert args.variant == ("--long-run" if argv else None)  # the row's name in the report


def long_record(script: str, losses: list[float], **fields) -> dict:
    return {"folder": "02_compression", "script": script, "size": "small", "world_size": 2,
            "device": "cpu", "status": "ok", "steps": 100, "warmup": 10, "dtype": "fp32",
            "losses": losses, **fields}


def test_the_long_powersgd_row_is_compared_with_the_long_baseline_by_its_final_loss():
    short = long_record("baseline_compression", [7.0, 4.3], steps=19, warmup=6)
    base = long_record("baseline_compression", [7.0, 4.0, 1.20], variant="--long-run")
    rec = long_record("optimized_compression_powersgd", [7.0, 5.0, 1.25],
                      baseline="baseline_compression", variant="--rank 8 --long-run",
                      loss_tolerance=None,
                      loss_tolerance_final_rel=powersgd.FINAL_LOSS_TOLERANCE)
    by_key = {common.run_key(r) + (results_table.script_label(r),): r for r in (short, base)}
    assert results_table.baseline_run(rec, by_key) is base  # the 100-step one, not the 25-step one
    assert results_table.why_not_compared(rec, base) is None  # the same steps and warm-up
    # 1.0 apart at step 2, far over a per-step bound, and 4.2% at the end: within 5%
    assert results_table.max_loss_diff(rec["losses"], base["losses"]) == pytest.approx(1.0)
    assert not results_table.over_tolerance(rec, base)
    assert results_table.over_tolerance({**rec, "losses": [7.0, 4.0, 1.27]}, base)  # 5.8% over
    assert results_table.over_tolerance({**rec, "losses": [7.0, 4.0, 1.13]}, base)  # 5.8% under
    per_step = {**rec, "loss_tolerance": 0.2, "loss_tolerance_final_rel": None}
    assert results_table.over_tolerance(per_step, base)  # the other kind: the largest step's 1.0


# --- Both hooks on real process groups ------------------------------------------------------------
LENGTHS = [6 * BLOCK, 1000, 4099]  # divides every world size's chunks, and two that do not


def int8_bound(grads: torch.Tensor, world: int) -> torch.Tensor:
    """Per-value bound on |int8 average - fp32 average| for one step from zero residuals:
    half a step of each sender's block scale (averaged), plus half a step of the owner's."""
    length = grads.shape[1]
    padded = math.ceil(length / (world * BLOCK)) * world * BLOCK
    blocks = torch.nn.functional.pad(grads, (0, padded - length)).view(world, -1, BLOCK)
    # (1 + 1/127): a step's compensated gradient carries the last residual, half a step more
    sender = (blocks.abs().amax(dim=2) / 254).mean(0) * (1 + 1 / 127)  # per block
    owner = (blocks.mean(0).abs().amax(dim=1) / 254 + sender) * (1 + 1 / 127)
    return (sender + owner).repeat_interleave(BLOCK)[:length] * (1 + 1e-5)


def gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.new_empty(world * t.numel())
    common.all_gather_single(out, t.flatten())
    return out.view(world, *t.shape)


def units_on(group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Three INT8 and three PowerSGD steps on `group`, each rank's gradients seeded by its rank
    in the group: what the units return, and the bytes they count."""
    found, me = {}, dist.get_rank(group)
    state, out = int8.Int8State(BLOCK, 0, group=group), []
    for step in range(3):
        grad = torch.randn(4099, generator=torch.Generator().manual_seed(10 * step + me))
        out.append(int8.int8_allreduce(state, 0, grad).wait().clone())
    found["int8"], found["int8_sent"] = torch.stack(out), torch.tensor(state.sent_bytes)
    state, out = powersgd.PowerSGDState(2, 0, seed=0, group=group), []
    for step in range(3):
        grad = torch.randn(96 * 80 + 80, generator=torch.Generator().manual_seed(10 * step + me))
        out.append(powersgd.powersgd_allreduce(state, 0, grad, [torch.Size([96, 80]),
                                                               torch.Size([80])],
                                               [True, False]).wait().clone())
    found["powersgd"], found["powersgd_sent"] = torch.stack(out), torch.tensor(state.sent_bytes)
    return found


def gradients_with_the_embedding_and_head_whole(model: torch.nn.Module, rank: int) -> dict:
    """One step of `model` under DDP with PowerSGD (rank 4, from the first step) given its
    input embedding's and output head's weights to keep whole, beside plain DDP from the same
    weights: name -> (PowerSGD's gradient, plain DDP's)."""
    plain = DDP(copy.deepcopy(model))
    whole = [common.input_embedding(model).weight, common.output_head(model).weight]
    compressed = DDP(model)
    compressed.register_comm_hook(powersgd.PowerSGDState(4, 0, seed=0, uncompressed=whole),
                                  powersgd.powersgd_hook)
    tokens = torch.randint(128, (2, 33), generator=torch.Generator().manual_seed(rank))
    for ddp in (plain, compressed):
        ddp(tokens[:, :-1], tokens[:, 1:]).backward()
    return {name: (p.grad, q.grad) for (name, p), q in
            zip(compressed.module.named_parameters(), plain.module.parameters(), strict=True)}


def a_rank_too_high(rank: int) -> tuple[list[int], list[str]]:
    """Three steps of tiny's Llama under DDP with PowerSGD at rank 32 (its widest matrix, 192 x
    64, compresses up to rank 23), compressing from the second: the matrices compressed each step,
    and what each rank of the group printed."""
    model = DDP(common.Llama(common.SIZES["tiny"]))
    state = powersgd.PowerSGDState(32, start_iter=1, seed=0)
    model.register_comm_hook(state, powersgd.powersgd_hook)
    tokens = torch.randint(128, (2, 33), generator=torch.Generator().manual_seed(rank))
    counts, printed = [], [None] * dist.get_world_size()
    with contextlib.redirect_stdout(io.StringIO()) as log:
        for _ in range(3):
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            counts.append(state.compressed_matrices)
    dist.all_gather_object(printed, log.getvalue())
    return counts, printed


def collective_checks(rank: int, world: int, init_file: str, out_file: str,
                      readme: tuple[list[int], str] | None = None) -> None:
    """Run on every rank of a spawned gloo group; rank 0 saves what the tests assert. Then,
    given `readme` (ports, file: the world of 2's), the README trainers."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    found = {}
    for length in LENGTHS:  # one int8 step against the exact average
        gen = torch.Generator().manual_seed(1000 * length + rank)
        grad = torch.randn(length, generator=gen) * torch.logspace(-3, 1, length)
        state = int8.Int8State(BLOCK, start_iter=0)
        approx = int8.int8_allreduce(state, 0, grad.clone()).wait()
        grads = gathered(grad, world)
        found[f"int8_{length}"] = ((approx - grads.mean(0)).abs(), int8_bound(grads, world),
                                   state.sent_bytes)

    # Error feedback over k steps: what was applied + the residuals left = what was true.
    state, length, applied, true = int8.Int8State(BLOCK, 0), 4099, 0, 0
    for step in range(8):
        gen = torch.Generator().manual_seed(step * world + rank)
        grad = torch.randn(length, generator=gen)
        grad[:BLOCK] = 1e-3 * (rank + 1)  # rounds to zero beside a block-mate of 1.0 ...
        grad[0] = 1.0  # ... so without feedback it would never be applied
        applied = applied + int8.int8_allreduce(state, 0, grad.clone()).wait()
        true = true + gathered(grad, world).mean(0)
        one_step = int8_bound(gathered(grad, world), world)
    sender = gathered(state.buffers[0].sender_residual, world).mean(0).flatten()[:length]
    owner = gathered(state.buffers[0].owner_residual, world).flatten()[:length]
    found["int8_feedback"] = (applied, true, sender + owner, one_step)
    try:  # a bucket that grows by a block per rank would misalign the residuals
        int8.int8_allreduce(state, 0, torch.zeros(length + world * BLOCK))
    except RuntimeError as error:
        found["int8_resized"] = str(error)

    # Pieces change nothing: three steps with chunks cut into pieces of 2 blocks (one ends inside
    # the bucket's last block, one lies wholly in the padding) give the bits of one piece each.
    default, found["int8_pieces"] = int8.CPU_PIECE, []
    for piece in (default, 2 * BLOCK):
        int8.CPU_PIECE, state, out = piece, int8.Int8State(BLOCK, 0), []
        for step in range(3):
            grad = torch.randn(4099, generator=torch.Generator().manual_seed(step * world + rank))
            out.append(int8.int8_allreduce(state, 0, grad).wait().clone())
        found["int8_pieces"].append((torch.stack(out), len(state.buffers[0].pieces)))
    int8.CPU_PIECE = default

    # PowerSGD: a rank-r mean (shared column space, different rows per rank) comes back exactly;
    # a bias and a full-rank matrix marked uncompressed, in the same bucket, are averaged exactly.
    gen = torch.Generator().manual_seed(7)
    columns = torch.randn(96, 4, generator=gen)
    rows = torch.randn(80, 4, generator=torch.Generator().manual_seed(100 + rank))
    bias = torch.randn(80, generator=torch.Generator().manual_seed(200 + rank))
    embedding = torch.randn(64, 48, generator=torch.Generator().manual_seed(300 + rank))
    state = powersgd.PowerSGDState(4, start_iter=0, seed=0)
    flat = torch.cat([(columns @ rows.T).flatten(), bias, embedding.flatten()])
    shapes = [torch.Size([96, 80]), bias.shape, embedding.shape]
    out = powersgd.powersgd_allreduce(state, 0, flat.clone(), shapes, [True, False, False]).wait()
    found["powersgd_exact"] = (out, gathered(flat, world).mean(0), state.sent_bytes)
    # a bucket with nothing to compress is one plain all-reduce
    state = powersgd.PowerSGDState(4, start_iter=0, seed=0)
    found["powersgd_plain"] = (powersgd.powersgd_allreduce(state, 0, bias.clone(), [bias.shape],
                                                           [False]).wait(),
                               gathered(bias, world).mean(0), state.sent_bytes)

    # PowerSGD error feedback on full-rank gradients, warm-started across steps.
    state, applied, true = powersgd.PowerSGDState(2, start_iter=0, seed=0), 0, 0
    shapes = shapes[:2]
    for step in range(6):
        grad = torch.randn(96 * 80 + 80, generator=torch.Generator().manual_seed(step + 10 * rank))
        applied = applied + powersgd.powersgd_allreduce(state, 0, grad.clone(), shapes,
                                                        [True, False]).wait()
        true = true + gathered(grad, world).mean(0)
    found["powersgd_feedback"] = (applied, true, gathered(state.residual[0], world).mean(0),
                                  state.sent_bytes)

    # PowerSGD on bf16 gradients: P, Q and the residual in bf16, the orthogonalization in fp32.
    state = powersgd.PowerSGDState(4, start_iter=0, seed=0)
    grad = torch.cat([(columns @ rows.T).flatten(), bias]).bfloat16()
    out = powersgd.powersgd_allreduce(state, 0, grad.clone(), shapes, [True, False]).wait()
    found["powersgd_bf16"] = (out, gathered(grad.float(), world).mean(0), state.sent_bytes,
                              [str(t.dtype) for t in (out, state.qs[0][0], state.residual[0])])

    # The weights kept whole are found by identity: the GPT's tied embedding/head (one tensor),
    # the Llama's untied embed_tokens and lm_head.
    size = common.SIZES["tiny"]
    torch.manual_seed(0)
    found["whole_gpt"] = gradients_with_the_embedding_and_head_whole(common.GPT(size, 32), rank)
    found["whole_llama"] = gradients_with_the_embedding_and_head_whole(common.Llama(size), rank)
    found["too_high"] = a_rank_too_high(rank)

    # The units on a sub-group, ranks {0, 1} of a world of 3 (rank 2 idle), as on a world of 2.
    if world == 2:
        found["pair"] = units_on(None)
    elif world == 3:
        pair = dist.new_group([0, 1])  # every rank takes part in making it
        if rank < 2:
            found["pair"] = units_on(pair)
    # rank 2 of 3, idle while the pair works, waits for it: tearing its group down under the
    # pair's traffic can abort the process (gloo: "terminate called without an active exception")
    dist.barrier()
    if rank == 0:
        torch.save(found, out_file)
    dist.destroy_process_group()
    if readme is not None:
        train_with_the_readme_lines(rank, world, *readme)


@pytest.fixture(scope="module")
def spawned_in(tmp_path_factory):
    """world size -> the folder where collective_checks' rank 0 left what it found (found.pt;
    the world of 2's README trainers', readme.pt), spawned once per world size. Only the world
    of 2's processes import `transformers`, for the README's lines."""
    folders = {}

    def at(world: int) -> Path:
        if world not in folders:
            folder = tmp_path_factory.mktemp(f"world{world}")
            readme = ([common.free_port() for _ in trainers()], str(folder / "readme.pt")) \
                if world == 2 else None
            mp.spawn(functools.partial(run_then_leave, collective_checks),
                     args=(world, str(folder / "init"), str(folder / "found.pt"), readme),
                     nprocs=world)
            folders[world] = folder
        return folders[world]

    return at


@pytest.fixture(scope="module")
def spawned(spawned_in):
    """world size -> what collective_checks' rank 0 found."""
    found = {}

    def at(world: int) -> dict:
        if world not in found:
            found[world] = torch.load(spawned_in(world) / "found.pt")
        return found[world]

    return at


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def collectives(request, spawned):
    return request.param, spawned(request.param)


@pytest.mark.parametrize("length", LENGTHS)
def test_int8_reduce_scatter_all_gather_matches_fp32_all_reduce_within_the_bound(collectives,
                                                                                 length):
    world, found = collectives
    error, bound, sent = found[f"int8_{length}"]
    assert (error <= bound).all(), (error - bound).max()
    assert error.max() > 0  # it did quantize
    chunk = math.ceil(length / (world * BLOCK)) * BLOCK
    assert sent == 2 * (world - 1) * (chunk + 4 * chunk // BLOCK)  # payload and scales, to peers


def test_int8_in_pieces_gives_the_bits_of_one_piece_per_chunk(collectives):
    world, found = collectives
    (whole, pieces_whole), (in_pieces, pieces) = found["int8_pieces"]
    blocks = math.ceil(4099 / (world * BLOCK))  # per chunk
    assert pieces_whole == 1 and pieces == math.ceil(blocks / 2)
    assert torch.equal(whole, in_pieces)


def test_int8_refuses_a_bucket_that_changed_size_and_says_what_to_raise(collectives):
    _, found = collectives
    assert "changed size" in found["int8_resized"] and "--start-iter" in found["int8_resized"]


def test_int8_error_feedback_delays_gradient_and_never_loses_it(collectives):
    _, found = collectives
    applied, true, residual, one_step = found["int8_feedback"]
    assert torch.allclose(applied + residual, true, atol=1e-5)
    assert ((applied - true).abs() <= one_step).all()
    # the 1e-3 values beside a 1.0 round to zero every single step, yet arrive in the sum
    assert applied[1:BLOCK].abs().min() > 0


def test_powersgd_returns_a_rank_r_average_exactly_and_averages_the_rest(collectives):
    world, found = collectives
    out, exact, sent = found["powersgd_exact"]
    assert (out - exact).abs().max() <= 1e-5 * exact.abs().max()  # float rounding
    # P (96 x 4) with the bias and the uncompressed 64 x 48 in one all-reduce, then Q (80 x 4)
    assert sent == pytest.approx(2 * (world - 1) / world * 4 * (96 * 4 + 80 + 64 * 48 + 80 * 4))


def test_powersgd_sends_a_bucket_with_no_matrix_worth_compressing_in_one_all_reduce(collectives):
    world, found = collectives
    out, exact, sent = found["powersgd_plain"]
    assert torch.allclose(out, exact) and sent == 2 * (world - 1) / world * 4 * 80


def test_powersgd_error_feedback_keeps_what_the_approximation_dropped(collectives):
    world, found = collectives
    applied, true, residual, sent = found["powersgd_feedback"]
    assert torch.allclose(applied + residual, true, atol=1e-4)
    assert residual.abs().max() > 0.1  # rank 2 of a random 96 x 80 matrix drops a lot
    # per step, one all-reduce of P (96 x 2) with the bias (80), one of Q (80 x 2); the count
    # runs over the 6 steps (the hook, not called here, resets it every step)
    assert sent == pytest.approx(6 * 2 * (world - 1) / world * 4 * (96 * 2 + 80 + 80 * 2))


def test_powersgd_runs_on_bf16_gradients_in_bf16(collectives):
    world, found = collectives
    out, exact, sent, dtypes = found["powersgd_bf16"]
    assert dtypes == ["torch.bfloat16"] * 3  # the result, Q, the error-feedback residual
    # a rank-4 mean, exact in fp32 (above), here to bf16's 8 bits, through two all-reduces
    # whose bf16 sums cancel (each rank's rows differ): a few % of the mean, not a rank-4
    # approximation's error (tens of %, the feedback test)
    error = out.float() - exact
    assert error.norm() <= 5e-2 * exact.norm() and error.abs().max() <= 5e-2 * exact.abs().max()
    assert sent == pytest.approx(2 * (world - 1) / world * 2 * (96 * 4 + 80 + 80 * 4))


@pytest.mark.parametrize("model, whole", [
    ("gpt", {"tok_emb.weight"}),  # tied: the head is the same tensor, listed once
    ("llama", {"model.embed_tokens.weight", "lm_head.weight"})])
def test_powersgd_keeps_the_embedding_and_head_whole_by_identity_tied_or_not(collectives, model,
                                                                             whole):
    _, found = collectives
    grads = found[f"whole_{model}"]
    assert whole <= set(grads)
    for name, (got, plain) in grads.items():
        matrix = powersgd.as_matrix(got)
        if name in whole or not powersgd.worth_compressing(matrix, 4):
            assert torch.allclose(got, plain, atol=1e-6), name  # averaged exactly
        else:  # a rank-4 approximation of one step's gradient
            assert (got - plain).abs().max() > 1e-4, name


def test_powersgd_at_a_rank_too_high_for_every_matrix_says_so_once_on_the_first_rank(
        collectives):
    world, found = collectives
    counts, printed = found["too_high"]
    assert counts == [0, 0, 0]  # a plain step, then two sent whole: plain DDP
    assert printed[0] == powersgd.no_matrix_compressed(32) + "\n"  # once, at the first
    assert "rank 32 compresses no matrix" in printed[0] and "--rank" in printed[0]
    assert printed[1:] == [""] * (world - 1)


def test_the_units_on_ranks_0_and_1_of_three_give_what_they_give_on_a_world_of_two(spawned):
    two, three = spawned(2)["pair"], spawned(3)["pair"]
    assert set(two) == set(three) == {"int8", "int8_sent", "powersgd", "powersgd_sent"}
    for name in two:
        assert torch.equal(two[name], three[name]), name


# --- The README's "Use it in your trainer", on HuggingFace models -------------------------------
TRAINER_STEPS = 4  # the snippets' 2 plain steps, then 2 compressed
BF16_STEPS = 3  # the plain steps and one compressed, in bf16
# (section heading, the recipe's loss tolerance in fp32): PowerSGD's, then INT8's
SECTIONS = [("## Use it in your trainer", powersgd.LOSS_TOLERANCE["fp32"]),
            ("## Use INT8 in your trainer", int8.LOSS_TOLERANCE["fp32"])]


def group_mean(losses: list[float]) -> list[float]:
    """Each step's loss averaged over the ranks: what hf_models.ddp_losses returns."""
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def readme_models() -> dict[str, dict]:
    """The models the README's lines run on, by name: hf_models.tiny_model's arguments. Each of
    hf_models.CASES (three families, sdpa and eager) and the two models with a feature some
    recipes do not implement: a hook compresses whatever gradients DDP buckets, so both must
    train like DDP within the tolerance."""
    import hf_models

    models = {str(case): dict(family=case.family, attn_implementation=case.attn, tied=case.tied)
              for case in hf_models.CASES}
    models.update({name: dict(family=name) for name in hf_models.UNSUPPORTED})
    return models


def trainers() -> list[tuple[str, str, dict]]:
    """(heading, name, tiny_model's arguments) of every run: both blocks on each of
    readme_models(), then PowerSGD's on each family's sdpa case in bf16."""
    import hf_models

    models = readme_models()
    runs = [(heading, name, args) for name, args in models.items() for heading, _ in SECTIONS]
    return runs + [(SECTIONS[0][0], f"{case} bf16", {**models[str(case)], "dtype": torch.bfloat16})
                   for case in hf_models.CASES if case.attn == "sdpa"]


def train_with_the_readme_lines(rank: int, world: int, ports: list[int], out_file: str) -> None:
    """Trainers of one's own: each joins the group (the README's `common.setup()`), runs one of
    the README's blocks as it is on a model its ranks seeded differently, and leaves; in fp32
    beside PyTorch's DDP on the same model and global batch (`trainers()`)."""
    import hf_models  # here: `transformers` costs every process that imports it seconds

    as_rank(rank, world)
    sys.path.insert(0, str(FOLDER))  # where the trainer copied the recipes
    batches = hf_models.token_batches(TRAINER_STEPS, rank, world)
    found, ddp = {}, {}
    for (heading, name, model_args), port in zip(trainers(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        torch.manual_seed(rank)
        model = hf_models.tiny_model(**model_args)
        reference = copy.deepcopy(model)
        bf16 = model_args.get("dtype") == torch.bfloat16
        lines = {"model": model, "batches": batches[:BF16_STEPS] if bf16 else batches}
        exec(readme_python_block(FOLDER / "README.md", heading), lines)
        state = lines.get("state")
        if bf16:
            found[heading, name] = {
                "dtypes": {str(t.dtype) for p in lines["model"].parameters() for t in (p, p.grad)},
                "compressed": state.compressed_matrices}
        else:
            if name not in ddp:  # the same reference for both hooks
                ddp[name] = (hf_models.ddp_losses(reference, batches),
                             hf_models.seeded_apart(reference))
            found[heading, name] = {
                "readme": group_mean(lines["losses"]), "ddp": ddp[name][0],
                "seeded_apart": ddp[name][1],
                **({"rank": state.rank, "compressed": state.compressed_matrices} if state else {})}
        dist.destroy_process_group()
    if rank == 0:
        torch.save(found, out_file)


@pytest.fixture(scope="module")
def readme_runs(spawned_in):
    """What the README trainers' rank 0 found, by (heading, model name), in the world of 2."""
    return torch.load(spawned_in(2) / "readme.pt")


def of_section(readme_runs: dict, heading: str) -> dict:
    """model name -> what the trainer of `heading`'s block found on it."""
    return {name: found for (h, name), found in readme_runs.items() if h == heading}


@pytest.mark.parametrize("heading, tolerance", SECTIONS, ids=["powersgd", "int8"])
def test_the_readme_lines_train_every_model_like_ddp_within_the_tolerance(readme_runs, heading,
                                                                          tolerance):
    runs = {name: run for name, run in of_section(readme_runs, heading).items()
            if not name.endswith("bf16")}
    assert set(runs) == set(readme_models())
    for name, found in runs.items():
        readme, ddp = found["readme"], found["ddp"]
        assert found["seeded_apart"], name
        diffs = [abs(a - b) for a, b in zip(readme, ddp, strict=True)]
        assert max(diffs[:2]) <= 1e-5 * ddp[0], name  # the plain steps, then compressed ones
        assert 0 < max(diffs) <= tolerance, name
        assert readme[-1] < readme[0], name


def test_the_readme_picks_a_rank_that_compresses_every_matrix_of_a_narrow_model(readme_runs):
    """Hidden size 64: rank 32 would compress nothing. The families' highest rank is their
    32 x 64 key and value projections' (10), and every layer's 7 matrices are products; Phi-3's
    fused q/k/v (128 x 64) and gate/up (384 x 64) leave its 64 x 64 o_proj the smallest (15),
    and its 4 matrices a layer."""
    layers = common.SIZES["tiny"].n_layers
    for name, found in of_section(readme_runs, SECTIONS[0][0]).items():
        if not name.endswith("bf16"):
            expected = (15, 4 * layers) if name == "fused" else (10, 7 * layers)
            assert (found["rank"], found["compressed"]) == expected, name


def test_the_readme_lines_keep_bf16_weights_and_gradients_bf16(readme_runs):
    import hf_models

    bf16 = {name: found for name, found in of_section(readme_runs, SECTIONS[0][0]).items()
            if name.endswith("bf16")}
    assert {name.split("-")[0] for name in bf16} == set(hf_models.FAMILIES)
    for name, found in bf16.items():
        assert found["dtypes"] == {"torch.bfloat16"}, name
        assert found["compressed"] == 7 * common.SIZES["tiny"].n_layers, name
