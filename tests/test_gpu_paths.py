"""The CUDA paths, proven on CPU: what each script does where CUDA is, run here with torch.cuda's
functions stubbed, so that a break a GPU would hit on its first step fails a test first.

Also every script's argument checks at the world sizes a GPU host gives by default (1, 3, 4, 8),
with the Makefile's defaults: each reaches `setup` or skips with its reason, never exits 2."""

import datetime
import inspect
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import common
from helpers import load_recipe
from report.runs import smoke

SCRIPTS = sorted(common.ROOT.glob("[0-9][0-9]_*/*.py"))


def makefile_extra_flags() -> dict[str, list[list[str]]]:
    """The Makefile's extra runs (its EXTRA_RUNS_* lists, "script flags" each, whatever MODEL
    selects), as each script's lists of flags, its variables (07's lengths by size) as make
    expands them at its defaults (`make -pn`'s database)."""
    makefile = (common.ROOT / "Makefile").read_text()
    database = subprocess.run(["make", "-pn", "--no-print-directory", "list"], cwd=common.ROOT,
                              capture_output=True, text=True, timeout=60).stdout
    values = dict(re.findall(r"^(\w+) :?= (.*)$", database, re.MULTILINE))
    found: dict[str, list[list[str]]] = {}
    for script, flags in re.findall(r'"(\d\d_\w+/\w+\.py)( [^"]*)"', makefile):
        flags = re.sub(r"\$\((\w+)\)", lambda var: values[var[1]], flags)
        found.setdefault(Path(script).stem, []).append(flags.split())
    return found


EXTRA_FLAGS = makefile_extra_flags()


@pytest.fixture(scope="module")
def group():
    """A process group of one, gloo, for the functions that talk to their peers."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def fake_cuda_topology(local_world: int = 1, nnodes: int = 1) -> common.Topology:
    """What `setup` returns on a GPU (only the device object: nothing is allocated on it)."""
    return common.Topology(0, 0, local_world * nnodes, local_world, nnodes, "nccl",
                           torch.device("cuda", 0))


def tiny_args(*extra: str):
    args = common.parser(None).parse_args(["--size", "tiny", "--steps", "2", "--warmup", "2",
                                           *extra])
    args.dtype = "fp32"
    return args


# --- 1 and 8: a step under timed_steps as on CUDA ---------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's functions that timed_steps calls, as stubs that keep a log: NVTX returns
    the nesting depth (an int) as the real one does, and the allocator's peak is what
    `allocate` reported since the last reset (the whole process's before the first)."""
    calls = {"push": 0, "pop": 0, "allocated": 5e9, "peak": 5e9, "resets": []}

    def push(name):
        calls["push"] += 1
        return calls["push"] - calls["pop"]

    def pop():
        calls["pop"] += 1
        return calls["push"] - calls["pop"]

    def reset(device):
        calls["resets"].append(calls.get("step"))
        calls["peak"] = calls["allocated"] = 0

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls["peak"])
    return calls


def test_a_training_step_runs_through_the_cuda_hooks_and_measures_one_steps_peak(group, fake_cuda):
    args = tiny_args()
    topo = fake_cuda_topology()
    model, batches = common.workload(args, common.Topology(0, 0, 1, 1, 1, "gloo",
                                                           torch.device("cpu")))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def train_step(inputs, targets):
        fake_cuda["step"] = fake_cuda.get("step", -1) + 1
        fake_cuda["peak"] = max(fake_cuda["peak"], 1e6 * (fake_cuda["step"] + 1))
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, targets)  # the forward hooks must leave inputs and output alone
        loss.backward()
        opt.step()  # and the step pre-hook the optimizer's arguments
        return loss

    stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
    assert len(stats.losses) == 4 and all(loss > 0 for loss in stats.losses)
    assert fake_cuda["push"] == fake_cuda["pop"] == 3 * 4  # step, forward, optimizer: 4 steps
    # reset after the first step, just before the last warm-up one, whose own peak (2 MB, not
    # the 5 GB the process held before) is the record's
    assert fake_cuda["resets"] == [0]
    assert stats.memory == {"total": pytest.approx(2e6 / 2**20)}


