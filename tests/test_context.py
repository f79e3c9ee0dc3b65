"""Unit tests for 07_context's ring attention (optimized_context_ring.py): its block schedule, its
pair counts and byte formula, and the ring itself on 2, 3 and 4 CPU ranks.

The ring runs in one spawned world of 4 gloo processes (`world_of_4`, which
tests/test_context_ulysses.py's checks share: one spawn for the folder), on groups of 4, 2 and 3
of its ranks; each rank compares its shard of the ring's output and of dQ, dK, dV with PyTorch's
fused attention over the whole sequence, for every combination of balance, head layout and
overlap, runs the measuring wrapper (MeasuredRingAttention) beside it, and rank 0 saves what all
ranks found for the tests to assert on here.
"""

import functools
import itertools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import (
    assert_bad_input_is_one_line,
    assert_skipped_with_why,
    load_recipe,
    run_then_leave,
)

SCRIPT = common.ROOT / "07_context" / "optimized_context_ring.py"
ring = load_recipe(SCRIPT)
HEADS = {"equal": (4, 4), "gqa": (4, 2)}  # (query heads, KV heads): a GPT's, a Llama's
COMBOS = list(itertools.product([True, False], HEADS, [True, False]))  # zigzag, heads, overlap


def computed_pairs(T: int, cp: int, zigzag: bool) -> list[list[tuple[int, int]]]:
    """Each rank's (query position, key position) pairs over the ring's steps, by the schedule."""
    positions = [common.sequence_positions(T, r, cp, zigzag).tolist() for r in range(cp)]
    found = []
    for rank in range(cp):
        mine = []
        for step in range(cp):
            source = (rank - step) % cp
            block = ring.block_schedule(rank, source, cp, len(positions[rank]), zigzag)
            if block:
                rows, cols, causal = block
                mine += [(q, k) for i, q in enumerate(positions[rank][rows])
                         for j, k in enumerate(positions[source][cols]) if not causal or j <= i]
        found.append(mine)
    return found


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_the_schedule_computes_each_causal_pair_once_and_no_masked_one(cp, zigzag):
    T = 4 * cp
    pairs = [pair for rank in computed_pairs(T, cp, zigzag) for pair in rank]
    assert sorted(pairs) == [(q, k) for q in range(T) for k in range(q + 1)]


def test_the_schedule_on_two_zigzag_ranks():
    every, first, second = slice(0, 8), slice(0, 4), slice(4, 8)
    assert ring.block_schedule(0, 0, 2, 8, True) == (every, every, True)
    assert ring.block_schedule(1, 0, 2, 8, True) == (every, first, False)  # chunk 0 before both
    assert ring.block_schedule(0, 1, 2, 8, True) == (second, every, False)  # chunk 3 after both
    assert ring.block_schedule(1, 0, 2, 8, False) == (every, every, False)
    assert ring.block_schedule(0, 1, 2, 8, False) is None  # the ring passes K/V on, unused


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_pair_counts_balance_zigzag_and_grow_to_2cp_minus_1_unbalanced(cp):
    c = 1024  # tokens a chunk, unbalanced
    for zigzag in (True, False):
        T = c * cp
        counts = []
        for rank in range(cp):
            length = T // cp
            schedule = [ring.block_schedule(rank, (rank - step) % cp, cp, length, zigzag)
                        for step in range(cp)]
            count = sum(ring.block_pairs(rows.stop - rows.start, cols.stop - cols.start, causal)
                        for rows, cols, causal in filter(None, schedule))
            positions = common.sequence_positions(T, rank, cp, zigzag)
            assert count == ring.attention_flops(positions, 1) / 4  # the theory's own count
            counts.append(count)
        if zigzag:
            assert max(counts) == min(counts)
        else:
            assert max(counts) / min(counts) == 1 + 2 * (cp - 1) * c / (c + 1)
            assert max(counts) / min(counts) == pytest.approx(2 * cp - 1, rel=0.01)


def test_ring_bytes_by_hand():
    # a block: 2 sequences x 2 KV heads x 64/4 tokens x 8 = 512 values; a layer: K and V 3 times
    # forward and 3 in backward in 2 bytes, dK and dV 4 times in 4 bytes
    per_layer = 2 * 3 * 512 * 2 + 2 * 3 * 512 * 2 + 2 * 4 * 512 * 4
    assert ring.ring_bytes(2, 64, 2, 8, 4, 3, value_bytes=2, grad_bytes=4) == 3 * per_layer
    assert ring.ring_bytes(2, 64, 2, 8, 1, 3, value_bytes=4) == 0


