"""What the launch and unit tests share: torchrun launches, their records, loading a recipe."""

import ast
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import common
from report import results_table

TINY = ["--size", "tiny", "--steps", "6", "--warmup", "2", "--timeout", "60"]
LAUNCH_TIMEOUT = 240  # seconds for one launch, start-up included


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of every process the tests start: the GPUs hidden, so that on a GPU host
    the suite stays the CPU suite (gloo, fp32, any number of ranks) instead of picking NCCL and
    asking rank 1 for a `cuda:1` a one-GPU box lacks."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


def torchrun(script: Path, results: Path, *flags: str, nproc: int = 2,
             extra_torchrun=("--standalone",)) -> subprocess.Popen:
    """Start `script` at `tiny` under torchrun; `finish` waits for it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           *extra_torchrun, str(script), *TINY, "--results", str(results), *flags]
    return subprocess.Popen(cmd, cwd=common.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cpu_env())


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, out[-3000:]
    return out


# Launches a fixture keeps in flight at once. A tiny launch is mostly start-up (imports, the
# rendezvous, torchrun's agent polling its workers), so a second one fills the gaps of the first.
LAUNCHES_IN_FLIGHT = 2


def finish_all(starts: list[Callable[[], subprocess.Popen]],
               in_flight: int = LAUNCHES_IN_FLIGHT) -> list[str]:
    """Run the launches each of `starts` begins (a `torchrun(...)` call), `in_flight` at a time,
    and return their consoles in order; any that fails fails the fixture, as `finish`."""
    consoles, running = [None] * len(starts), []
    for i, start in enumerate(starts):
        running.append((i, start()))
        if len(running) == in_flight:
            j, proc = running.pop(0)
            consoles[j] = finish(proc)
    for j, proc in running:
        consoles[j] = finish(proc)
    return consoles


def only_record(results: Path) -> dict:
    records = common.load_results(results)
    assert len(records) == 1, records
    return records[0]


def assert_within_its_tolerance(rec: dict, base: dict) -> None:
    """Every step's loss within the tolerance the run's script states, against its baseline's
    run: what the report prints as `ok` rather than `over tolerance`."""
    diff = results_table.max_loss_diff(rec["losses"], base["losses"])
    assert diff is not None and rec["loss_tolerance"] is not None, (rec["script"], diff)
    assert diff <= rec["loss_tolerance"], \
        f"{rec['script']}: max loss difference {diff:.3g} over its {rec['loss_tolerance']:g}"
    assert not results_table.over_tolerance(rec, base)


def load_recipe(path: Path) -> ModuleType:
    """Import a recipe by path (its folder name starts with a digit, so `import` cannot)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_bad_input_is_one_line(script: Path, flags: list[str], hint: str, tmp_path: Path,
                                 **env: str) -> None:
    """The script refuses `flags` with exit 2 and one line naming `hint`, and records nothing.

    Run in this process, its `setup` replaced by an error: a refusal happens before the group
    is joined, and a fresh Python for each case would cost seconds of start-up."""
    results = tmp_path / "r.jsonl"

    def reached(args, **kwargs):
        raise AssertionError(f"{script.name} accepted {flags}")

    saved = dict(os.environ), sys.argv, common.setup
    os.environ.update(env)
    sys.argv, common.setup = [str(script), *flags, "--results", str(results)], reached
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as refused:
            load_recipe(script).main()
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv, common.setup = saved[1], saved[2]
    assert refused.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and hint in lines[0], err.getvalue()
    assert not results.exists()


def assert_skipped_with_why(script: Path, flags: list[str], hint: str, tmp_path: Path) -> None:
    """The script, asked for what it does not apply to (`--model resnet` to a pipeline), records
    `skipped` with a reason naming `hint`, prints that one line and exits 0, before joining the
    group. In this process, as `assert_bad_input_is_one_line`."""
    results = tmp_path / "r.jsonl"

    def reached(args, **kwargs):
        raise AssertionError(f"{script.name} went on with {flags}")

    saved = sys.argv, common.setup, common.faulthandler.enable
    sys.argv, common.setup = [str(script), *flags, "--results", str(results)], reached
    common.faulthandler.enable = lambda: None  # it needs a real stderr; this one is a StringIO
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            common.run_main(load_recipe(script).main)
    finally:
        sys.argv, common.setup, common.faulthandler.enable = saved
    (line,) = err.getvalue().strip().splitlines()
    assert line.startswith("skipped: ") and hint in line, line
    (rec,) = common.load_results(results)
    assert rec["status"] == "skipped" and hint in rec["reason"]

