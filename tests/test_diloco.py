"""02_compression's DiLoCo, in spawned gloo processes (one spawn a world size, rank 0 writing what
each scenario saw):

- at 2 and 3 ranks, DiLoCo with an inner SGD, H 1, outer lr 1 and no momentum against DDP with
  SGD (to 1e-5: the algorithm reduces to averaging the gradients), ranks seeded apart;
- at 2 and 3 ranks, the paper's DiLoCo (AdamW inside, H 3, outer Nesterov SGD 0.7 / 0.9)
  against torchft's `DiLoCo` (PyPI torchft), run on the same process group through the part of
  torchft's Manager DiLoCo calls (an average all-reduce, every step committed): same losses and
  weights to 1e-5;
- Streaming DiLoCo's fragments at 2 ranks: each landing makes the fragment's slice the ranks'
  mean from where its all-reduce started, mixed with the replica's own as --mix says;
- the script's own main() at `tiny` beside the baseline's (fp32, in 4 fragments, in int8):
  bytes, exchanges, the mean step;
- the README's lines on tiny transformers Llama, Qwen2 and Mistral models seeded apart, against
  torchft's DiLoCo with the same settings.
"""

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from helpers import TINY, as_rank, load_recipe, readme_python_block

FOLDER = common.ROOT / "02_compression"
DILOCO = load_recipe(FOLDER / "optimized_compression_diloco.py")
SIZE = common.SIZES["tiny"]
README = FOLDER / "README.md"
HEADING = "### Use DiLoCo in your trainer"


class TorchftManager:
    """What torchft's DiLoCo asks of its `Manager`, on a plain process group: each
    pseudo-gradient averaged by an all-reduce, every sync committed (no replica fails here).
    torchft's own Manager adds the quorum, the lighthouse and recovery, which a fixed group of
    healthy ranks does not need."""
    _use_async_quorum = False

    def __init__(self, group=None):
        self.group, self.commits = group, 0

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        work, world = dist.all_reduce(tensor, group=self.group, async_op=True), \
            dist.get_world_size(self.group)

        class Averaged:
            def wait(self, timeout=None):
                work.wait()
                tensor.div_(world)
                return True
        return Averaged()

    def should_commit(self, timeout=None):
        self.commits += 1
        return True

    def current_step(self):
        return self.commits

    def start_quorum(self, *args, **kwargs):
        pass

    def register_state_dict_fn(self, *args):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass


