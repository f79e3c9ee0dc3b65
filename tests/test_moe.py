"""Unit tests for 08_moe: the MoE Llama's parts in common.py (router, experts, auxiliary loss,
parameter counts) and expert parallelism (optimized_moe_ep.py) on 4 CPU ranks.

The expert-parallel layer runs in one spawned world of 4 gloo processes (a module-scoped
fixture), over ep groups of 4 (ep 4) and of 2 (ep 2 x dp 2); each rank holds its own tokens and
compares the layer's output and gradients with the whole experts on the same tokens (the
project's `common.Experts`, and a module in HuggingFace's fused layout), counts the bytes its
all-to-alls were handed and the values it read back to the host, steps AdamW (foreach) over
FSDP2's dense part and the experts, and rank 0 saves what every rank found.
"""

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import common
import helpers
from helpers import assert_bad_input_is_one_line, assert_skipped_with_why, load_recipe

EP_SCRIPT = common.ROOT / "08_moe" / "optimized_moe_ep.py"
BASELINE = common.ROOT / "08_moe" / "baseline_moe.py"
ep_recipe = load_recipe(EP_SCRIPT)
WORLD, EXPERTS, D_MODEL, TOKENS, TOP_K = 4, 8, 16, 24, 2
ROUTES = ("random", "two experts")  # the second: every token to experts 0 and 1


class HostReads(TorchDispatchMode):
    """The values a block of code would read back from a GPU to the host (each a sync that
    stalls the CPU until the GPU catches up), counted on CPU by name in `reads`: every op whose
    output's values or size the host needs (aten's tags data_dependent_output: item, bool;
    dynamic_output_shape: bincount, nonzero), but for the two whose size is known (an integer
    index, repeat_interleave told its output_size), and every Tensor.tolist (which dispatches
    nothing on CPU: counted by a spy)."""

    def __enter__(self):
        self.reads, self.tolist = [], torch.Tensor.tolist

        def counted(tensor):
            self.reads.append("tolist")
            return self.tolist(tensor)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.repeat_interleave.Tensor:
            known = kwargs.get("output_size") is not None
        else:
            known = func is torch.ops.aten.index.Tensor and not any(
                i is not None and i.dtype == torch.bool for i in args[1])
        if torch.Tag.data_dependent_output in func.tags or (
                torch.Tag.dynamic_output_shape in func.tags and not known):
            self.reads.append(func.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_moe_param_counts_match_the_built_model(size):
    shape = common.SIZES[size]
    model = common.Llama(shape, moe_balance="none") if size != "medium" else None
    total, active = helpers.moe_param_counts(shape)
    if model is not None:
        assert total == sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for layer in model.model.layers
                      for p in layer.mlp.experts.parameters())
        assert total - active == experts * (shape.n_experts - shape.top_k) // shape.n_experts
    assert active < total


def test_the_router_bias_chooses_but_does_not_weigh():
    torch.manual_seed(0)
    router = common.TopKRouter(D_MODEL, EXPERTS, TOP_K)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(TOKENS, D_MODEL)
    weights, experts, scores = router(x)
    assert torch.allclose(weights.sum(-1), torch.ones(TOKENS))
    assert torch.equal(experts, scores.topk(TOP_K, dim=-1).indices)
    router.expert_bias[5] = 1.0  # above every score: expert 5 is everyone's choice
    weights, experts, scores = router(x)
    assert (experts == 5).any(-1).all()
    chosen = scores.gather(-1, experts)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))  # unbiased scores
    assert router.tokens_per_expert.sum() == 2 * TOKENS * TOP_K
    assert router.tokens_per_expert[5] >= TOKENS