def forked_runs(runs: list[str], nproc: int, out: Path, flags: list[str]) -> list[dict]:
    """Each run (a script and its flags, with `flags` for all) at `nproc` ranks forked from one
    Python, as `make smoke` runs them (`python -m report smoke`: torch imported once a world, not
    once a rank and once more for torchrun's agent); their records, in order. The runs' logs
    are under out/smoke/logs/."""
    done = subprocess.run(
        [sys.executable, "-m", "report", "--out", str(out / "report.md"), "smoke", "--nproc",
         str(nproc), "--timeout", "300", "--flags", " ".join(flags), "--", *runs],
        cwd=common.ROOT, capture_output=True, text=True, timeout=900, env=cpu_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = common.load_results(out / "smoke" / "results.jsonl")
    assert len(records) == len(runs), done.stdout
    return records


def as_rank(rank: int, world: int, port: int | None = None) -> None:
    """This process as torchrun would start rank `rank` of `world` on one host (its port: the
    run's own, or each run's, set before it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)


def world_of_one(script: Path, *flags: str) -> str:
    """`python <script> <flags>`, a world of one, run in this process (a fresh Python costs
    seconds of start-up): what it printed. The environment the run's setup filled, its argv and
    pytest's faulthandler are as they were after it."""
    saved = dict(os.environ), sys.argv, common.faulthandler.enable
    sys.argv = [str(script), *flags]
    common.faulthandler.enable = lambda: None  # pytest's own stays in place
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            common.run_main(load_recipe(script).main)
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv, common.faulthandler.enable = saved[1], saved[2]
    return out.getvalue()


def readme_python_block(readme: Path, heading: str = "## Use it in your trainer") -> str:
    """The one ```python block of the README's section under `heading` (up to the next heading
    of its level or above), as it stands: what a "Use it in your trainer" test runs."""
    level = len(heading.split(" ", 1)[0])
    lines = readme.read_text().split(f"\n{heading}\n", 1)[1].splitlines()
    blocks, block, fence = [], [], None  # fence: the open fence's language, None outside one
    for line in lines:
        if line.startswith("```"):
            if fence == "python":
                blocks.append("\n".join(block) + "\n")
            fence, block = (line[3:].strip() if fence is None else None), []
        elif fence is not None:
            block.append(line)
        elif re.match(rf"#{{1,{level}}} ", line):
            break
    (only,) = blocks
    return only


def run_then_leave(worker: Callable, rank: int, *args) -> None:
    """A spawned worker's body (`mp.spawn(functools.partial(run_then_leave, worker), ...)`),
    then its process ends as common.run_main ends a script's: flushed, without the interpreter's
    teardown, where gloo's threads have aborted a worker whose checks all ran (SIGABRT,
    "terminate called without an active exception"). A worker that raises never gets here:
    spawn reports its error."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report_rows(text: str) -> dict[str, dict[str, str]]:
    """The report's narrow tables read back: each row's cells by header, under its script label,
    its status whole (the cell's `[n]` replaced by note n, which the table lists below it)."""
    items = re.sub(r"\n  (?=\S)", " ", text)  # a wrapped list item, on one line again
    notes = dict(re.findall(r"^- \[(\d+)\] (.*)$", items, re.M))
    rows, headers = {}, None
    for line in text.splitlines():
        if line.startswith("| script "):
            headers = [cell.strip() for cell in line.strip("|").split("|")]
        elif headers and line.startswith("|") and not line.startswith("|--"):
            cells = dict(zip(headers, [cell.strip() for cell in line.strip("|").split("|")],
                             strict=True))
            if mark := re.search(r" \[(\d+)\]$", cells["status"]):
                cells["status"] = notes[mark[1]]
            rows[cells["script"]] = cells
        elif not line.startswith("|"):
            headers = None
    return rows


# A copy's marker, `# Copied from <script>: <name>` (tests/test_copies.py), a changed one's too
COPY_MARKER = re.compile(r"^# Copied from (\S+\.py): (\w+)\b")
OWN_LINES_WARNING = 350  # CONTRIBUTING: about 300 lines of a script's own


def own_lines(script: Path) -> int:
    """A script's lines less its marked copies' (each block with its marker line)."""
    text = script.read_text()
    lines = text.splitlines()
    extents = {node.name: (min([node.lineno, *(d.lineno for d in node.decorator_list)]),
                           node.end_lineno) for node in ast.parse(text).body
               if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    copied = sum(extents[m[2]][1] - extents[m[2]][0] + 2 for line in lines
                 if (m := COPY_MARKER.match(line)) and m[2] in extents)
    return len(lines) - copied


def scripts_over_own_lines(root: Path = common.ROOT) -> list[tuple[str, int]]:
    """(script, own lines) of each script past OWN_LINES_WARNING, the longest first."""
    found = [(str(path.relative_to(root)), own_lines(path))
             for path in root.glob("[0-9][0-9]_*/*.py")]
    return sorted([(name, n) for name, n in found if n > OWN_LINES_WARNING],
                  key=lambda pair: -pair[1])


# The models' parameter counts without building them, which records and dry runs are checked
# against (a 70B Llama is never built whole here).
def gpt_param_count(size: common.Size, seq_len: int) -> int:
    """Parameters of `GPT(size, seq_len)` without building it (the head is tied)."""
    d = size.d_model
    per_block = 12 * d * d + 13 * d  # qkv, proj, fc, fc_proj weights and biases, two LayerNorms
    return size.vocab_size * d + seq_len * d + size.n_layers * per_block + 2 * d


def llama_param_count(size: common.Size) -> int:
    """Parameters of `Llama(size)` without building it (no biases; the head is untied)."""
    d, heads_width = size.d_model, size.n_heads * size.attention_head_dim
    # q, o; k, v for the KV heads
    attention = 2 * d * heads_width + 2 * d * size.n_kv_heads * size.attention_head_dim
    per_layer = attention + 3 * d * size.llama_ffn + 2 * d  # gate, up, down; two RMSNorms
    return 2 * size.vocab_size * d + size.n_layers * per_layer + d


def moe_param_counts(size: common.Size) -> tuple[int, int]:
    """(total, active) parameters of the MoE Llama (`--model moe`) without building it: the Llama
    with each MLP replaced by a router (experts x d_model), the routed experts (top_k of them
    active a token) and the shared expert (always active)."""
    d, layers = size.d_model, size.n_layers
    expert = 3 * d * size.expert_ffn  # gate, up, down
    moe_dense = d * size.n_experts + 3 * d * size.shared_expert_ffn  # router, shared expert
    dense = llama_param_count(size) - layers * (3 * d * size.llama_ffn - moe_dense)
    return dense + layers * size.n_experts * expert, dense + layers * size.top_k * expert
