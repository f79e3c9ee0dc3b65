"""Unit tests for 07_context's Ulysses attention and PyTorch's context_parallel on CPU.

Ulysses' attention runs in the folder's one spawned gloo world of 4 ranks
(tests/test_context.py's `world_of_4`, beside the ring's checks): on each rank's contiguous chunk
of the sequence, its output and the gradients of q, k and v equal one rank's `common.causal_sdpa`
over the whole sequence, for equal head counts and grouped-query (8 query heads, 4 KV heads),
over the whole world and over the cp groups of a dp 2 x cp 2 mesh; the bytes it hands to
all_to_all_single equal `ulysses_bytes`. The world also tries torch's `context_parallel` SDPA on
CPU, which fails as the script's skip says.
"""

import pytest
import torch
import torch.distributed as dist
from test_context import world_of_4
from torch.distributed.device_mesh import init_device_mesh

import common
from helpers import assert_bad_input_is_one_line, assert_skipped_with_why, load_recipe

FOLDER = common.ROOT / "07_context"
ULYSSES = FOLDER / "optimized_context_ulysses.py"
PYTORCH = FOLDER / "optimized_context_pytorch.py"
ulysses = load_recipe(ULYSSES)
pytorch_cp = load_recipe(PYTORCH)

BATCH, SEQ, HEAD_DIM = 2, 24, 8
HEADS = {"equal": (4, 4), "gqa": (8, 4)}  # (query heads, KV heads)
WORLD = 4


