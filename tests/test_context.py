"""Unit tests for 07_context's ring attention (optimized_context_ring.py): its block schedule, its
pair counts and byte formula, and the ring itself on 2, 3 and 4 CPU ranks.

The ring runs once per world size in spawned gloo processes (a module-scoped fixture); each
rank compares its shard of the ring's output and of dQ, dK, dV with PyTorch's fused attention
over the whole sequence, for every combination of balance, head layout and overlap, and rank 0
saves what all ranks found for the tests to assert on here.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import assert_bad_input_is_one_line, assert_skipped_with_why, load_recipe

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
            count = sum(ring.block_pairs(*block) for step in range(cp) if (
                block := ring.block_schedule(rank, (rank - step) % cp, cp, length, zigzag)))
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
    sent against ring_bytes, and its pair count against the theory's."""
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
    return {"errors": errors, "sent": sent.bytes, "kinds": sorted(sent.by_kind),
            "ring_bytes": ring.ring_bytes(B, T, kv_heads, D, cp, 1, 4, 4),
            "pairs": attention.pairs, "theory_pairs":
            B * n_heads * ring.attention_flops(positions, 1) / 4}


def ring_checks(rank: int, world: int, init_file: str, out_file: str) -> None:
    """Every combination on the world's group; at 4 ranks also on two groups of 2 whose ranks are
    not neighbours (0 with 2, 1 with 3): the ring's peers are the group's, not the world's."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    groups = {"world": dist.group.WORLD}
    if world == 4:
        groups["pairs"], _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    found = {(name, *combo): ring_against_one_kernel(group, *combo)
             for name, group in groups.items() for combo in COMBOS}
    everyone = [None] * world
    dist.all_gather_object(everyone, found)
    if rank == 0:
        torch.save(everyone, out_file)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world size -> each rank's findings, spawned once per world size."""
    found = {}

    def at(world: int) -> list[dict]:
        if world not in found:
            folder = tmp_path_factory.mktemp(f"world{world}")
            mp.spawn(ring_checks, args=(world, str(folder / "init"), str(folder / "found.pt")),
                     nprocs=world)
            found[world] = torch.load(folder / "found.pt")
        return found[world]

    return at


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ring_equals_one_fused_attention_over_the_sequence(spawned, world):
    ranks = spawned(world)
    for rank, found in enumerate(ranks):
        assert len(found) == len(COMBOS) * (2 if world == 4 else 1)
        for case, got in found.items():
            assert max(got["errors"]) <= 1e-5, (rank, case, got["errors"])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ring_sends_what_ring_bytes_says_and_computes_the_theorys_pairs(spawned, world):
    for found in spawned(world):
        for case, got in found.items():
            assert got["sent"] == got["ring_bytes"] > 0, case
            assert got["kinds"] == ["send float32"], case
            assert got["pairs"] == got["theory_pairs"], case


def test_a_length_that_does_not_cut_refuses_in_one_line(tmp_path):
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--seq-len", "100"], "--seq-len 100",
                                 tmp_path, WORLD_SIZE="4")
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--seq-len", "100", "--balance",
                                          "none"], "multiple of 8", tmp_path, WORLD_SIZE="8")


def test_a_cp_that_does_not_divide_the_world_refuses_in_one_line(tmp_path):
    assert_bad_input_is_one_line(SCRIPT, ["--size", "tiny", "--cp", "3"], "--cp 3", tmp_path,
                                 WORLD_SIZE="4")


def test_a_resnet_is_skipped_with_why(tmp_path):
    assert_skipped_with_why(SCRIPT, ["--model", "resnet"], "no sequence to split", tmp_path)