def batches_of(steps: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(steps):
        tokens = common.global_token_batch(SIZE, SIZE.seq_len, 2 * world, step, seed=0)
        tokens = common.rank_slice(tokens, rank, world)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def ddp_with_sgd(rank: int, world: int, lr: float, steps: int) -> list[float]:
    torch.manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(common.GPT(SIZE, SIZE.seq_len))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in batches_of(steps, rank, world):
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return mean_over_ranks(losses)


def diloco_as_ddp(rank: int, world: int, lr: float, steps: int) -> list[float]:
    torch.manual_seed(rank)
    model = common.GPT(SIZE, SIZE.seq_len)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    diloco = DILOCO.DiLoCo(model, opt, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    losses = []
    for inputs, targets in batches_of(steps, rank, world):
        opt.zero_grad()
        loss = model(inputs, targets)
        loss.backward()
        diloco.step()
        losses.append(loss.item())
    return mean_over_ranks(losses)


def paper_diloco(rank: int, world: int, by_torchft: bool, steps: int = 9) -> dict:
    """The tiny Llama seeded by rank, AdamW inside, H 3, outer SGD lr 0.7 Nesterov 0.9: by this
    recipe, or by torchft (its replicas started from rank 0's weights first, as torchft's
    recovery would)."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    torch.manual_seed(rank)
    model = common.Llama(SIZE)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if by_torchft:
        for p in model.parameters():
            dist.broadcast(p.detach(), 0)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        context = TorchftDiLoCo(TorchftManager(), [model], inner, outer, sync_every=3)
    else:
        mine = DILOCO.DiLoCo(model, inner, sync_every=3)
    losses = []
    with context if by_torchft else contextlib.nullcontext():
        for inputs, targets in batches_of(steps, rank, world):
            inner.zero_grad()
            loss = model(inputs, targets)
            loss.backward()
            if by_torchft:
                inner.step()  # torchft's DiLoCo hooks the inner optimizer's step
            else:
                mine.step()  # the inner step, then the outer where it lands
            losses.append(loss.item())
    return {"losses": mean_over_ranks(losses),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}


def streaming(rank: int, world: int, overlap: int, mix: float, steps: int = 12) -> list[bool]:
    """Inner SGD, H 4 in 2 fragments, outer lr 1 and no momentum (the new outer weights are the
    ranks' mean): at each landing, the landed slice on every rank is the mean of the replicas'
    slices where its all-reduce started, mixed with this replica's own by `mix`."""
    torch.manual_seed(rank)
    model = common.GPT(SIZE, SIZE.seq_len)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = DILOCO.DiLoCo(model, opt, sync_every=4, outer_lr=1.0, outer_momentum=0.0,
                           fragments=2, delay=overlap, mix=mix)
    started, checks, after_inner = {}, [], {}
    opt.register_step_post_hook(  # the replica after each inner step, before any landing
        lambda *_: after_inner.update(weights=diloco.replica(slice(0, diloco.outer.numel()))))
    for step, (inputs, targets) in enumerate(batches_of(steps, rank, world), start=1):
        opt.zero_grad()
        model(inputs, targets).backward()
        diloco.step()
        replica = after_inner["weights"]
        starting = diloco.fragment_synced_at(step + overlap)
        if starting is not None:  # the ranks' mean where it starts
            where = diloco.slices[starting]
            mean = replica[where].clone()
            dist.all_reduce(mean)
            started[starting] = mean / world
        landing = diloco.fragment_synced_at(step)
        if landing is not None:
            now = diloco.replica(diloco.slices[landing])
            expected = torch.lerp(started.pop(landing), replica[diloco.slices[landing]], mix)
            checks.append(torch.allclose(now, expected, rtol=1e-5, atol=1e-6))
    return checks


def on_a_hf_model(case_args: dict, by_torchft: bool, steps: int = 17) -> dict:
    """The README's lines as written (17 steps: one sync, at the 16th), or torchft's DiLoCo
    with the same settings, on a tiny transformers model seeded by rank."""
    import hf_models
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = hf_models.tiny_model(**case_args)
    apart = hf_models.seeded_apart(model)
    batches = hf_models.token_batches(steps, rank, world)
    losses = []
    if by_torchft:
        for p in model.parameters():
            dist.broadcast(p.detach(), 0)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with TorchftDiLoCo(TorchftManager(), [model], inner, outer, sync_every=16):
            for inputs, targets in batches:
                inner.zero_grad()
                loss = hf_models.hf_loss(model, inputs, targets)
                loss.backward()
                inner.step()
                losses.append(loss.item())
    else:
        scope = {"model": model, "DiLoCo": DILOCO.DiLoCo}

        def each_step():
            for batch in batches:
                yield batch
                losses.append(scope["loss"].item())

        scope["batches"] = each_step()
        exec(readme_python_block(README, HEADING), scope)
    return {"losses": mean_over_ranks(losses), "seeded_apart": apart,
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}


def _scenarios(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {"ddp": ddp_with_sgd(rank, world, 0.05, 5),
               "diloco as ddp": diloco_as_ddp(rank, world, 0.05, 5),
               "torchft": paper_diloco(rank, world, by_torchft=True),
               "diloco": paper_diloco(rank, world, by_torchft=False)}
    if world == 2:
        import hf_models

        results["streaming"] = streaming(rank, world, overlap=0, mix=0.0)
        results["streaming overlapped"] = streaming(rank, world, overlap=1, mix=0.5)
        for name, args in hf_models.readme_models(bf16=False).items():
            for by_torchft in (False, True):
                results[("readme", name, by_torchft)] = on_a_hf_model(args, by_torchft)
    if rank == 0:
        torch.save(results, f"{out}/scenarios.pt")
    dist.destroy_process_group()


RUNS = [("baseline_compression", []), ("optimized_compression_diloco", ["--sync-every", "4"]),
        ("optimized_compression_diloco", ["--sync-every", "8", "--fragments", "4"]),
        ("optimized_compression_diloco", ["--sync-every", "4", "--quantize", "int8"]),
        ("optimized_compression_diloco", ["--sync-every", "4", "--long-run"])]


def _run_the_world(rank: int, world: int, port: int, out: str) -> None:
    as_rank(rank, world)
    if world == 2:
        for k, (script, flags) in enumerate(RUNS):
            os.environ["MASTER_PORT"] = str(port + k)
            path = FOLDER / f"{script}.py"
            sys.argv = [str(path), *TINY, "--steps", "19", "--warmup", "6", *flags,
                        "--results", f"{out}/results.jsonl"]
            common.run_main(load_recipe(path).main)
    _scenarios(rank, world, port + len(RUNS), out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    done = {}

    def at(world: int) -> tuple[dict, list[dict]]:
        if world not in done:
            out = tmp_path_factory.mktemp(f"diloco{world}")
            port = common.free_port(block=len(RUNS) + 1)
            mp.spawn(_run_the_world, args=(world, port, str(out)), nprocs=world)
            records = common.load_results(out / "results.jsonl") if world == 2 else []
            done[world] = torch.load(out / "scenarios.pt"), records
        return done[world]

    return at


def relative_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_diloco_with_sgd_h1_outer_lr1_no_momentum_is_ddp_with_sgd(spawned, world):
    scenarios, _ = spawned(world)
    assert relative_diff(scenarios["diloco as ddp"], scenarios["ddp"]) <= 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_diloco_trains_as_torchfts_diloco(spawned, world):
    scenarios, _ = spawned(world)
    mine, theirs = scenarios["diloco"], scenarios["torchft"]
    assert relative_diff(mine["losses"], theirs["losses"]) <= 1e-5
    assert torch.allclose(mine["weights"], theirs["weights"], rtol=1e-5, atol=1e-6)
    assert len(mine["losses"]) == 9  # nine steps: three syncs at H 3 compared, not one


@pytest.mark.parametrize("name", ["streaming", "streaming overlapped"])
def test_each_fragment_lands_as_the_ranks_mean_mixed_with_the_replica(spawned, name):
    scenarios, _ = spawned(2)
    checks = scenarios[name]
    assert len(checks) == 6 and all(checks)  # 12 steps, a landing every 2


def test_the_scripts_record_their_bytes_exchanges_and_mean_step(spawned):
    _, records = spawned(2)
    base, diloco, streamed, int8, long_run = records
    assert long_run["loss_tolerance_final_rel"] == DILOCO.LOSS_TOLERANCE  # the long pair's
    assert base["script"] == "baseline_compression" and diloco["baseline"] == base["script"]
    for rec in (diloco, streamed, int8):
        assert rec["status"] == "ok"
        assert rec["comm_mb"] == pytest.approx(rec["theory"]["comm_mb"], abs=0.001)
        assert rec["largest_exchange_mb"] == pytest.approx(rec["theory"]["largest_exchange_mb"],
                                                           abs=0.001)
        assert rec["outer_state_mb"] == pytest.approx(rec["theory"]["outer_state_mb"], abs=0.01)
        assert rec["step_ms"] >= rec["step_ms_median"] * 0.5  # the mean, syncs in it
        assert "loss_tolerance_final_rel" not in rec  # judged on the long pair alone
    # H 4 at steps 7..25: syncs at 8, 12, ..., 24; H 8 in 4 fragments: one every 2 steps
    assert diloco["exchanges_timed"] == 5 and streamed["exchanges_timed"] == 10
    assert diloco["comm_mb"] < base["comm_mb"] / 3
    assert streamed["largest_exchange_mb"] == pytest.approx(
        streamed["theory"]["sync_mb"] / 4, rel=0.01)
    # int8: a quarter of the bytes and a scale a block, the same syncs
    assert int8["exchanges_timed"] == 5
    assert diloco["comm_mb"] / int8["comm_mb"] == pytest.approx(4 / (1 + 4 / 256), rel=0.03)
    assert abs(int8["losses"][-1] - diloco["losses"][-1]) < 0.01 * diloco["losses"][-1]


def pytest_generate_tests(metafunc):
    """The README test's models, listed at collection in pytest's process alone: a spawned
    rank imports this module too, and transformers costs it seconds."""
    if "readme_model" in metafunc.fixturenames:
        import hf_models

        metafunc.parametrize("readme_model", list(hf_models.readme_models(bf16=False)))


def test_the_readmes_lines_train_a_transformers_model_as_torchfts_diloco(spawned, readme_model):
    scenarios, _ = spawned(2)
    mine, theirs = (scenarios[("readme", readme_model, t)] for t in (False, True))
    assert mine["seeded_apart"]  # else starting every rank from rank 0's would prove nothing
    assert relative_diff(mine["losses"], theirs["losses"]) <= 1e-5
    assert torch.allclose(mine["weights"], theirs["weights"], rtol=1e-5, atol=1e-6)
