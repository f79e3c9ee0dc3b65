"""06_symmem's shared-memory collectives in spawned gloo processes: equal to the process
group's at every size (sizes that do not divide by N included), at 2 and at 3 ranks, and an
all-reduce's rounded sums the same bits on every rank; never a stale read over many
back-to-back calls; nothing left in /dev/shm, also after a rank killed before or after it
mapped the segment; more than one node is refused as `skipped`; training equal to the
baseline at 3 ranks."""

import argparse
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import TINY, assert_within_its_tolerance, load_recipe

FOLDER = common.ROOT / "06_symmem"
SIZES = [1, 3, 1000, 16_385, 65_536 + 3, 200_003]  # values; the last two are two-shot
SHM = Path("/dev/shm")


def leftovers() -> set[str]:
    return {p.name for p in SHM.glob("playbook-symmem-*")}


def _start(rank: int, world: int, port: int, local_world: int | None = None):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(local_world or world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    args = common.parser(None).parse_args(["--timeout", "20"])
    return load_recipe(FOLDER / "optimized_symmem_allreduce.py"), common.setup(args)


def _compare_with_the_process_group(rank: int, world: int, port: int) -> None:
    recipe, topo = _start(rank, world, port)
    seg = recipe.SharedSegment(topo, max(SIZES) * 4, timeout=20)
    gen = torch.Generator().manual_seed(rank)
    peer_gen = torch.Generator().manual_seed((rank - 1) % world)  # what the previous rank draws
    for numel in SIZES:
        x = torch.randint(-1000, 1000, (numel,), generator=gen).float()  # exact sums
        ours, theirs = x.clone(), x.clone()
        recipe.all_reduce(seg, ours)
        dist.all_reduce(theirs)
        assert torch.equal(ours, theirs), ("all_reduce", numel)
        whole = numel - numel % world
        if whole:
            out, ref = torch.empty(whole), torch.empty(whole)
            recipe.all_gather(seg, out, x[:whole // world])
            common.all_gather_single(ref, x[:whole // world])
            assert torch.equal(out, ref), ("all_gather", numel)
            out, ref = torch.empty(whole // world), torch.empty(whole // world)
            recipe.reduce_scatter(seg, out, x[:whole])
            common.reduce_scatter_single(ref, x[:whole].clone())
            assert torch.equal(out, ref), ("reduce_scatter", numel)
        out = torch.empty(numel)
        recipe.sendrecv(seg, out, x)
        peer = torch.randint(-1000, 1000, (numel,), generator=peer_gen).float()
        assert torch.equal(out, peer), ("sendrecv", numel)
    for numel in SIZES:  # sums that round: every rank still gets the same bits, near gloo's
        x = torch.randn(numel, generator=gen)
        ours, theirs, everyone = x.clone(), x.clone(), [torch.empty(numel) for _ in range(world)]
        recipe.all_reduce(seg, ours)
        dist.all_reduce(theirs)
        dist.all_gather(everyone, ours)
        assert all(torch.equal(ours, other) for other in everyone), ("bits differ", numel)
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), ("rounding", numel)
    for call in range(200):  # back to back, the data changing every call, two sizes in turn
        numel = SIZES[call % 2 * 5]
        x = torch.full((numel,), float(call * (rank + 1)))
        recipe.all_reduce(seg, x)
        assert torch.equal(x, torch.full((numel,), float(call * world * (world + 1) // 2))), call
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_equal_the_process_groups(world):
    before = leftovers()
    mp.spawn(_compare_with_the_process_group, args=(world, common.free_port()), nprocs=world)
    assert leftovers() <= before  # unlinked once mapped


def _killed_peer(rank: int, world: int, port: int) -> None:
    recipe, topo = _start(rank, world, port)
    seg = recipe.SharedSegment(topo, 4096, timeout=3)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(TimeoutError, match="did not reach"):
        recipe.all_reduce(seg, torch.ones(8))


def test_a_killed_rank_leaves_nothing_in_dev_shm_and_its_peer_times_out():
    before = leftovers()
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        mp.spawn(_killed_peer, args=(2, common.free_port()), nprocs=2)
    assert leftovers() <= before


def _peer_dies_before_mapping(rank: int, world: int, port: int) -> None:
    recipe, topo = _start(rank, world, port)
    if rank == 1:  # dies with the file made, before it maps it: rank 0 waits at the barrier
        recipe.mmap.mmap = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises((RuntimeError, SystemExit)):  # the barrier fails, or the SIGTERM comes
        recipe.SharedSegment(topo, 4096, timeout=3)


def test_a_rank_killed_before_it_maps_the_segment_leaves_nothing_in_dev_shm():
    before = leftovers()
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        mp.spawn(_peer_dies_before_mapping, args=(2, common.free_port()), nprocs=2)
    assert leftovers() <= before


def _two_nodes(rank: int, world: int, port: int) -> None:
    recipe, topo = _start(rank, world, port, local_world=1)  # each rank a node of its own
    with pytest.raises(common.Skip, match="one node"):
        recipe.SharedSegment(topo, 4096, timeout=3)
    dist.destroy_process_group()


def test_more_than_one_node_is_skipped_with_the_reason():
    mp.spawn(_two_nodes, args=(2, common.free_port()), nprocs=2)


@pytest.mark.parametrize("text, sizes", [("4K,64K,16M", [4096, 65536, 16 * 2**20]),
                                         ("100,1.5K", [100, 1536]), ("1g", [2**30])])
def test_message_sizes_parse(text, sizes):
    assert common.message_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0", "4X", "", "-1K", "4098", "3"])  # fp32: multiples of 4
def test_bad_message_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        common.message_sizes(text)


def test_busbw_follows_the_nccl_tests_convention():
    row = common.sweep_entry("all_reduce", 10**9, 1000.0, world=4)
    assert row["algbw_gbps"] == 1.0 and row["busbw_gbps"] == 1.5
    assert common.sweep_entry("sendrecv", 10**9, 1000.0, world=4)["busbw_gbps"] == 1.0
    assert common.sweep_entry("all_gather", 10**9, 1000.0, world=4)["busbw_gbps"] == 0.75


def _train_three(rank: int, world: int, port: int, results: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    for k, (name, flags) in enumerate([("baseline_symmem_training", []),
                                       ("optimized_symmem_training", []),
                                       ("optimized_symmem_training", ["--replicated-optimizer"]),
                                       ("baseline_symmem_tp", []), ("optimized_symmem_tp", []),
                                       ("optimized_symmem_tp_pytorch", []),
                                       ("optimized_symmem_tp", ["--dtype", "bf16"]),
                                       ("optimized_symmem_tp_pytorch", ["--dtype", "bf16"])]):
        os.environ["MASTER_PORT"] = str(port + k)  # a fresh store for each run's group
        path = FOLDER / f"{name}.py"
        sys.argv = [str(path), *TINY, "--results", results, *flags]
        common.run_main(load_recipe(path).main)


def test_training_at_an_odd_world_size_equals_the_baseline(tmp_path):
    # 3 ranks: shares of unequal length, and sums whose order differs from gloo's ring
    results = tmp_path / "results.jsonl"
    mp.spawn(_train_three, args=(3, common.free_port(), str(results)), nprocs=3)
    base, ours, replicated, *tensor_parallel = common.load_results(results)
    assert replicated["variant"] == "--replicated-optimizer"
    for rec, state in [(ours, 1 / 3), (replicated, 1)]:
        assert rec["status"] == "ok" and rec["world_size"] == 3
        assert max(abs(a - b) / b for a, b in zip(rec["losses"], base["losses"], strict=True)) \
            <= 1e-5
        assert rec["optim_mb"] == pytest.approx(rec["theory"]["optim_mb"], rel=0.01)
        assert rec["optim_mb"] == pytest.approx(base["optim_mb"] * state, rel=0.01)
        assert rec["process_group_mb"] == 0
    # read out of peers' slots: their shares of my third (2 x P/3 x 4 bytes), and,
    # replicated, their reduced thirds (2/3 x 4P), counted where the reads happen
    params, recorded = ours["params"], {"abs": 1e-3}  # MB, to 3 decimals
    assert ours["comm_mb"] == pytest.approx(2 / 3 * 4 * params / 2**20, **recorded)
    assert replicated["comm_mb"] == pytest.approx(2 * 2 / 3 * 4 * params / 2**20, **recorded)
    assert replicated["comm_mb"] == pytest.approx(base["comm_mb"], **recorded)  # the ring's bytes
    # tensor parallelism: tiny's 4 heads and 256 hidden units over 3 ranks split unevenly by
    # hand (1, 1, 2 heads), and are padded for DTensor (2 heads a rank, one all zeros); bf16
    # pieces move through the fp32 slots at 2 bytes a value, DTensor gathers the norms' fp32
    for rec in tensor_parallel:
        assert rec["status"] == "ok" and rec["world_size"] == 3 and rec["params"] == params
        assert_within_its_tolerance(rec, base)
        assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=1e-3)  # 3 decimals
        assert rec["state_mb"] == pytest.approx(rec["theory"]["state_mb"], rel=0.05)
    fp32, bf16 = tensor_parallel[1], tensor_parallel[3]
    assert bf16["dtype"] == "bf16" and bf16["comm_mb"] < 0.6 * fp32["comm_mb"]
    fp32, bf16 = tensor_parallel[2], tensor_parallel[4]  # gathers at 4 bytes, scatters at 2
    assert bf16["dtype"] == "bf16" and 0.7 < bf16["comm_mb"] / fp32["comm_mb"] < 0.8


def test_a_share_is_contiguous_and_within_one_of_every_other():
    tp = load_recipe(FOLDER / "optimized_symmem_tp.py")
    for total, world in [(8, 3), (256, 3), (4, 4), (5, 2), (7, 1)]:
        shares = [tp.my_share(total, r, world) for r in range(world)]
        assert [s.start for s in shares[1:]] == [s.stop for s in shares[:-1]]
        assert shares[0].start == 0 and shares[-1].stop == total
        sizes = [s.stop - s.start for s in shares]
        assert max(sizes) - min(sizes) <= 1


class _Alone:
    """TP's two communicating matmuls in a world of one: the gather and the scatter are the
    input itself."""

    def all_gather_matmul(self, shard, b):
        return shard, shard @ b

    def matmul_reduce_scatter(self, a, b):
        return a @ b


def test_a_world_of_one_computes_the_model_unsplit():
    """The slicing, the sequence-major layout and both autograd functions, against common.GPT:
    the same loss and the same gradients."""
    tp = load_recipe(FOLDER / "optimized_symmem_tp.py")
    size = common.SIZES["tiny"]
    torch.manual_seed(0)
    gpt = common.GPT(size, size.seq_len)
    tokens = torch.randint(size.vocab_size, (3, size.seq_len + 1))
    loss = gpt(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    expected = {name: p.grad.clone() for name, p in gpt.named_parameters()}
    gpt.zero_grad()
    split = tp.TensorParallelGPT(gpt, size.n_heads, 0, 1, _Alone())
    ours = split(tokens[:, :-1], tokens[:, 1:])
    ours.backward()
    assert ours.item() == pytest.approx(loss.item(), rel=1e-6)
    for name, p in split.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-4, atol=1e-6), name


def test_heads_and_units_padded_for_dtensor_compute_the_same_and_stay_zero():
    pytorch_tp = load_recipe(FOLDER / "optimized_symmem_tp_pytorch.py")
    size = common.SIZES["tiny"]
    torch.manual_seed(0)
    block = common.Block(size.d_model, size.n_heads, common.causal_sdpa)
    x = torch.randn(2, 8, size.d_model)
    expected = block.attn(x)
    padded = pytorch_tp.SplitQKVAttention(block.attn, size.n_heads, world=3)  # 4 heads -> 6
    assert padded.q.out_features == 6 * size.d_model // size.n_heads
    got = padded(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    for grad in (padded.q.weight.grad, padded.k.weight.grad, padded.v.weight.grad):
        assert not grad[size.d_model:].any()  # the zero heads learn nothing: they stay zero
    assert not padded.proj.weight.grad[:, size.d_model:].any()