def test_the_auxiliary_loss_is_one_when_even_and_trains_the_router():
    scores = torch.full((EXPERTS, EXPERTS), 1 / EXPERTS)
    assert common.auxiliary_balance_loss(scores, torch.arange(EXPERTS)[:, None]) == 1
    skewed = common.auxiliary_balance_loss(torch.eye(EXPERTS)[[0] * EXPERTS],
                                           torch.zeros(EXPERTS, 1, dtype=torch.long))
    assert skewed == EXPERTS
    size = common.SIZES["tiny"]
    grads = {}
    for balance in ("aux", "none"):
        torch.manual_seed(0)
        moe = common.MoE(size, balance)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, 5, size.d_model)
        moe(x).sum().backward()
        grads[balance] = moe.gate.weight.grad
    torch.manual_seed(0)
    moe = common.MoE(size, "none")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, size.d_model)
    _, experts, scores = moe.gate(x.reshape(-1, size.d_model))
    (common.AUX_LOSS_COEF * common.auxiliary_balance_loss(scores, experts)).backward()
    assert torch.allclose(grads["aux"] - grads["none"], moe.gate.weight.grad, atol=1e-5)
    assert moe.gate.weight.grad.abs().max() > 1e-4  # a gradient the check could miss


def test_experts_equal_each_token_through_its_experts_one_by_one():
    torch.manual_seed(0)
    experts = common.Experts(common.LlamaMLP(D_MODEL, 8) for _ in range(EXPERTS))
    x = torch.randn(TOKENS, D_MODEL)
    index = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(TOKENS)])
    index[:, 0] = 3  # expert 3 busiest, and a few experts without a token
    weights = torch.rand(TOKENS, TOP_K).softmax(-1)
    expected = torch.stack([sum(w * experts[e](x[t:t + 1])[0] for e, w in
                                zip(index[t].tolist(), weights[t], strict=True))
                            for t in range(TOKENS)])
    assert torch.allclose(experts(x, index, weights), expected, atol=1e-6)


def test_a_moe_layer_reads_one_value_back_to_the_host():
    # on a GPU each read waits for the device: the experts' split sizes are the one a layer
    # needs; the router's counts and the auxiliary loss's shares stay on the device
    torch.manual_seed(0)
    size = common.SIZES["tiny"]
    moe = common.MoE(size, "aux")
    x = torch.randn(2, 8, size.d_model, requires_grad=True)
    with HostReads() as host:
        moe(x).sum().backward()
    assert host.reads == ["tolist"]
    assert moe.gate.tokens_per_expert.sum() == 2 * 8 * size.top_k


def test_the_uniform_bytes_by_hand():
    # 2 ranks, 100 tokens, k 2: 100 slots out and 100 in, 4 bytes x 16 values, four times;
    # 8 counts of 8 bytes, half to the peer
    assert ep_recipe.uniform_alltoall_bytes(100, 2, 16, 4, 8, 2) == 2 * 200 * 16 * 4 + 32
    assert ep_recipe.alltoall_bytes(0, 0, 16, 4, 8, 1) == 0


class FusedExperts(torch.nn.Module):
    """Experts in HuggingFace's fused layout, `gate_up_proj` (E, 2 x ffn, d) and `down_proj` (E,
    d, ffn), called as HuggingFace calls its experts; each token's k experts gathered at once."""

    def __init__(self, n_experts: int, d_model: int, ffn: int):
        super().__init__()
        self.num_experts = n_experts
        # scaled as nn.Linear's: 1/sqrt(fan-in)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n_experts, 2 * ffn, d_model)
                                               * d_model**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(n_experts, d_model, ffn) * ffn**-0.5)

    def forward(self, tokens, top_k_index, top_k_weights):
        if not len(tokens):  # as HuggingFace's eager experts (a loop over the experts hit, each
            return torch.zeros_like(tokens)  # added into zeros): zeros outside the graph
        gate, up = torch.einsum("td,tkfd->tkf", tokens, self.gate_up_proj[top_k_index]).chunk(
            2, dim=-1)
        out = torch.einsum("tkf,tkdf->tkd", F.silu(gate) * up, self.down_proj[top_k_index])
        return (out * top_k_weights[..., None]).sum(1)