def test_merge_is_attention_over_the_union_of_two_key_blocks():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(3))
    out, lse = ring.block_forward(q, k[:, :, :2], v[:, :, :2], False)
    block_out, block_lse = ring.block_forward(q, k[:, :, 2:], v[:, :, 2:], False)
    ring.merge(out, lse, block_out, block_lse)
    whole, whole_lse = ring.block_forward(q, k, v, False)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-6, rtol=1e-5)


def ring_against_one_kernel(group: dist.ProcessGroup, zigzag: bool, heads: str, overlap: bool
                            ) -> dict:
    """This rank's largest differences from causal_sdpa over the whole sequence, the bytes it
    sent against ring_bytes; and the measuring wrapper's run: whether its output and gradients
    are the ring's to the bit, its pair count against the theory's, its kernel seconds."""
    cp, rank = group.size(), group.rank()
    B, D, T = 2, 8, 8 * cp
    n_heads, kv_heads = HEADS[heads]
    gen = torch.Generator().manual_seed(cp)
    q, k, v, dout = (torch.randn(B, h, T, D, generator=gen)
                     for h in (n_heads, kv_heads, kv_heads, n_heads))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = common.causal_sdpa(*full)
    expected.backward(dout)
    positions = common.sequence_positions(T, rank, cp, zigzag)
    mine = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    attention = ring.RingAttention(group, zigzag=zigzag, overlap=overlap)
    with common.CollectiveBytes() as sent:
        out = attention(*mine)
        out.backward(dout[:, :, positions])
    errors = [(out - expected[:, :, positions]).abs().max().item()]
    errors += [(t.grad - f.grad[:, :, positions]).abs().max().item()
               for t, f in zip(mine, full, strict=True)]
    measured = ring.MeasuredRingAttention(group, zigzag=zigzag, overlap=overlap)
    again = [t.detach().clone().requires_grad_() for t in mine]
    measured_out = measured(*again)
    measured_out.backward(dout[:, :, positions])
    unchanged = torch.equal(measured_out, out) and all(
        torch.equal(a.grad, t.grad) for a, t in zip(again, mine, strict=True))
    return {"errors": errors, "sent": sent.bytes, "kinds": sorted(sent.by_kind),
            "ring_bytes": ring.ring_bytes(B, T, kv_heads, D, cp, 1, 4, 4),
            "measured_unchanged": unchanged, "kernel_s": measured.kernel_s,
            "pairs": measured.pairs, "theory_pairs":
            B * n_heads * ring.attention_flops(positions, 1) / 4}


# The groups one spawned world of 4 runs the ring on: cp 4, cp 2 on two groups whose ranks are
# not neighbours (0 with 2, 1 with 3: the ring's peers are the group's, not the world's), and
# cp 3 on ranks 0-2 (rank 3 alone, a ring of one).
GROUPS = {"cp 4": None, "cp 2": [[0, 2], [1, 3]], "cp 3": [[0, 1, 2], [3]]}


def ring_checks(world: int) -> dict:
    """Every combination on each of GROUPS, on this rank."""
    groups = {name: dist.new_subgroups_by_enumeration(ranks)[0] if ranks else dist.group.WORLD
              for name, ranks in GROUPS.items()}
    return {(name, *combo): ring_against_one_kernel(group, *combo)
            for name, group in groups.items() for combo in COMBOS}


def world_checks(rank: int, world: int, init_file: str, out_file: str) -> None:
    """The ring's checks, then Ulysses' and torch's context_parallel's (test_context_ulysses'),
    on every rank of one spawned gloo world; rank 0 saves what every rank found."""
    import test_context_ulysses  # here: it imports this module for `world_of_4`

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    found = {"ring": ring_checks(world), "ulysses": test_context_ulysses.checks(world)}
    everyone = [None] * world
    dist.all_gather_object(everyone, found)
    if rank == 0:
        torch.save(everyone, out_file)
    dist.destroy_process_group()


@functools.cache
def world_of_4() -> list[dict]:
    """What each rank found in one spawned world of 4 (`world_checks`), by check: spawned once a
    session for both of the folder's unit-test files."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(functools.partial(run_then_leave, world_checks),
                 args=(4, str(Path(folder) / "init"), str(Path(folder) / "found.pt")), nprocs=4)
        return torch.load(Path(folder) / "found.pt")


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """Each rank's findings on the ring."""
    return [found["ring"] for found in world_of_4()]


