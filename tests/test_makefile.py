"""The Makefile's contract: help by default, a failing script fails its target, prints its log
and still leaves a `failed` row that the report shows; LINK really slows the ranks' loopback."""

import shutil
import subprocess
import sys
import textwrap

import pytest

import common

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
    """The Makefile, common.py and report.py with one numbered folder of the given scripts."""
    for name in ["Makefile", "common.py", "report.py"]:
        shutil.copy(common.ROOT / name, root)
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
    assert "RuntimeError: broken on purpose" in run.stdout  # the log is shown
    assert "FAILED: 09_broken/baseline_raises.py" in run.stdout
    assert "FAILED: 09_broken/optimized_dies.py" in run.stdout  # the first failure did not stop it

    records = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert len(records) == 2  # one row per run: the Makefile does not add a second
    rows = {r["script"]: r for r in records}
    assert rows["baseline_raises"]["reason"] == "RuntimeError: broken on purpose"
    assert rows["optimized_dies"]["reason"].startswith("torchrun failed, see outputs/logs/")
    assert {r["status"] for r in records} == {"failed"}

    report = subprocess.run([*make, "report"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0
    assert "failed: RuntimeError: broken on purpose" in report.stdout
    assert (tmp_path / "outputs" / "report.md").exists()


def test_a_folders_extra_runs_are_runs_of_their_own_with_their_flags(tmp_path):
    """04_zero adds `optimized_zero_pytorch.py --stage 3` to its scripts' runs: its own log, and
    a failed row that names its flags (the script here dies, so the Makefile writes the row)."""
    project_copy(tmp_path, "04_zero",
                 {"optimized_zero_pytorch.py": textwrap.dedent(DIES).lstrip()})
    make = ["make", f"PYTHON={sys.executable}", "NPROC=1", "SIZE=tiny",
            f"MASTER_PORT={common.free_port()}"]
    run = subprocess.run([*make, "zero"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode != 0
    assert "FAILED: 04_zero/optimized_zero_pytorch.py --stage 3" in run.stdout
    assert (tmp_path / "outputs" / "logs" / "optimized_zero_pytorch--stage3.log").exists()
    records = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert sorted(str(r["variant"]) for r in records) == ["--stage 3", "None"]


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
    assert (tmp_path / "outputs" / "logs" / "baseline_ddp.node1.log").exists()
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
    project_copy(tmp_path, "01_ddp",
                 {"baseline_ddp.py": (common.ROOT / "01_ddp" / "baseline_ddp.py").read_text()})
    run = subprocess.run(["make", "ddp", f"PYTHON={sys.executable}", "NPROC=2", "SIZE=tiny",
                          "STEPS=2", "ARGS=--warmup 1 --timeout 60", "RESTARTS=1", "RDZV=c10d",
                          f"MASTER_PORT={common.free_port()}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    (rec,) = common.load_results(tmp_path / "outputs" / "results.jsonl")
    assert rec["status"] == "ok" and rec["world_size"] == 2
    dry = subprocess.run(["make", "-n", "ddp", f"PYTHON={sys.executable}", "RESTARTS=1",
                          "RDZV=c10d"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "--max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:" in dry.stdout