# --- 10: the GPU from what is visible -----------------------------------------------------------
@pytest.mark.parametrize("local_rank, local_world, visible, per_task, index", [
    (3, 8, 8, False, 3),  # torchrun, one process per GPU
    (3, 8, 8, True, 3),  # srun without binding: every task sees all
    (3, 8, 1, True, 0),  # srun --gpus-per-task=1: each task sees its own
    (1, 4, 2, True, 0),  # srun --gpus-per-task=2
])
def test_the_gpu_is_picked_from_what_this_process_sees(local_rank, local_world, visible, per_task,
                                                      index):
    assert common.cuda_device_index(local_rank, local_world, visible, per_task) == index


def test_more_processes_than_gpus_is_one_line_that_says_what_to_change():
    """Under torchrun every process sees the host's GPUs: fewer than processes is a mistake
    (under srun --gpus-per-task=2, two visible to each task is its own pair: see above)."""
    with pytest.raises(common.SetupError, match=r"4 processes on this host but 2 GPU\(s\) .*"
                                                r"NPROC=2"):
        common.cuda_device_index(3, 4, 2, per_task=False)


def test_a_setup_error_exits_2_with_one_line(tmp_path):
    script = tmp_path / "refuses.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(common.ROOT)!r})\nimport common\n\n"
                      "def main():\n    raise common.SetupError('no GPU left: use NPROC=1')\n\n"
                      "common.run_main(main)\n")
    import subprocess
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == "refuses.py: error: no GPU left: use NPROC=1"


# --- records name the GPU, CUDA and NCCL -------------------------------------------------------
def test_records_name_the_gpu_and_the_cuda_and_nccl_versions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 7))
    rec = common.base_record(tiny_args(), fake_cuda_topology(), None, "ok", None)
    assert (rec["device"], rec["cuda"], rec["nccl"]) == ("NVIDIA H100 80GB HBM3", "13.0",
                                                          "2.30.7")
    cpu = common.base_record(tiny_args(), common.Topology(0, 0, 1, 1, 1, "gloo",
                                                           torch.device("cpu")), None, "ok", None)
    assert (cpu["device"], cpu["cuda"], cpu["nccl"]) == ("cpu", None, None)


# --- 11: symmetric memory ------------------------------------------------------------------------
# peer_access_problem: the all-reduce sweep holds it, 06's other scripts copy it
SYMMEM = load_recipe(common.ROOT / "06_symmem" / "optimized_symmem_allreduce.py")


