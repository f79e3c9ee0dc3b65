"""The Makefile's contract: help by default, a failing script fails its target, shows its own
error line and still leaves a `failed` row that the report shows; variables are checked before
anything starts; NPROC follows the GPUs the host shows; a host whose GPUs torch cannot use stops
in one line; `make smoke` gives a line per script; LINK really slows the ranks' loopback and
refuses on GPUs."""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

import common
from report import results_table

RAISES = '''
    """Raises after joining the group: run_main records the failure itself."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common


    def main():
        common.setup(common.parser(__doc__).parse_args())
        raise RuntimeError("broken on purpose")


    if __name__ == "__main__":
        common.run_main(main)
'''

DIES = '''
    """Dies without a word, as a killed or crashed process would: no record of its own."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common

    common.setup(common.parser(__doc__).parse_args())
    os._exit(3)
'''


def project_copy(root, folder: str, scripts: dict[str, str]):
    """The Makefile, common.py and report/ with one numbered folder of the given scripts."""
    for name in ["Makefile", "common.py"]:
        shutil.copy(common.ROOT / name, root)
    shutil.copytree(common.ROOT / "report", root / "report",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / folder).mkdir()
    for name, text in scripts.items():
        (root / folder / name).write_text(text)


def test_make_alone_prints_help():
    run = subprocess.run(["make"], cwd=common.ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    assert "make all report" in run.stdout and "make test" in run.stdout
    assert "ddp" in run.stdout


def test_failing_scripts_fail_the_target_show_their_log_and_are_reported(tmp_path):
    project_copy(tmp_path, "09_broken", {"baseline_raises.py": textwrap.dedent(RAISES).lstrip(),
                                         "optimized_dies.py": textwrap.dedent(DIES).lstrip()})
    make = ["make", f"PYTHON={sys.executable}", "NPROC=1", "SIZE=tiny",
            f"MASTER_PORT={common.free_port()}"]

    run = subprocess.run([*make, "broken"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode != 0
    # each failure is its own error line on the terminal; tracebacks stay in the log
    assert "FAILED: 09_broken/baseline_raises.py: RuntimeError: broken on purpose (log: " \
        "outputs/logs/baseline_raises.tiny.w1.log)" in run.stdout
    assert "FAILED: 09_broken/optimized_dies.py: rank 0 exited with code 3 (log: " \
        in run.stdout  # the first failure did not stop it
    assert "Traceback" not in run.stdout
    assert "Traceback" in (tmp_path / "outputs/logs/baseline_raises.tiny.w1.log").read_text()

    records = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert len(records) == 2  # one row per run: the Makefile does not add a second
    rows = {r["script"]: r for r in records}
    assert rows["baseline_raises"]["reason"] == "RuntimeError: broken on purpose"
    assert rows["optimized_dies"]["reason"] == "rank 0 exited with code 3"
    assert {r["status"] for r in records} == {"failed"}

    shown = subprocess.run([*make, "report"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0
    assert "failed: RuntimeError: broken on purpose" in shown.stdout
    assert (tmp_path / "outputs" / "report.md").exists()


def test_a_folders_extra_runs_are_runs_of_their_own_with_their_flags(tmp_path):
    """04_zero adds `optimized_zero_pytorch.py --stage 3` (and `--stage 3 --cpu-offload`) to its
    scripts' runs: each its own log, and a failed row that names its flags (the script here
    dies, so the Makefile writes the row)."""
    project_copy(tmp_path, "04_zero",
                 {"optimized_zero_pytorch.py": textwrap.dedent(DIES).lstrip()})
    make = ["make", f"PYTHON={sys.executable}", "NPROC=1", "SIZE=tiny",
            f"MASTER_PORT={common.free_port()}"]
    run = subprocess.run([*make, "zero"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode != 0
    assert "FAILED: 04_zero/optimized_zero_pytorch.py --stage 3" in run.stdout
    # logs are named after the run's setup: a rerun at another size or world keeps this one
    assert (tmp_path / "outputs" / "logs" / "optimized_zero_pytorch--stage3.tiny.w1.log").exists()
    records = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert sorted(str(r["variant"]) for r in records) == ["--stage 3", "--stage 3 --cpu-offload",
                                                          "None"]


def test_two_nodes_through_make(tmp_path):
    """`make ddp` once per node: both succeed, though only node 0 holds rank 0 and prints."""
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    port = common.free_port()
    nodes = [subprocess.Popen(["make", "ddp", f"PYTHON={sys.executable}", "NPROC=1", "NNODES=2",
                               f"NODE_RANK={rank}", "MASTER_ADDR=127.0.0.1",
                               f"MASTER_PORT={port}", "SIZE=tiny", "STEPS=2",
                               "ARGS=--warmup 1 --timeout 60"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "baseline_ddp: " in outputs[0]  # rank 0's summary line
    assert (tmp_path / "outputs" / "logs" / "baseline_ddp.tiny.w2.node1.log").exists()
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert (rec["status"], rec["world_size"], rec["nnodes"]) == ("ok", 2, 2)


PROBE = '''
    """Each step all-reduces 4 MiB beside a tiny model; records the qdisc its loopback has."""
    import subprocess
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common


    def main():
        args = common.parser(__doc__).parse_args()
        topo = common.setup(args)
        model, batches = common.workload(args, topo)
        payload = torch.zeros(2**20)

        def train_step(inputs, targets):
            dist.all_reduce(payload)
            return model(inputs, targets)

        stats = common.timed_steps(train_step, batches, args, topo)
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                               text=True).stdout
        common.record(args, topo, stats, baseline=None, model=model, optimizer=None,
                      comm_mb=common.ring_allreduce_mb(payload.nbytes, topo.world_size),
                      theory={}, qdisc=qdisc)


    if __name__ == "__main__":
        common.run_main(main)
'''


def test_link_runs_the_launch_behind_a_rate_limited_loopback(tmp_path):
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("LINK needs root (unshare --net), which this machine does not give")
    project_copy(tmp_path, "09_probe", {"baseline_probe.py": textwrap.dedent(PROBE).lstrip()})
    run = subprocess.run(["make", "probe", f"PYTHON={sys.executable}", "NPROC=2", "SIZE=tiny",
                          "STEPS=2", "ARGS=--warmup 1 --timeout 60", "LINK=100mbit"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert rec["status"] == "ok" and rec["link"] == "100mbit"
    assert "tbf" in rec["qdisc"] and "rate 100Mbit" in rec["qdisc"]
    # each rank sends 4 MiB a step and the shaped loopback carries 12.5 MB/s in all: ~0.7 s
    assert rec["step_ms"] > 400


def test_restarts_and_c10d_rendezvous_pass_through_to_torchrun(tmp_path):
    """... and the target takes its quick calibration first (CALIBRATE=1, which the suite
    otherwise turns off), at which the report prices the run; a second finds it young enough."""
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    run = subprocess.run(["make", "ddp", f"PYTHON={sys.executable}", "NPROC=2", "SIZE=tiny",
                          "STEPS=2", "ARGS=--warmup 1 --timeout 60", "RESTARTS=1", "RDZV=c10d",
                          f"MASTER_PORT={common.free_port()}", "CALIBRATE=1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert rec["status"] == "ok" and rec["world_size"] == 2
    calibration = tmp_path / "outputs" / "calibration.json"
    entry = json.loads(calibration.read_text())["sizes"]["tiny"]
    assert entry["quick"] and list(entry["worlds"]) == ["2"] and entry["models"] == ["gpt"]
    priced = subprocess.run([sys.executable, "-m", "report", "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    (row,) = [json.loads(line) for line in priced.stdout.splitlines()]
    assert row["calibration"] == entry["id"] and row["predicted_step_ms"] > 0
    again = subprocess.run([sys.executable, "-m", "report", "calibrate", "--quick", "--if-older",
                            "3600", "--size", "tiny", "--models", "gpt", "--worlds", "2"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == ""
    assert json.loads(calibration.read_text())["sizes"]["tiny"] == entry
    dry = subprocess.run(["make", "-n", "ddp", f"PYTHON={sys.executable}", "RESTARTS=1",
                          "RDZV=c10d"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "--max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:" in dry.stdout


PORT_PROBE = '''
    """Says which port torchrun's rendezvous listens on; nothing else."""
    import os

    if os.environ["RANK"] == "0":
        print("baseline_probe: port", os.environ["MASTER_PORT"])
'''


def test_a_one_node_run_takes_a_free_port_and_a_busy_given_one_is_one_line(tmp_path):
    """Two `make` runs on one host: the default run does not take 29500 (held here, or by
    someone else) but a free port; a MASTER_PORT the user gave that is busy is the row's line."""
    project_copy(tmp_path, "09_probe", {"baseline_probe.py": textwrap.dedent(PORT_PROBE)})
    make = ["make", "--no-print-directory", "probe", f"PYTHON={sys.executable}", "NPROC=1",
            "SIZE=tiny"]
    with socket.socket() as default, socket.socket() as busy:
        with contextlib.suppress(OSError):  # already busy: as good
            default.bind(("127.0.0.1", 29500))
            default.listen()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = subprocess.run(make, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        given = subprocess.run([*make, f"MASTER_PORT={port}"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
    assert free.returncode == 0, free.stdout + free.stderr
    (line,) = [out for out in free.stdout.splitlines() if out.startswith("baseline_probe:")]
    assert line.split()[-1] != "29500"
    assert given.returncode != 0
    (failed,) = [out for out in given.stdout.splitlines() if out.startswith("FAILED")]
    assert f"port {port} is busy (another run on this host?), no rank started: choose " \
        "another with MASTER_PORT=<n>" in failed, given.stdout
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert rec["status"] == "failed" and rec["reason"].startswith(f"port {port} is busy")


def test_a_mesh_run_at_other_than_nproc_processes_says_so_on_its_launch_line(tmp_path):
    """`make fsdp NPROC=3` on CPU: the dp x tp runs take 4 processes, and their `==` lines say
    why; the folder's own runs, at NPROC, say nothing."""
    probe = "print('probe: ran')\n"
    project_copy(tmp_path, "03_fsdp", {"baseline_fsdp.py": probe, "optimized_fsdp_tp.py": probe})
    run = subprocess.run(["make", "--no-print-directory", "fsdp", f"PYTHON={sys.executable}",
                          "CPU=1", "NPROC=3", "SIZE=tiny", "EXTRA_RUNS_fsdp="],  # probes only
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    launches = [line for line in run.stdout.splitlines() if line.startswith("== ")]
    why = " (NPROC=3 -> 4: on CPU the dp x tp mesh runs at dp 2 x tp 2), size tiny"
    assert launches == [
        "== 03_fsdp/baseline_fsdp.py: 1 node(s) x 3 process(es), size tiny -> "
        "outputs/logs/baseline_fsdp.tiny.w3.log",
        f"== 03_fsdp/baseline_fsdp.py: 1 node(s) x 4 process(es){why} -> "
        "outputs/logs/baseline_fsdp.tiny.w4.log",
        f"== 03_fsdp/optimized_fsdp_tp.py: 1 node(s) x 4 process(es){why} -> "
        "outputs/logs/optimized_fsdp_tp.tiny.w4.log"], run.stdout


def test_model_passes_to_every_script_and_names_its_logs(tmp_path):
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    dry = subprocess.run(["make", "-n", "ddp", f"PYTHON={sys.executable}", "MODEL=llama"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "--size small --model llama" in dry.stdout
    # beside the GPT run's logs, not over them (the world, w2, is the shell's: a mesh run's own)
    assert ".small.llama.w$(( nproc * 1 )).log" in dry.stdout
    default = subprocess.run(["make", "-n", "ddp", f"PYTHON={sys.executable}"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert "--model" not in default.stdout  # each script's own default: the GPT
    extra = {model: subprocess.run(["make", "-n", "symmem", f"PYTHON={sys.executable}",
                                    f"MODEL={model}"], cwd=common.ROOT, capture_output=True,
                                   text=True, timeout=60).stdout for model in ["llama", "resnet"]}
    assert "--seq-len 32" in extra["llama"] and "--seq-len 32" not in extra["resnet"]


def test_a_run_its_script_refuses_shows_and_records_the_scripts_own_line(tmp_path):
    project_copy(tmp_path, "01_ddp",
                 {"optimized_ddp.py": (common.ROOT / "01_ddp" / "optimized_ddp.py").read_text()})
    run = subprocess.run(["make", "ddp", f"PYTHON={sys.executable}", "NPROC=2", "SIZE=tiny",
                          "ARGS=--accum 3", f"MASTER_PORT={common.free_port()}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    line = "optimized_ddp.py: error: --batch-size 4 does not split into --accum 3 micro-batches"
    failed = [out for out in run.stdout.splitlines() if out.startswith("FAILED")]
    assert len(failed) == 1 and line in failed[0], run.stdout
    assert "Traceback" not in run.stdout + run.stderr  # torchrun's stays in the log
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert rec["status"] == "failed" and rec["reason"].startswith(line)
    assert (rec["world_size"], rec["size"], rec["variant"]) == (2, "tiny", "--accum 3")


@pytest.mark.parametrize("setting, hint", [
    ("SIZE=huge", "SIZE=huge is not a size: use tiny, small, medium or large"),
    ("NPROC=0", "NPROC=0 is not a number of processes"),
    ("NNODES=two", "NNODES=two is not a number of nodes"),
    ("NODE_RANK=1", "NODE_RANK=1 must be 0 to NNODES-1"),
    ("STEPS=ten", "STEPS=ten is not a number of steps"),
    ("MODEL=gpt2", "MODEL=gpt2 is not a model: use gpt, llama, moe or resnet"),
])
def test_a_bad_variable_is_one_line_before_anything_starts(setting, hint, tmp_path):
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    run = subprocess.run(["make", "ddp", f"PYTHON={sys.executable}", setting], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and hint in run.stderr, run.stderr
    assert not (tmp_path / "outputs").exists()


def test_an_unknown_target_says_how_to_list_them():
    run = subprocess.run(["make", "dpp"], cwd=common.ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "no target 'dpp': run `make` for the list" in run.stderr


def gpu_host(tmp_path, gpus: int) -> dict[str, str]:
    """The environment of a host whose nvidia-smi lists `gpus` GPUs (a stub on PATH; torch here
    sees none, as on a host whose driver is older than torch's CUDA build)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3'\n"
                                            for i in range(gpus)))
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}"}


@pytest.mark.parametrize("visible, cpu, nproc", [
    (None, False, 8),  # every GPU nvidia-smi lists
    ("0,1", False, 2),  # the ones CUDA_VISIBLE_DEVICES names
    ("", False, 2),  # none visible: the CPU default
    (None, True, 2),  # CPU=1 hides them
])
def test_nproc_follows_the_gpus_the_host_shows(visible, cpu, nproc, tmp_path):
    env = gpu_host(tmp_path, 8)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    run = subprocess.run(["make", *(["CPU=1"] if cpu else [])], cwd=common.ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert f"NPROC={nproc} " in run.stdout


def test_a_host_whose_gpus_torch_cannot_use_stops_in_one_line(tmp_path):
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    run = subprocess.run(["make", "ddp", f"PYTHON={sys.executable}", "SIZE=tiny"], cwd=tmp_path,
                         env=gpu_host(tmp_path, 2), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "this host has 2 GPU(s), but torch" in run.stderr and "CPU=1" in run.stderr
    assert not (tmp_path / "outputs").exists()  # nothing started on the CPU in their place


def test_link_refuses_on_a_gpu_host(tmp_path):
    run = subprocess.run(["make", "ddp", "LINK=1gbit"], cwd=common.ROOT,
                         env=gpu_host(tmp_path, 2), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1
    assert "NCCL does not use" in run.stderr and "drop LINK" in run.stderr


SKIPS = '''
    """Lacks what it needs on this host: skipped, with why."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common


    def main():
        common.parser(__doc__).parse_args()
        raise common.Skip("needs a GPU: run on one")


    if __name__ == "__main__":
        common.run_main(main)
'''


def test_smoke_is_one_line_a_script_and_fails_if_any_failed(tmp_path):
    """On a host with GPUs torch cannot use, CPU=1 runs the smoke on CPU instead."""
    ddp = (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()
    strays = ddp.replace("lr=args.lr", "lr=2 * args.lr").replace(  # other losses, a tolerance
        "baseline=None,", "baseline='baseline_ok', loss_tolerance=1e-3,")
    assert strays.count("2 * args.lr") == strays.count("loss_tolerance=1e-3") == 1
    project_copy(tmp_path, "09_smoke", {
        "baseline_ok.py": ddp, "optimized_raises.py": textwrap.dedent(RAISES).lstrip(),
        # a name longer than most: the verdicts still line up in one column
        "optimized_skips_on_any_host_that_lacks_the_gpu_it_needs_to_run.py":
            textwrap.dedent(SKIPS).lstrip(),
        "optimized_strays.py": strays})
    run = subprocess.run(["make", "--no-print-directory", "smoke", f"PYTHON={sys.executable}",
                          "CPU=1"], cwd=tmp_path,
                         env=gpu_host(tmp_path, 2), capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 5, run.stdout  # a line a script, then the count
    assert lines[0].startswith("09_smoke/baseline_ok.py") and " ok (" in lines[0]
    assert "FAILED: RuntimeError: broken on purpose (log: " in lines[1]
    assert lines[2].endswith("skipped: needs a GPU: run on one")
    assert "over tolerance (max loss difference " in lines[3] and "> 0.001)" in lines[3]
    assert lines[4].startswith("smoke: 4 runs, 1 failed, 1 over tolerance")
    verdicts = [re.search(r" (ok \(|FAILED: |skipped: |over tolerance)", line)
                for line in lines[:4]]
    assert len({v.start() for v in verdicts}) == 1  # one column, however long a run's name
    assert len(common.load_results(tmp_path / "outputs" / "smoke" / "results.jsonl")) == 4
    assert not (tmp_path / "outputs" / "results.jsonl").exists()  # not the report's


def test_a_bad_args_flag_stops_the_folder_before_any_launch(tmp_path):
    """`make zero ARGS='--steps abc'`: the first script's parser reads ARGS before anything is
    launched, so the run ends on its one line, not with a failed row a script."""
    project_copy(tmp_path, "04_zero", {
        name: (common.ROOT / "04_zero" / name).read_text()
        for name in ["baseline_zero.py", "optimized_zero1.py"]})
    run = subprocess.run(["make", "--no-print-directory", "zero", f"PYTHON={sys.executable}",
                          "ARGS=--steps abc"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0 and "==" not in run.stdout, run.stdout
    (line,) = [out for out in run.stderr.splitlines() if "error:" in out and "make" not in out]
    assert line == "baseline_zero.py: error: argument --steps: expected an integer, got 'abc'"
    assert not (tmp_path / "outputs" / "results.jsonl").exists()


@pytest.mark.parametrize("size", ["small", "medium"])
def test_every_run_make_all_times_rests_on_enough_steps_for_a_speedup(size):
    """A row the report may set beside another (a speedup, in the table or a README) times at
    least MIN_TIMED_STEPS steps; a run of fewer is a memory row (MEMORY_RUN's flags), whose time
    the report never compares (07's rows at 2x and 4x the length, one sequence a rank)."""
    dry = subprocess.run(["make", "-n", "all", f"PYTHON={sys.executable}", f"SIZE={size}"],
                         cwd=common.ROOT, capture_output=True, text=True, timeout=60).stdout
    memory_run = re.search(r"^MEMORY_RUN := (.*)$", (common.ROOT / "Makefile").read_text(),
                           re.M)[1]
    runs = set(re.findall(r'"(\d\d_\w+/\w+\.py [^"]*--steps \d+[^"]*)"', dry))
    assert runs, "make -n all shows no run with --steps: the check reads the wrong thing"
    few = [run for run in runs if int(re.search(r"--steps (\d+)", run)[1])
           < results_table.MIN_TIMED_STEPS and memory_run not in run]
    assert not few, f"Makefile: {few[0]!r} times fewer than {results_table.MIN_TIMED_STEPS} " \
                    "steps: a speedup would rest on them (use SHORT_RUN, or MEMORY_RUN for a " \
                    "memory row)"
