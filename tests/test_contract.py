"""The contract of a technique folder (CONTRIBUTING.md), checked on every numbered folder: each
break is one line naming the file and what it lacks. The check reads the files (`ast`, text),
never imports a script, so it runs as well on a copy with one thing left out (each omission
below gives exactly its one line) and on a throwaway `99_example/` written by following
CONTRIBUTING.md, which `make`, `make smoke`, `make report` and the planner then pick up with no
other edit."""

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_makefile import project_copy

import common
import helpers
from helpers import cpu_env

# `<!-- name:start -->` ... `<!-- name:end -->`: where a folder's measured table sits.
TABLE = re.compile(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", re.S)
TRAINER = re.compile(r"^##+ Use it in your trainer", re.M)
RUN = re.compile(r"^## Run\b", re.M)
RECORDS = {"record", "record_sweep"}  # common's two ways a run records itself
PLANNED_KEYS = {"strategy", "place", "figures"}  # what report/planner.py reads of an entry


def module_constants(tree: ast.Module) -> dict[str, ast.stmt]:
    """Each name a module assigns at its top level, and the assignment."""
    found = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        found.update({t.id: node for t in targets if isinstance(t, ast.Name)})
    return found


def recorded_baselines(tree: ast.Module) -> list[str | None]:
    """What each `common.record(...)` / `record_sweep(...)` call names as `baseline=` (None where
    it names none, or not as a literal script name)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                  getattr(node.func, "id", None)) in RECORDS:
            value = next((k.value for k in node.keywords if k.arg == "baseline"), None)
            names.append(value.value if isinstance(value, ast.Constant)
                         and isinstance(value.value, str) else None)
    return names


def rewritten_args(tree: ast.Module) -> list[str]:
    """The flags a script assigns to after parsing (`args.batch_size = ...`, `args.x += ...`,
    `setattr(args, "x", ...)`), each once, in order: a reader could no longer tell a flag's
    value from the command line."""
    names = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        names += [t.attr for t in targets if isinstance(t, ast.Attribute)
                  and isinstance(t.value, ast.Name) and t.value.id == "args"]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and \
                node.args and getattr(node.args[0], "id", None) == "args":
            name = node.args[1] if len(node.args) > 1 else None
            names.append(name.value if isinstance(name, ast.Constant) else "?")
    return list(dict.fromkeys(names))


# The theory and planner rows by name: what PLANNED names, and the formulas (`ddp_bytes`,
# `tp_theory`, `activation_mb`, `attention_flops`, `uniform_bubble`).
THEORY = re.compile(r"theory|planned|_(bytes|mb|flops|bubble)$")


def order_problems(tree: ast.Module, where: str) -> list[str]:
    """CONTRIBUTING's order of a script's top-level functions and classes: the technique (and
    the plumbing it needs) first, then its theory and planner rows, then main() last, so that
    a reader meets the technique first and a user copies it without the arithmetic."""
    planned = module_constants(tree).get("PLANNED")
    named = {n.id for n in ast.walk(planned) if isinstance(n, ast.Name)} if planned else set()
    seen_theory, problems = None, []
    for node in [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]:
        if seen_theory == "main()":
            problems.append(f"{where}: `{node.name}` sits after main(), which comes last")
        elif node.name == "main":
            seen_theory = "main()"
        elif node.name in named or THEORY.search(node.name):
            seen_theory = seen_theory or f"`{node.name}`"
        elif seen_theory:
            problems.append(f"{where}: `{node.name}` sits after the theory and planner rows "
                            f"(from {seen_theory}): the technique comes first, then its theory, "
                            "then main()")
    return problems


def script_problems(script: Path, where: str) -> list[str]:
    """A script's breaks of the contract: its card, its parsed flags left as parsed; for an
    optimized script, its tolerance, the baseline its record names and its planner entries."""
    text = script.read_text()
    tree = ast.parse(text)
    problems = [] if ast.get_docstring(tree) else \
        [f"{where}: no module docstring (the script card: What/Why/Run/Look for/Theory)"]
    problems += [f"{where}: assigns to args.{name} after parsing (a derived value takes a name "
                 f"of its own: settings = common.resolved(args, {name}=...))"
                 for name in rewritten_args(tree)]
    problems += order_problems(tree, where)
    constants = module_constants(tree)
    planned = constants.get("PLANNED")
    if script.name.startswith("optimized_"):
        if "LOSS_TOLERANCE" not in constants:
            problems.append(f"{where}: no module-level LOSS_TOLERANCE")
        baselines = recorded_baselines(tree)
        if not baselines or None in baselines:
            problems.append(f"{where}: its common.record(...) names no baseline= script")
        problems += [f"{where}: its record names baseline '{name}', which is no script of "
                     f"{script.parent.name}/" for name in baselines
                     if name and not (script.parent / f"{name}.py").exists()]
        if planned is None:
            problems.append(f"{where}: no module-level PLANNED (its planner entries, or PLANNED "
                            "= [] under a comment saying why it adds none)")
    if planned is None:  # a baseline may list planner rows too (06's TP lists TP's)
        return problems
    if not isinstance(planned, ast.Assign) or not isinstance(planned.value, ast.List):
        # report/planner.py finds the scripts with rows by the text `PLANNED = [`
        problems.append(f"{where}: PLANNED is not assigned a list as `PLANNED = [...]`")
        return problems
    if not planned.value.elts and \
            not text.splitlines()[planned.lineno - 2].lstrip().startswith("#"):
        problems.append(f"{where}: PLANNED = [] without a comment line right above saying why "
                        "the technique adds no planner row")
    for entry in [e for e in planned.value.elts if isinstance(e, ast.Dict)]:
        keys = {k.value for k in entry.keys if isinstance(k, ast.Constant)}
        if missing := sorted(PLANNED_KEYS - keys):
            problems.append(f"{where}: a PLANNED entry without {', '.join(missing)} (the planner "
                            "reads each entry's strategy, place and figures)")
    return problems


def folder_problems(root: Path, folder: Path) -> list[str]:
    """A folder's breaks of the contract: its name, scripts, README and launch tests."""
    where = f"{folder.name}/"
    name = folder.name[3:]
    problems = [] if re.fullmatch(r"[a-z0-9]+", name) else \
        [f"{where}: named NN_{name}: make's target is the one word after NN_ (NN_<word>)"]
    for kind in ("baseline", "optimized"):
        if not list(folder.glob(f"{kind}_*.py")):
            problems.append(f"{where}: no {kind}_*.py")
    for script in sorted(folder.glob("*.py")):
        problems += script_problems(script, f"{where}{script.name}")
    readme = folder / "README.md"
    if not readme.exists():
        problems.append(f"{where}README.md: missing")
    else:
        text = readme.read_text()
        if not TABLE.search(text):
            problems.append(f"{where}README.md: no measured table between <!-- name:start --> "
                            "and <!-- name:end --> markers")
        if not RUN.search(text):
            problems.append(f"{where}README.md: no '## Run' section (the make target and the "
                            "direct torchrun line)")
        if not TRAINER.search(text):
            problems.append(f"{where}README.md: no '## Use it in your trainer' section")
    front = root / "README.md"
    if front.exists() and f"| [`{folder.name}`](" not in front.read_text():
        problems.append(f"README.md: no row for {folder.name} in the Techniques table")
    launch_tests = f"tests/test_launch_{name}.py"
    if not (root / launch_tests).exists():
        problems.append(f"{launch_tests}: missing ({where}'s launch tests)")
    return problems


def contract_problems(root: Path) -> list[str]:
    """Every break of the contract in the numbered folders under `root`, one line each."""
    return [line for folder in sorted(root.glob("[0-9][0-9]_*/"))
            for line in folder_problems(root, folder)]


def test_every_folder_keeps_the_contract():
    problems = contract_problems(common.ROOT)
    assert not problems, "\n".join(problems)


# --- Each omission is its one line -----------------------------------------------------------
def contract_copy(root: Path) -> Path:
    """What the contract reads: the top README, the numbered folders' scripts and READMEs, and
    the launch tests' names (empty files)."""
    shutil.copy(common.ROOT / "README.md", root)
    for path in common.ROOT.glob("[0-9][0-9]_*/*"):
        if path.suffix == ".py" or path.name == "README.md":
            (root / path.parent.name).mkdir(exist_ok=True)
            shutil.copy(path, root / path.parent.name)
    (root / "tests").mkdir()
    for path in common.ROOT.glob("tests/test_launch_*.py"):
        (root / "tests" / path.name).touch()
    return root


def without_constant(path: Path, name: str, comment_above: bool = False) -> None:
    """`path` without its module-level `name = ...` (and the comment line right above it)."""
    lines = path.read_text().splitlines(keepends=True)
    node = module_constants(ast.parse("".join(lines)))[name]
    start = node.lineno - 1 - (comment_above and lines[node.lineno - 2].startswith("#"))
    path.write_text("".join(lines[:start] + lines[node.end_lineno:]))


def without_line_above(path: Path, name: str) -> None:
    """`path` without the line right above its module-level `name = ...`."""
    lines = path.read_text().splitlines(keepends=True)
    del lines[module_constants(ast.parse("".join(lines)))[name].lineno - 2]
    path.write_text("".join(lines))


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


OMISSIONS = {
    "no launch test": (lambda root: (root / "tests/test_launch_zero.py").unlink(),
                       "tests/test_launch_zero.py: missing (04_zero/'s launch tests)"),
    "no LOSS_TOLERANCE": (
        lambda root: without_constant(root / "04_zero/optimized_zero2.py", "LOSS_TOLERANCE"),
        "04_zero/optimized_zero2.py: no module-level LOSS_TOLERANCE"),
    "README without its table markers": (
        lambda root: (root / "04_zero/README.md").write_text(re.sub(
            r"<!-- [\w-]+:(start|end) -->\n", "", (root / "04_zero/README.md").read_text())),
        "04_zero/README.md: no measured table between <!-- name:start --> and <!-- name:end --> "
        "markers"),
    "README without '## Run'": (
        lambda root: edit(root / "04_zero/README.md", "## Run", "## Running"),
        "04_zero/README.md: no '## Run' section (the make target and the direct torchrun line)"),
    "README without 'Use it in your trainer'": (
        lambda root: edit(root / "04_zero/README.md", "## Use it in your trainer", "## Usage"),
        "04_zero/README.md: no '## Use it in your trainer' section"),
    "no PLANNED": (
        lambda root: without_constant(root / "02_compression/optimized_compression_int8.py",
                                      "PLANNED", comment_above=True),
        "02_compression/optimized_compression_int8.py: no module-level PLANNED (its planner "
        "entries, or PLANNED = [] under a comment saying why it adds none)"),
    "PLANNED = [] without why": (
        lambda root: without_line_above(root / "02_compression/optimized_compression_int8.py",
                                        "PLANNED"),
        "02_compression/optimized_compression_int8.py: PLANNED = [] without a comment line right "
        "above saying why the technique adds no planner row"),
    "a record naming no baseline": (
        lambda root: edit(root / "04_zero/optimized_zero1.py", 'baseline="baseline_zero"',
                          "baseline=None"),
        "04_zero/optimized_zero1.py: its common.record(...) names no baseline= script"),
    "a script without its card": (
        lambda root: (root / "04_zero/baseline_zero.py").write_text(
            "import common\n" + (root / "04_zero/baseline_zero.py").read_text()),
        "04_zero/baseline_zero.py: no module docstring (the script card: "
        "What/Why/Run/Look for/Theory)"),
    "a script rewriting a parsed flag": (
        lambda root: edit(root / "04_zero/baseline_zero.py", "    topo = common.setup(args)\n",
                          "    args.batch_size *= 2\n    topo = common.setup(args)\n"),
        "04_zero/baseline_zero.py: assigns to args.batch_size after parsing (a derived value "
        "takes a name of its own: settings = common.resolved(args, batch_size=...))"),
    "no README": (lambda root: (root / "04_zero/README.md").unlink(),
                  "04_zero/README.md: missing"),
    "a helper after main()": (
        lambda root: edit(root / "01_ddp/optimized_ddp.py", "\n# The planner's rows",
                          "\ndef log_losses():\n    pass\n\n\n# The planner's rows"),
        "01_ddp/optimized_ddp.py: `log_losses` sits after main(), which comes last"),
    "a technique unit after the theory": (
        lambda root: edit(root / "01_ddp/optimized_ddp.py", "def planned_ddp(",
                          "def wrap_fsdp():\n    pass\n\n\ndef planned_ddp("),
        "01_ddp/optimized_ddp.py: `wrap_fsdp` sits after the theory and planner rows (from "
        "`ddp_bytes`): the technique comes first, then its theory, then main()"),
    "no row in the top README": (
        lambda root: edit(root / "README.md", "| [`04_zero`](", "| [04_zero]("),
        "README.md: no row for 04_zero in the Techniques table"),
    "a planner entry without its figures": (
        lambda root: edit(root / "01_ddp/optimized_ddp.py", '"figures":', '"formulas":'),
        '01_ddp/optimized_ddp.py: a PLANNED entry without figures (the planner reads each '
        "entry's strategy, place and figures)"),
}


@pytest.mark.parametrize("omission", OMISSIONS)
def test_each_omission_is_one_line_naming_the_file_and_what_is_missing(omission, tmp_path):
    root = contract_copy(tmp_path)
    kept = contract_problems(root)  # the repo's own, which the test above reports
    leave_out, line = OMISSIONS[omission]
    leave_out(root)
    assert sorted(contract_problems(root)) == sorted([*kept, line])


# --- A new folder, written by following CONTRIBUTING.md --------------------------------------
EXAMPLE_BASELINE = '''
    """Example baseline: every gradient all-reduced on its own after backward.

    What it does: each rank trains a full copy on its slice of the batch and averages each
    gradient with one all-reduce per tensor once backward is done.
    Why it is the baseline: what one writes first; nothing overlaps with compute.
    Run:        torchrun --nproc_per_node=2 99_example/baseline_example.py --size tiny
    Look for:   comm MB/step in the summary.
    Theory:     each rank sends 2(N-1)/N x the gradient bytes a step.
    """

    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
    import common  # noqa: E402


    def main():
        args = common.parser(__doc__).parse_args()
        topo = common.setup(args)
        model, batches = common.workload(args, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

        def train_step(inputs, targets):
            opt.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(topo.world_size)
            opt.step()
            return loss

        stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        sent_mb = common.ring_allreduce_mb(grad_bytes, topo.world_size)
        common.record(args, topo, stats, baseline=None, model=model, optimizer=opt,
                      comm_mb=sent_mb, theory={"comm_mb": sent_mb})


    if __name__ == "__main__":
        common.run_main(main)
'''

EXAMPLE_OPTIMIZED = '''
    """Example technique: DDP's bucketed all-reduce, overlapped with backward.

    What it does: DistributedDataParallel all-reduces gradients in buckets as backward fills
    them.
    Why it helps: a few large collectives instead of one per tensor, hidden behind backward.
    Run:        torchrun --nproc_per_node=2 99_example/optimized_example.py --size tiny
    Look for:   `make example report`: speedup over baseline_example at equal losses.
    Theory:     the baseline's 2(N-1)/N x the gradient bytes a step.
    """

    import sys
    from pathlib import Path
    from typing import TYPE_CHECKING

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py: repo root
    import common  # noqa: E402

    if TYPE_CHECKING:
        from report.plan_input import PlanInput

    # The same sums grouped in buckets: fp32 rounding; bf16, the dtype's resolution.
    LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}


    def state_and_sent(params: float, world: int, weight: float, grad: float, optim: float
                       ) -> dict[str, float]:
        """Bytes a rank keeps (each parameter's weight, gradient and optimizer state) and sends
        a step (its gradients, ring-all-reduced)."""
        return {"state": (weight + grad + optim) * params,
                "sent": common.ring_allreduce_mb(grad * params, world) * 2**20}


    def planned_example(plan: "PlanInput") -> dict[str, float]:
        """The planner's row: the record's formula at the planner's model and cluster."""
        return state_and_sent(plan.params, plan.gpus, *plan.state_bytes)


    PLANNED = [{"strategy": "example DDP", "place": 15, "figures": planned_example}]


    def main():
        args = common.parser(__doc__).parse_args()
        topo = common.setup(args)
        model, batches = common.workload(args, topo)
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

        def train_step(inputs, targets):
            opt.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            opt.step()
            return loss

        stats = common.timed_steps(train_step, batches, args, topo, memory_of=(model, opt))
        params = sum(p.numel() for p in model.parameters())
        figures = state_and_sent(params, topo.world_size, 4, 4, 8)  # fp32 weights, AdamW
        sent_mb = common.ring_allreduce_mb(sum(common.ddp_bucket_bytes(model)), topo.world_size)
        common.record(args, topo, stats, baseline="baseline_example", model=model.module,
                      optimizer=opt, comm_mb=sent_mb, loss_tolerance=LOSS_TOLERANCE[args.dtype],
                      theory={"comm_mb": figures["sent"] / 2**20,
                              "state_mb": figures["state"] / 2**20})


    if __name__ == "__main__":
        common.run_main(main)
'''

EXAMPLE_README = """
    # 99_example: DDP's buckets, as a folder written by following CONTRIBUTING.md

    ## Run

    `make example`, or after `source .venv/bin/activate`:
    `torchrun --nproc_per_node=2 99_example/optimized_example.py --size tiny`

    ## Use it in your trainer

    ```python
    model = DistributedDataParallel(model)
    ```

    ## Measured: 1 CPU process, `SIZE=tiny`

    <!-- example:start -->
    | script | speedup |
    <!-- example:end -->
"""


def test_a_folder_written_by_the_contract_is_picked_up_with_no_other_edit(tmp_path):
    """make's target, make smoke, make report and the planner find 99_example/ by itself."""
    project_copy(tmp_path, "99_example", {
        "baseline_example.py": textwrap.dedent(EXAMPLE_BASELINE).lstrip(),
        "optimized_example.py": textwrap.dedent(EXAMPLE_OPTIMIZED).lstrip(),
        "README.md": textwrap.dedent(EXAMPLE_README).lstrip()})
    contract_copy(tmp_path)  # the six folders beside it, as the planner reads them all
    (tmp_path / "tests/test_launch_example.py").touch()
    edit(tmp_path / "README.md", "| --- | --- | --- | --- |\n", "| --- | --- | --- | --- |\n"
         "| [`99_example`](99_example/README.md) | an example | 1.0x | ready |\n")
    assert folder_problems(tmp_path, tmp_path / "99_example") == []

    python = f"PYTHON={sys.executable}"
    run = subprocess.run(["make", "--no-print-directory", "example", python, "NPROC=1",
                          "SIZE=tiny", "STEPS=1", f"MASTER_PORT={common.free_port()}"],
                         cwd=tmp_path, env=cpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for script in ("baseline_example", "optimized_example"):
        assert f"== 99_example/{script}.py: 1 node(s) x 1 process(es)" in run.stdout

    smoke = subprocess.run(["make", "-n", "smoke", python], cwd=tmp_path, env=cpu_env(),
                           capture_output=True, text=True, timeout=60)
    assert smoke.returncode == 0, smoke.stderr
    assert "99_example/baseline_example.py 99_example/optimized_example.py" in smoke.stdout

    report = subprocess.run([sys.executable, "-m", "report", "--results",
                             "outputs/results.jsonl", "--out", "outputs/report.md"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    (row,) = [line for line in report.stdout.splitlines() if "| optimized_example " in line]
    assert "99_example" in report.stdout and re.search(r"\d\.\d\dx", row) and "| ok" in row

    plan = subprocess.run([sys.executable, "-m", "report", "plan", "--params", "7e9", "--gpus",
                           "8", "--gpu-mem", "80"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "example DDP" in plan.stdout


def test_own_lines_leave_out_the_marked_copies_and_long_scripts_are_a_warning(tmp_path):
    script = tmp_path / "optimized_x.py"
    script.write_text('"""Card."""\n\n\n# Copied from 01_ddp/baseline_ddp.py: wrap_ddp\n'
                      "def wrap_ddp(model):\n    return model\n\n\ndef main():\n    pass\n")
    assert helpers.own_lines(script) == 10 - 3  # less the marker and the copy's two lines
    (tmp_path / "01_x").mkdir()
    long_one = tmp_path / "01_x" / "optimized_long.py"
    long_one.write_text("x = 1\n" * (helpers.OWN_LINES_WARNING + 1))
    (tmp_path / "01_x" / "baseline_short.py").write_text("x = 1\n")
    assert helpers.scripts_over_own_lines(tmp_path) == [
        ("01_x/optimized_long.py", helpers.OWN_LINES_WARNING + 1)]