def test_symmetric_memory_is_skipped_without_peer_access_and_across_nodes(group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert "cannot access each other's memory" in SYMMEM.peer_access_problem(
        fake_cuda_topology(local_world=2))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert SYMMEM.peer_access_problem(fake_cuda_topology(local_world=2)) is None
    assert "one host" in SYMMEM.peer_access_problem(fake_cuda_topology(nnodes=2))


def test_symmetric_memory_is_skipped_where_each_rank_sees_only_its_own_gpu(group, monkeypatch):
    """`srun --gpus-per-task=1`: every rank sees one GPU, index 0, and peer access to nothing
    else passes; symmetric memory's rendezvous would then fail on every rank."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    why = SYMMEM.peer_access_problem(fake_cuda_topology(local_world=2))
    assert why is not None and "sees 1 GPU(s) for the host's 2 ranks" in why


def test_async_tp_calls_the_fused_kernels_by_their_signatures():
    """optimized_symmem_tp.py's CUDA path calls PyTorch's two fused ops positionally: their
    arguments must be, in order, what it passes."""
    import torch.distributed._symmetric_memory  # noqa: F401 (registers torch.ops.symm_mem)

    schema = {name: [a.name for a in getattr(torch.ops.symm_mem, name).default._schema.arguments]
              for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")}
    assert schema["fused_all_gather_matmul"][:4] == ["A", "Bs", "gather_dim", "group_name"]
    assert schema["fused_matmul_reduce_scatter"] == ["A", "B", "reduce_op", "scatter_dim",
                                                     "group_name"]


def test_dtensor_async_tp_enables_symmetric_memory_where_inductor_looks(group, monkeypatch):
    """inductor's micro-pipeline pass leaves a group's collectives alone unless
    is_symm_mem_enabled_for_group says yes: the DTensor script's switch must make it. (The
    group's entry in torch's C++ registry, `set_group_info`, outlives the test: harmless.)"""
    import torch._inductor.config as inductor
    from torch._inductor.fx_passes import micro_pipeline_tp
    from torch.distributed import _symmetric_memory as symm
    from torch.distributed.device_mesh import init_device_mesh

    assert "is_symm_mem_enabled_for_group(group_name)" in inspect.getsource(micro_pipeline_tp)
    monkeypatch.setattr(inductor, "_micro_pipeline_tp", False)
    monkeypatch.setattr(symm, "_group_name_to_store", {})
    mesh = init_device_mesh("cpu", (1,))
    name = mesh.get_group().group_name
    assert not symm.is_symm_mem_enabled_for_group(name)
    dtensor_tp = load_recipe(common.ROOT / "06_symmem" / "optimized_symmem_tp_pytorch.py")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecation is expected, and silenced
        dtensor_tp.enable_async_tp(mesh)
    assert inductor._micro_pipeline_tp and symm.is_symm_mem_enabled_for_group(name)


def test_dtensor_async_tp_stays_off_where_symmetric_memory_cannot_map_the_gpus(group,
                                                                              monkeypatch):
    """Across nodes, or on GPUs that cannot reach each other's memory, inductor's async TP
    would fail in symmetric memory's rendezvous: the DTensor script checks first, as the
    hand-written TP does, runs without it and says why (the record's `async_tp_off`)."""
    dtensor_tp = load_recipe(common.ROOT / "06_symmem" / "optimized_symmem_tp_pytorch.py")
    enabled = []
    monkeypatch.setattr(dtensor_tp, "enable_async_tp", enabled.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert "cannot access each other's memory" in dtensor_tp.start_async_tp(
        fake_cuda_topology(local_world=2), "mesh")
    assert "one host" in dtensor_tp.start_async_tp(fake_cuda_topology(nnodes=2), "mesh")
    assert not enabled
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert dtensor_tp.start_async_tp(fake_cuda_topology(local_world=2), "mesh") is None
    assert enabled == ["mesh"]
    cpu = common.Topology(0, 0, 1, 1, 1, "gloo", torch.device("cpu"))
    assert "CUDA" in dtensor_tp.start_async_tp(cpu, "mesh") and enabled == ["mesh"]


def test_peer_buffers_start_where_the_handle_says_the_tensor_does():
    training = load_recipe(common.ROOT / "06_symmem" / "optimized_symmem_training.py")

    class Handle:  # a rendezvous whose tensor sits 256 bytes into its pool's allocation
        offset, world_size, asked = 256, 2, []

        def get_buffer(self, rank, sizes, dtype, storage_offset=0):
            self.asked.append((rank, sizes, dtype, storage_offset))
            return torch.zeros(sizes, dtype=dtype)

    views = training.peer_views(Handle(), 10)
    assert len(views) == 2
    assert Handle.asked == [(0, (10,), torch.float32, 64), (1, (10,), torch.float32, 64)]


# --- 4 and 5: FSDP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp(group):
    return load_recipe(common.ROOT / "03_fsdp" / "optimized_fsdp.py")


def resnet():
    torch.manual_seed(0)
    return common.Classifier("resnet18", common.NUM_CLASSES)


def test_batchnorm_stays_fp32_under_a_bf16_policy(fsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = resnet()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp.shard(model, common.transformer_blocks(model), init_device_mesh("cpu", (1,)),
               mp_policy=bf16)
    seen = {}
    for name in ["net.conv1", "net.bn1", "net.layer2.0.bn2", "net.layer2.0.conv2"]:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(
            lambda m, _, name=name: seen.update({name: (m.weight.dtype, getattr(
                m, "running_mean", torch.empty(0)).dtype)}))
    images, labels = common.global_image_batch(common.SIZES["tiny"], 2, 0, 0)
    loss = model(images, labels)
    loss.backward()
    assert seen["net.conv1"][0] == seen["net.layer2.0.conv2"][0] == torch.bfloat16
    assert seen["net.bn1"] == seen["net.layer2.0.bn2"] == (torch.float32, torch.float32)
    assert torch.isfinite(loss) and model.net.bn1.weight.grad.dtype == torch.float32


def test_batchnorm_needs_no_unit_of_its_own_in_fp32(fsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    model = resnet()
    fsdp.shard(model, common.transformer_blocks(model), init_device_mesh("cpu", (1,)),
               mp_policy=MixedPrecisionPolicy())
    assert not isinstance(model.net.bn1, FSDPModule)  # fp32 runs keep their collectives


def test_float8_weights_are_gathered_in_float8_only_where_their_rows_split_evenly():
    """torchao cannot gather an uneven float8 shard (pytorch/ao#3982): at 3 ranks the tiny
    GPT's 64-row weights travel in the compute dtype instead; at 2 and 4 in float8."""
    pytest.importorskip("torchao")
    fp8 = load_recipe(common.ROOT / "03_fsdp" / "optimized_fsdp_fp8.py")
    for world, in_float8 in [(2, True), (3, False), (4, True)]:
        model = common.GPT(common.SIZES["tiny"], 32)
        converted, gathered = fp8.convert_to_fp8(model, [common.output_head(model)], world)
        assert gathered is in_float8 and "blocks.0.fc" in converted


# --- the offload's host thread on its rank's GPU ------------------------------------------------
def test_the_offloads_host_thread_runs_on_its_ranks_gpu_not_gpu_0(group, monkeypatch):
    """CUDA's current device is a thread's own, GPU 0 in a new thread: unbound, the host
    thread's first CUDA call (an event's synchronize, AdamW's capture check, leaving a stream's
    context) opens a context on GPU 0 in every rank. torch.cuda.set_device and current_device
    run as they are, over the CUDA runtime's per-thread device, stubbed: the thread a rank on
    GPU 3 steps on is on GPU 3, the training thread's device untouched; and the optimizer
    builds its thread for its model's device."""
    offload = load_recipe(common.ROOT / "04_zero" / "optimized_zero3_offload.py")
    current = threading.local()  # the runtime's current device: per thread, GPU 0 at first
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda i: setattr(current, "device", i))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: getattr(current, "device", 0))
    host = offload.host_thread(torch.device("cuda", 3))
    assert host.submit(torch.cuda.current_device).result() == 3
    assert torch.cuda.current_device() == 0
    host.shutdown()
    built_for, host_thread = [], offload.host_thread
    monkeypatch.setattr(offload, "host_thread",
                        lambda device: built_for.append(device) or host_thread(device))
    model = common.GPT(common.SIZES["tiny"], 8)
    opt = offload.ZeRO3Offload(model, common.transformer_blocks(model))
    assert built_for == [torch.device("cpu")]
    assert opt.host.submit(torch.cuda.current_device).result() == 0  # on CPU: never bound
    opt.host.shutdown()


# --- fp32 grouped-query attention on CUDA keeps an O(T) kernel ----------------------------------
@pytest.mark.parametrize("device, dtype, kv_heads_seen, grouped", [
    ("cuda", torch.float32, 4, False),  # repeated: the memory-efficient kernel takes it
    ("cuda", torch.bfloat16, 2, True), ("cuda", torch.float16, 2, True),  # flash groups them
    ("cpu", torch.float32, 2, True)])  # so does CPU's flash kernel, in fp32 too
def test_grouped_query_attention_reaches_sdpa_as_a_fused_kernel_takes_it(
        device, dtype, kv_heads_seen, grouped, monkeypatch):
    """On CUDA, flash runs bf16 and fp16 only and the memory-efficient kernel refuses grouped
    heads (torch's check_batch_size_and_num_heads_dense): fp32 with enable_gqa falls back to
    the math kernel and its T x T scores. What common.causal_sdpa hands SDPA, on fake CUDA
    tensors (FakeTensorMode: shapes, dtypes and devices, no GPU): 4 query heads, 2 KV heads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((k.shape[1], v.shape[1], kwargs["enable_gqa"]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with FakeTensorMode():
        q = torch.randn(2, 4, 32, 16, device=device, dtype=dtype)
        k, v = (torch.randn(2, 2, 32, 16, device=device, dtype=dtype) for _ in range(2))
        out = common.causal_sdpa(q, k, v)
    assert out.shape == q.shape and out.device.type == device
    assert seen == [(kv_heads_seen, kv_heads_seen, grouped)]


def test_the_repeated_kv_heads_attend_as_the_grouped_ones():
    """The fp32 CUDA path's values, on CPU: tensors that say they are on CUDA take
    common.causal_sdpa's repeat, and its output and gradients are the grouped kernel's (KV head
    h serving query heads 2h and 2h + 1, as enable_gqa reads them)."""
    class SaysCuda(torch.Tensor):
        is_cuda = property(lambda self: True)

    torch.manual_seed(0)
    tensors = [torch.randn(2, heads, 32, 16) for heads in (4, 2, 2)]
    grads = []
    for kind in (torch.Tensor, SaysCuda):
        q, k, v = (t.clone().as_subclass(kind).requires_grad_() for t in tensors)
        out = common.causal_sdpa(q, k, v)
        out.backward(torch.ones_like(out))
        grads.append([out, q.grad, k.grad, v.grad])
    for grouped, repeated in zip(*grads, strict=True):
        assert torch.allclose(grouped, repeated.as_subclass(torch.Tensor), atol=1e-5)


# --- 2: every script at the world sizes of a GPU host, Makefile defaults -----------------------
class ReachedSetup(Exception):
    """The script's own checks passed: it would now join the group and train."""


def runs() -> list:
    return [pytest.param(script, flags, id=f"{script.stem}{''.join(flags)}")
            for script in SCRIPTS for flags in [[], *EXTRA_FLAGS.get(script.stem, [])]]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("world", [1, 3, 4, 8])
@pytest.mark.parametrize("script, flags", runs())
def test_every_script_runs_or_skips_at_the_makefiles_defaults(script, flags, world, gpu,
                                                             monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", [str(script), "--size", "small", *flags])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)  # the defaults follow it (bf16)

    def reached(args, **kwargs):
        raise ReachedSetup

    monkeypatch.setattr(common, "setup", reached)
    recipe = load_recipe(script)
    with pytest.raises((ReachedSetup, common.Skip)) as outcome:
        recipe.main()  # an exit 2 (SystemExit) fails the test
    if outcome.type is common.Skip:
        assert ": " in str(outcome.value)  # why, and what to change


def test_a_script_that_skips_before_setup_records_it_once(tmp_path):
    """DualPipe at an odd world size skips from its flags alone: recorded, rank 0 only. Each
    rank in a fresh Python: in pytest's process the record's world size followed what earlier
    tests left behind (1, not 3)."""
    import subprocess

    from helpers import cpu_env

    results = tmp_path / "r.jsonl"
    for rank in (0, 1):
        run = subprocess.run([sys.executable, "05_pipeline/optimized_pipeline_dualpipe.py",
                              "--results", str(results)], cwd=common.ROOT, capture_output=True,
                             text=True, timeout=120, env=cpu_env(WORLD_SIZE="3", RANK=str(rank)))
        assert run.returncode == 0, run.stderr
    (rec,) = common.load_results(results)
    assert (rec["status"], rec["world_size"]) == ("skipped", 3)
    assert "even number of processes" in rec["reason"]


# --- 7: tolerances follow the dtype ---------------------------------------------------------------
@pytest.mark.parametrize("script", [
    "02_compression/optimized_compression_int8.py",
    "02_compression/optimized_compression_powersgd.py", "03_fsdp/optimized_fsdp.py",
    "03_fsdp/optimized_fsdp_checkpoint.py", "03_fsdp/optimized_fsdp_fp8.py",
    "04_zero/optimized_zero1.py", "04_zero/optimized_zero2.py", "04_zero/optimized_zero3.py",
    "04_zero/optimized_zero_pytorch.py",
    "06_symmem/optimized_symmem_training.py", "06_symmem/baseline_symmem_tp.py",
    "06_symmem/optimized_symmem_tp.py", "06_symmem/optimized_symmem_tp_pytorch.py"])
def test_every_tolerance_table_has_a_figure_for_each_dtype(script):
    table = load_recipe(common.ROOT / script).LOSS_TOLERANCE
    for dtype in ("fp32", "bf16"):
        assert dtype in table or {(dtype, False), (dtype, True)} <= set(table), table
    fp32 = table.get("fp32", table.get(("fp32", False)))
    bf16 = table.get("bf16", table.get(("bf16", False)))
    assert bf16 >= fp32  # bf16 rounds more, never less


# --- 3: the suite is the CPU suite on a GPU host too -------------------------------------------
def test_every_launch_of_the_tests_hides_the_gpus(monkeypatch, tmp_path):
    import subprocess

    import helpers

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a GPU host
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kwargs: started.append(kwargs))
    helpers.torchrun(common.ROOT / "01_ddp" / "baseline_ddp.py", tmp_path / "r.jsonl")
    assert started[0]["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert helpers.cpu_env(WORLD_SIZE="3")["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.undo()
    make = subprocess.run(["make", "-n", "test", f"PYTHON={sys.executable}"], cwd=common.ROOT,
                          capture_output=True, text=True, timeout=60)
    assert f"CUDA_VISIBLE_DEVICES= {sys.executable} -m pytest" in make.stdout


def test_the_smoke_never_touches_cuda_in_the_process_it_forks_from(tmp_path, monkeypatch):
    """A child forked after its parent initialised CUDA cannot use it: one failure recorded from
    the parent (which reads the device name) would fail every later run on a GPU host."""
    (tmp_path / "09_x").mkdir()
    (tmp_path / "09_x" / "optimized_raises.py").write_text(
        "raise RuntimeError('broken on purpose')\n")
    monkeypatch.chdir(tmp_path)

    def touched(*_, **__):
        raise AssertionError("the smoke's parent touched torch.cuda")

    for name in ("is_available", "get_device_name", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, name, touched)
    assert smoke(["09_x/optimized_raises.py"], 1, ["--size", "tiny"], tmp_path / "out",
                        timeout=60) == 1
    (rec,) = common.load_results(tmp_path / "out" / "results.jsonl")
    assert rec["status"] == "failed" and "exited with code 1" in rec["reason"]


def test_a_compiled_cuda_run_waits_out_a_slow_first_compile(monkeypatch):
    """`make smoke` gives every run --timeout 60; a compiled run on CUDA (FP8's blocks, DTensor
    TP's) would trip it while one of 8 ranks is still in inductor: its group waits at least
    COMPILE_TIMEOUT_S. Stubbed: CUDA present, the group's creation captured."""
    joined = {}

    def init_process_group(backend, timeout, **kwargs):
        joined.update(backend=backend, timeout=timeout.total_seconds())
        raise InterruptedError  # what follows needs a real group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(common.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(common, "_restarted_group_store", lambda timeout: None)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    args = tiny_args("--timeout", "60")
    for compiles, waits in [(False, 60), (True, common.COMPILE_TIMEOUT_S)]:
        with pytest.raises(InterruptedError):
            common.setup(args, compiles=compiles)
        assert joined == {"backend": "nccl", "timeout": waits}
    fp8 = (common.ROOT / "03_fsdp" / "optimized_fsdp_fp8.py").read_text()
    assert "common.setup(args, compiles=compile_blocks)" in fp8
    dtensor_tp = (common.ROOT / "06_symmem" / "optimized_symmem_tp_pytorch.py").read_text()
    assert re.search(r"common\.setup\(\w+, compiles=True\)", dtensor_tp)