def expert_grad(experts: torch.nn.Module, e: int) -> torch.Tensor:
    """Expert e's gradient, flat: its module's in a list, or its slices of a fused module's
    parameters (zeros where none of its experts got a row)."""
    if isinstance(experts, torch.nn.ModuleList):
        return torch.cat([p.grad.flatten() for p in experts[e].parameters()])
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad)[e].flatten()
                      for p in experts.parameters()])


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest value wanted where that is over 1
    (fp32's rounding grows with the values: a gradient summed over 96 rows)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


def run_layer(group: dist.ProcessGroup, seed: int, full: torch.nn.Module, route: str):
    """This rank's tokens through the whole experts (a list, or fused) and through
    ExpertParallel over `group`: the largest differences, relative (output, token gradient,
    local experts' gradient summed over the group), the bytes the all-to-alls were handed and what
    alltoall_bytes says of them, the values read back to the host."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, D_MODEL, generator=gen, requires_grad=True)
    if route == "random":
        index = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K]
                             for _ in range(TOKENS)])
    else:  # every token to experts 0 and 1: the other ranks' experts get no row
        index = torch.tensor([[0, 1]] * TOKENS)
    weights = torch.rand(TOKENS, TOP_K, generator=gen).softmax(-1)
    full.zero_grad()
    expected = full(x, index, weights)
    expected.sum().backward()
    expected_dx = x.grad.clone()
    x.grad = None
    local = EXPERTS // ep
    layer = ep_recipe.ExpertParallel(copy.deepcopy(full), group)
    layer.zero_grad()  # the copies' .grad are the whole experts' (deepcopy copies them)
    with common.CollectiveBytes() as sent, HostReads() as host:
        out = layer(x, index, weights)
        out.sum().backward()
    full_grads = [expert_grad(full, e) for e in range(EXPERTS)]
    for grad in full_grads:  # every token of the group meets its expert on one rank of it
        dist.all_reduce(grad, group=group)
    full_grads = torch.cat(full_grads[me * local:(me + 1) * local])
    ep_grads = torch.cat([expert_grad(layer.local, e) for e in range(local)])
    rows_sent, rows_received, value_bytes = layer.exchanged
    return {"out": relative_difference(out, expected),
            "grad_x": relative_difference(x.grad, expected_dx),
            "grad_experts": relative_difference(ep_grads, full_grads),
            "sent": sum(v for k, v in sent.by_kind.items() if k.startswith("alltoall")),
            "theory": ep_recipe.alltoall_bytes(rows_sent, rows_received, D_MODEL, value_bytes,
                                               EXPERTS, ep), "value_bytes": value_bytes,
            "host_reads": host.reads,
            "local_experts": [p.shape[0] for p in layer.local.parameters()]
            if isinstance(full, FusedExperts) else [len(layer.local)]}


def adamw_over_fsdp_and_experts(rank: int, mesh) -> str:
    """One step of the script's dp 2 x ep 2 with --fsdp: the MoE Llama's experts sharded over
    ep, its dense part by FSDP2 (DTensors), AdamW's foreach step over both, as on a GPU."""
    torch.manual_seed(0)
    size = common.SIZES["tiny"]
    model = common.Llama(size, moe_balance="none")
    blocks = list(model.model.layers)
    expert_params = ep_recipe.shard_experts(blocks, mesh.get_group("ep"))
    topo = common.Topology(rank, rank, WORLD, WORLD, 1, "gloo", torch.device("cpu"))
    model = ep_recipe.wrap_dense(model, blocks, expert_params, topo, fsdp=True)
    opt = ep_recipe.adamw(model, expert_params, lr=1e-3, foreach=True)
    tokens = torch.randint(size.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    try:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        ep_recipe.reduce_expert_grads(expert_params, mesh.get_group("dp"), WORLD)
        opt.step()
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return "stepped"


def refusal(build) -> str:
    """The one-line error `build()` raises (or what it returned instead)."""
    try:
        return f"accepted: {build()!r}"
    except ValueError as err:
        return str(err)


def checks(rank: int, world: int, port: int, out_file: str) -> None:
    """Run on every rank of a spawned gloo world; rank 0 saves what every rank found."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)  # the same experts on every rank, as a seeded model builds them
    layouts = {"list": common.Experts(common.LlamaMLP(D_MODEL, 8) for _ in range(EXPERTS)),
               "fused": FusedExperts(EXPERTS, D_MODEL, 8)}
    full = layouts["list"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    found = {}
    for (layout, experts), route in itertools.product(layouts.items(), ROUTES):
        found[("ep 4", route, layout)] = run_layer(dist.group.WORLD, 100 + rank, experts, route)
        found[("ep 2", route, layout)] = run_layer(mesh.get_group("ep"), 200 + rank, experts,
                                                   route)
    # under bf16 autocast the rows travel in bf16, as the experts compute them, and the bytes
    # counted are the theory's at 2 bytes a value
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found["bf16"] = run_layer(mesh.get_group("ep"), 300 + rank, full, "random")
    # the dp replicas of an expert hold different gradients until reduce_expert_grads
    grad = torch.nn.Parameter(torch.zeros(3))
    grad.grad = torch.full((3,), float(rank + 1))
    ep_recipe.reduce_expert_grads([grad], mesh.get_group("dp"), world)
    found["reduced"] = grad.grad.tolist()
    # balance_experts: the bias moves toward equal load, the same on every rank
    router = common.TopKRouter(D_MODEL, 4, 1)
    router.tokens_per_expert.copy_(torch.tensor([rank, 1, 1, 3]))
    with HostReads() as host:
        counts = ep_recipe.balance_experts([router], 0.5)
        ep_recipe.balance_experts([router], 0.5)  # no token since: the bias stays
    found["balance"] = (counts.tolist(), router.expert_bias.tolist(),
                        router.tokens_per_expert.tolist())
    found["balance_host_reads"] = host.reads
    # what ExpertParallel cannot cut, refused in one line
    fused = torch.nn.Module()
    fused.gate_up_proj = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * 8, D_MODEL))
    fused.norm = torch.nn.Parameter(torch.ones(D_MODEL))  # one for every expert: not cut on dim 0
    found["refused"] = {
        "6 experts over 4": refusal(lambda: ep_recipe.ExpertParallel(
            common.Experts(common.LlamaMLP(D_MODEL, 8) for _ in range(6)), dist.group.WORLD)),
        "a shared parameter": refusal(lambda: ep_recipe.ExpertParallel(fused, dist.group.WORLD)),
        "no experts": refusal(lambda: ep_recipe.shard_experts(
            list(common.Llama(common.SIZES["tiny"]).model.layers), dist.group.WORLD))}
    found["fsdp adamw"] = adamw_over_fsdp_and_experts(rank, mesh)
    every = [None] * world
    dist.all_gather_object(every, found)
    if rank == 0:
        torch.save(every, out_file)
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown: seconds for 4 processes on 2 cores


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("world4") / "found.pt"
    mp.spawn(checks, args=(WORLD, common.free_port(), str(out)), nprocs=WORLD)
    return torch.load(out)


# the project's list of experts, and HuggingFace's fused layout called as its layer calls it;
# "two experts": the other ranks' experts get no row, and a fused slice computes nothing
@pytest.mark.parametrize("layout", ["list", "fused"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", ["ep 4", "ep 2"])
def test_expert_parallel_equals_every_expert_on_every_rank(spawned, where, route, layout):
    for rank, found in enumerate(spawned):
        errors = found[(where, route, layout)]
        for what in ("out", "grad_x", "grad_experts"):
            assert errors[what] <= 1e-5, (where, route, layout, rank, what, errors[what])


@pytest.mark.parametrize("layout", ["list", "fused"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", ["ep 4", "ep 2"])
def test_the_all_to_alls_send_what_alltoall_bytes_says(spawned, where, route, layout):
    for found in spawned:
        errors = found[(where, route, layout)]
        assert errors["sent"] == pytest.approx(errors["theory"], abs=1e-9)
    assert spawned[0][(where, route, layout)]["sent"] > 0


@pytest.mark.parametrize("layout", ["list", "fused"])
@pytest.mark.parametrize("where", ["ep 4", "ep 2"])
def test_an_expert_parallel_layer_reads_one_value_back_to_the_host(spawned, where, layout):
    # forward and backward: the one .tolist() of the exchanges' split sizes; the counts are
    # summed on the device (bincount would read its largest index back first)
    local = EXPERTS // int(where[-1])
    for found in spawned:
        assert found[(where, "random", layout)]["host_reads"] == ["tolist"]
        assert set(found[(where, "random", layout)]["local_experts"]) == {local}


def test_under_bf16_the_rows_travel_in_bf16_and_send_their_theory(spawned):
    for found in spawned:
        assert found["bf16"]["value_bytes"] == 2
        assert found["bf16"]["sent"] == pytest.approx(found["bf16"]["theory"], abs=1e-9)


def test_expert_gradients_are_summed_over_replicas_and_averaged_over_the_world(spawned):
    # ranks 0 and 2 hold the same experts (dp replicas), as do 1 and 3
    assert spawned[0]["reduced"] == spawned[2]["reduced"] == [(1 + 3) / 4] * 3
    assert spawned[1]["reduced"] == spawned[3]["reduced"] == [(2 + 4) / 4] * 3


def test_balance_experts_moves_every_rank_s_bias_the_same_way(spawned):
    counts, bias, left = spawned[0]["balance"]
    assert counts == [[0 + 1 + 2 + 3, 4, 4, 12]]  # summed over the world; mean 6.5
    assert bias == pytest.approx([0.5 * (6.5 - c) / 6.5 for c in [6, 4, 4, 12]])
    assert left == [0, 0, 0, 0]
    assert all(found["balance"] == spawned[0]["balance"] for found in spawned)
    # on the device: no value read back after a step (a step with no token leaves the bias)
    assert all(found["balance_host_reads"] == [] for found in spawned)


def test_adamw_steps_fsdp2_s_dense_part_and_the_plain_experts_with_foreach(spawned):
    # foreach, AdamW's default on GPUs, over one list of DTensors and plain tensors raises
    # "got mixed torch.Tensor and DTensor": the script's two parameter groups step apart
    assert [found["fsdp adamw"] for found in spawned] == ["stepped"] * WORLD


def test_what_expert_parallelism_cannot_cut_is_refused_in_one_line(spawned):
    refused = spawned[0]["refused"]
    assert refused["6 experts over 4"] == "ep 4 does not divide the 6 experts: use an ep that " \
        "divides 6"
    assert refused["a shared parameter"].startswith("experts' norm (16,) is not one slice an "
                                                    "expert on dim 0 (8 experts)")
    assert refused["no experts"].startswith("no block has an mlp.experts")
    assert all("\n" not in line for line in refused.values())


@pytest.mark.parametrize("ep", ["3", "8"])
def test_an_ep_that_does_not_divide_the_experts_refuses_in_one_line(tmp_path, ep):
    assert_bad_input_is_one_line(EP_SCRIPT, ["--size", "tiny", "--ep", ep],
                                 "--ep that divides 4", tmp_path)


def test_an_ep_that_does_not_divide_the_world_is_skipped_naming_it(tmp_path, monkeypatch):
    # the host's world, not the model, is short: `make moe`'s `--ep 2` on 3 GPUs records why
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert_skipped_with_why(EP_SCRIPT, ["--size", "tiny", "--ep", "2"],
                            "--ep 2 groups need a world of a multiple of 2", tmp_path)


@pytest.mark.parametrize("script", [BASELINE, EP_SCRIPT])
def test_a_model_without_experts_is_skipped(script, tmp_path):
    assert_skipped_with_why(script, ["--size", "tiny", "--model", "llama"], "--model moe",
                            tmp_path)


def test_a_world_that_shares_no_factor_with_the_experts_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # tiny's 4 experts: no ep > 1 divides both
    assert_skipped_with_why(EP_SCRIPT, ["--size", "tiny"], "shares a factor with 4", tmp_path)


def test_a_checkpointed_layer_counts_its_tokens_once():
    torch.manual_seed(0)
    size = common.SIZES["tiny"]
    moe = common.MoE(size, "bias")
    x = torch.randn(2, 8, size.d_model, requires_grad=True)
    torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.gate.tokens_per_expert.sum() == 2 * 8 * size.top_k  # not again in the recompute
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.gate.tokens_per_expert.sum() == 2 * 8 * size.top_k  # nor in evaluation


def test_at_small_expert_parallelism_sends_4x_fewer_bytes_and_holds_its_theory():
    records = common.load_results(common.ROOT / "tests" / "fixtures" / "records_small.jsonl")
    runs = {rec["script"]: rec for rec in records if rec["folder"] == "08_moe"}
    base, ep = runs["baseline_moe"], runs["optimized_moe_ep"]  # make moe, 2 processes, small
    assert base["comm_mb"] / ep["comm_mb"] >= 4
    assert ep["state_mb"] == pytest.approx(ep["theory"]["state_mb"], abs=0.01)
    assert ep["alltoall_mb"] == pytest.approx(ep["theory"]["alltoall_mb"], abs=1e-3)