def findings(spawned: list[dict], group: str) -> list[tuple[int, tuple, dict]]:
    """(rank, case, what it found) for the ranks of `group`'s rings of more than one rank."""
    rings = GROUPS[group] or [range(4)]
    return [(rank, case, got) for rank, found in enumerate(spawned)
            for case, got in found.items() if case[0] == group
            and any(rank in ring and len(ring) > 1 for ring in rings)]


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_ring_equals_one_fused_attention_over_the_sequence(spawned, group):
    found = findings(spawned, group)
    assert len(found) == len(COMBOS) * (4 if group != "cp 3" else 3)
    for rank, case, got in found:
        assert max(got["errors"]) <= 1e-5, (rank, case, got["errors"])


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_ring_sends_what_ring_bytes_says_and_computes_the_theorys_pairs(spawned, group):
    for _, case, got in findings(spawned, group):
        assert got["sent"] == got["ring_bytes"] > 0, case
        assert got["kinds"] == ["send float32"], case
        # counted by the measuring wrapper around the block kernels, which changes nothing
        assert got["pairs"] == got["theory_pairs"], case
        assert got["measured_unchanged"] and got["kernel_s"] > 0, case


def test_a_length_that_does_not_cut_refuses_in_one_line_naming_cp(tmp_path):
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--seq-len", "100"],
                                 "--seq-len 100 does not cut into 8 equal chunks", tmp_path,
                                 WORLD_SIZE="4")
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--seq-len", "100", "--balance",
                                          "none"], "multiple of 8 (--cp 8)", tmp_path,
                                 WORLD_SIZE="8")
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--seq-len", "34", "--cp", "2"],
                                 "multiple of 4 (--cp 2)", tmp_path, WORLD_SIZE="4")


@pytest.mark.parametrize("world", ["4", "2"])
def test_a_world_that_cp_does_not_divide_is_skipped_with_why(tmp_path, monkeypatch, world):
    """A host's world, not the flag, is short or odd (the Makefile's dp 2 x cp 2 run on 3 GPUs):
    the row says so, as for any world a technique cannot use."""
    monkeypatch.setenv("WORLD_SIZE", world)
    assert_skipped_with_why(SCRIPT, ["--size", "tiny", "--cp", "3"], "a multiple of 3", tmp_path)


def test_a_resnet_is_skipped_with_why(tmp_path):
    assert_skipped_with_why(SCRIPT, ["--model", "resnet"], "no sequence to split", tmp_path)


# --- What a transformers model asks of the attention: computed, or refused in one line -----------
class Attention(torch.nn.Module):
    """What transformers hands an attention function as `module`: a decoder's attention."""
    is_causal = True


QUERY = torch.zeros(1, 4, 16, 8)  # (B, heads, T/cp, head_dim): 32 tokens at cp 2
WHAT_LLAMA_PASSES = {"dropout": 0.0, "scaling": 8 ** -0.5, "position_ids": torch.arange(16)[None],
                     "use_cache": True}


@pytest.mark.parametrize("kwargs", [
    {}, WHAT_LLAMA_PASSES, {**WHAT_LLAMA_PASSES, "sliding_window": None},  # Qwen2's
    {**WHAT_LLAMA_PASSES, "sliding_window": 4096}, {"sliding_window": 32},  # no shorter window
    {"softcap": None, "is_causal": True, "output_attentions": False, "cache_position": QUERY}],
    ids=["nothing", "llama", "qwen2", "mistral", "window = sequence", "unset"])
def test_causal_attention_with_the_default_scale_is_computed(kwargs):
    assert ring.unsupported_attention(Attention(), QUERY, None, 2, **kwargs) is None


@pytest.mark.parametrize("mask, kwargs, hint", [
    (torch.ones(1, 1, 32, 32), {}, "attention_mask: this causal attention takes no mask"),
    (None, {"sliding_window": 31}, "sliding_window 31 is shorter than the 32-token sequence"),
    (None, {"softcap": 50.0}, "softcap 50.0 (attn_logit_softcapping)"),
    (None, {"scaling": 0.125}, "scaling 0.125 is not 1/sqrt(head_dim) = 0.353553"),
    (None, {"dropout": 0.1}, "dropout 0.1 (attention_dropout): set attention_dropout=0"),
    (None, {"is_causal": False}, "is_causal False (Attention): this attention is causal only"),
    (None, {"s_aux": torch.zeros(4)}, "s_aux: an attention argument this attention does not"),
], ids=["mask", "window", "softcap", "scaling", "dropout", "is_causal", "unknown"])
def test_what_the_attention_does_not_compute_is_named_in_one_line(mask, kwargs, hint):
    problem = ring.unsupported_attention(Attention(), QUERY, mask, 2, **kwargs)
    assert problem.startswith(hint) and "\n" not in problem, problem


def test_a_non_causal_module_is_refused_as_its_flag_says():
    encoder = Attention()
    encoder.is_causal = False
    assert ring.unsupported_attention(encoder, QUERY, None, 2).startswith("is_causal False")