def whole_and_sharded(heads: int, kv_heads: int, group: dist.ProcessGroup | None, seed: int
                      ) -> dict[str, float]:
    """The largest difference between Ulysses on this rank's chunk and causal SDPA on the whole
    sequence (the same tensors on every rank of the group): output and q, k, v gradients; and
    the bytes this rank sent against `ulysses_bytes`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=gen, requires_grad=True)
            for _ in range(2))
    grad_out = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen)
    whole = common.causal_sdpa(q, k, v)
    whole.backward(grad_out)

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = common.sequence_positions(SEQ, rank, cp, zigzag=False)
    shards = [t.detach()[:, :, mine].requires_grad_() for t in (q, k, v)]
    with common.CollectiveBytes() as sent:
        out = ulysses.UlyssesAttention(group)(*shards)
        out.backward(grad_out[:, :, mine])
    found = {"out": (out - whole.detach()[:, :, mine]).abs().max().item()}
    for name, shard, full in zip("qkv", shards, (q, k, v), strict=True):
        found[f"grad_{name}"] = (shard.grad - full.grad[:, :, mine]).abs().max().item()
    found["sent"] = sent.bytes
    found["theory"] = ulysses.ulysses_bytes(1, BATCH * SEQ // cp, heads, kv_heads, HEAD_DIM, cp,
                                            4)
    return found


def context_parallel_on_cpu(world: int) -> dict[str, str]:
    """torch's context_parallel around one causal SDPA forward and backward on CPU, with each
    SDPA backend: what it raises."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    raised = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        q = torch.randn(1, 2, 4 * world, 4, requires_grad=True)
        positions = torch.arange(4 * world)
        try:
            with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0]), \
                    sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True
                                                                 ).sum().backward()
            raised[backend.name] = "nothing"
        except (NotImplementedError, RuntimeError) as error:
            raised[backend.name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return raised


def context_parallel_cuts(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and positions `context_parallel` leaves this rank (the pytorch script's
    buffers, cut in place; no attention runs, so this much works on CPU): (tokens, positions)."""
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    tokens = torch.arange(2 * (SEQ + 1)).view(2, SEQ + 1)[:, :-1].clone()  # as the script's
    positions = torch.arange(SEQ)
    with context_parallel(mesh, buffers=[tokens, positions], buffer_seq_dims=[1, 0],
                          no_restore_buffers={tokens, positions}):
        pass
    return tokens, positions


def checks(world: int) -> dict:
    """What this rank of a spawned gloo world finds (test_context.world_checks runs it)."""
    found = {}
    for name, (heads, kv_heads) in HEADS.items():
        found[("world", name)] = whole_and_sharded(heads, kv_heads, None, seed=1)
    # the cp groups of a dp 2 x cp 2 mesh, each with its own tensors
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    for name, (heads, kv_heads) in HEADS.items():
        found[("mesh", name)] = whole_and_sharded(heads, kv_heads, mesh["cp"].get_group(),
                                                  seed=10 + mesh.get_local_rank("dp"))
    found["context_parallel"] = context_parallel_on_cpu(world)
    found["context_parallel_cuts"] = context_parallel_cuts(world)
    return found


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """What each rank found in the folder's world of 4: Ulysses over all 4 (cp 4) and over the cp
    groups of a dp 2 x cp 2 mesh (cp 2), torch's context_parallel over all 4."""
    return [found["ulysses"] for found in world_of_4()]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("where", ["world", "mesh"])
def test_ulysses_equals_sdpa_on_the_whole_sequence(spawned, where, heads):
    for rank, found in enumerate(spawned):
        errors = found[(where, heads)]
        for what in ("out", "grad_q", "grad_k", "grad_v"):
            assert errors[what] <= 1e-5, (where, heads, rank, what, errors[what])


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("where", ["world", "mesh"])
def test_ulysses_sends_what_ulysses_bytes_says(spawned, where, heads):
    for found in spawned:
        counted = found[(where, heads)]
        assert counted["sent"] == counted["theory"] > 0


def test_ulysses_bytes_is_the_hand_count():
    # tiny's Llama at cp 2: 2 layers, 4 x 128 / 2 tokens a rank, 4 heads and 2 KV heads of 16
    # values: per layer q, out (4 heads) and k, v (2) of 256 tokens, forward and back, half sent
    per_direction = 256 * 16 * (4 + 4 + 2 + 2) * 4  # q, out, k, v in fp32
    assert ulysses.ulysses_bytes(2, 256, 4, 2, 16, 2, 4) == 2 * 2 * per_direction / 2
    assert ulysses.ulysses_bytes(2, 256, 4, 2, 16, 1, 4) == 0  # one rank sends nothing
    # cp 4: 3/4 of each tensor leaves; bf16 halves it
    assert ulysses.ulysses_bytes(1, 64, 8, 8, 16, 4, 2) == 2 * 64 * 16 * 32 * 2 * 3 / 4


def test_the_default_cp_is_the_largest_divisor_of_the_world_that_cuts_the_heads():
    assert ulysses.default_cp(4, 4, 4, 128) == 4
    assert ulysses.default_cp(4, 4, 2, 128) == 2  # tiny's Llama: 2 KV heads
    assert ulysses.default_cp(6, 8, 4, 768) == 2
    assert ulysses.default_cp(3, 4, 4, 128) == 1
    assert pytorch_cp.default_cp(6, 4096) == 2  # 2 x cp must cut T: 4096 / 6 does not
    assert pytorch_cp.default_cp(8, 4096) == 8


@pytest.mark.parametrize("flags, world, hint", [
    (["--cp", "3"], "3", "--cp 3 does not divide the 4 attention heads and 4 KV heads"),
    (["--cp", "4", "--model", "llama"], "4",
     "--cp 4 does not divide the 4 attention heads and 2 KV heads"),
    (["--cp", "3"], "4", "--cp 3 does not divide the world size 4"),
    (["--cp", "2", "--seq-len", "33"], "2",
     "--seq-len 33 does not cut into 2 equal chunks, one a rank of --cp 2"),
])
def test_ulysses_refuses_what_it_cannot_cut_in_one_line(flags, world, hint, tmp_path):
    assert_bad_input_is_one_line(ULYSSES, ["--size", "tiny", *flags], hint, tmp_path,
                                 WORLD_SIZE=world)


def test_ulysses_skips_a_world_with_no_cp_that_cuts_the_heads(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert_skipped_with_why(ULYSSES, ["--size", "tiny"], "no cp > 1 divides the world size 3",
                            tmp_path)


@pytest.mark.parametrize("flags, hint", [
    (["--cp", "2", "--seq-len", "66"], "--seq-len 66 does not cut into 4 equal chunks (2 a rank "
                                       "of --cp 2, head-tail)"),
    (["--cp", "3"], "--cp 3 does not divide the world size 2"),
])
def test_pytorch_refuses_a_cp_that_does_not_cut_the_sequence_head_tail_or_the_world(
        flags, hint, tmp_path):
    assert_bad_input_is_one_line(PYTORCH, ["--size", "tiny", *flags], hint, tmp_path,
                                 WORLD_SIZE="2")


def test_pytorch_skips_on_cpu_with_the_reason(tmp_path):
    assert_skipped_with_why(PYTORCH, ["--size", "tiny"], "runs SDPA on CUDA only", tmp_path)


def test_context_parallel_cuts_head_tail_as_sequence_positions_zigzag(spawned):
    """What optimized_context_pytorch.py relies on: torch's default cut is common's zigzag."""
    whole = torch.arange(2 * (SEQ + 1)).view(2, SEQ + 1)[:, :-1]
    for rank, found in enumerate(spawned):
        tokens, positions = found["context_parallel_cuts"]
        assert positions.tolist() == common.sequence_positions(SEQ, rank, WORLD).tolist()
        assert torch.equal(tokens, whole[:, positions])


def test_context_parallel_fails_on_cpu_in_every_sdpa_backend_as_the_skip_says(spawned):
    """The skip's why, measured: flash has no sharding strategy for the CPU kernel, math mixes a
    DTensor with a Tensor (torch 2.14). If this fails, torch's CP may run on CPU now: try it."""
    for raised in (found["context_parallel"] for found in spawned):
        assert "_scaled_dot_product_flash_attention_for_cpu" in raised["FLASH_ATTENTION"] \
            and "does not have a sharding strategy" in raised["FLASH_ATTENTION"], raised
        assert "got mixed torch.Tensor and DTensor" in raised["MATH"], raised
    assert "flash kernel has no sharding strategy" in pytorch_cp.CPU_FAILURE
    assert "mixes DTensor and Tensor" in pytorch_cp.CPU_FAILURE
