"""Deliberate copies stay copies: a script stays standalone (it imports only `common`), so where
it repeats another script's function or class on purpose, the copy starts with

    # Copied from 05_pipeline/optimized_pipeline_gpipe.py: PipelineRank

on the line above its `def` or `class`, and this test fails when the copy differs from its
source (HuggingFace transformers' `# Copied from` convention). After changing a source,
`make fix-copies` (this file run as a script) rewrites its copies.

A copy that changes its source on purpose says what, in one line,

    # Copied from 04_zero/optimized_zero2.py: GradReducer, changed: reduce dtype, params freed

and its diff from the source is pinned in tests/fixtures/changed_copies.diff, where a reader
sees what changed: this test fails when the diff is any other (a change left unmarked, or a
source changed under it). `make fix-copies` leaves changed copies as they are and names those
that drifted; edit them, read the new diff, then `python tests/test_copies.py --pin` pins it.
Where it reads better, a subclass of a plain copy overriding a method, or a parameter added to
the source, shows the change with no marker (optimized_zero3_offload.py's OffloadGradReducer)."""

import ast
import difflib
import functools
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^# Copied from (\S+\.py): (\w+)$")
CHANGED = re.compile(r"^# Copied from (\S+\.py): (\w+), changed: \S.*$")
PINNED = ROOT / "tests" / "fixtures" / "changed_copies.diff"


def definitions(path: Path) -> dict[str, tuple[int, int]]:
    """Each top-level function and class of a file: its first and last line (0-based,
    inclusive; decorators included)."""
    return _definitions(path.read_text())


@functools.cache  # by the text: a file is parsed once for all its copies
def parsed(text: str) -> ast.Module:
    return ast.parse(text)


@functools.cache
def _definitions(text: str) -> dict[str, tuple[int, int]]:
    found = {}
    for node in parsed(text).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found[node.name] = (start - 1, node.end_lineno - 1)
    return found


def marked_copies(root: Path = ROOT, marker: re.Pattern = MARKER) -> list[tuple[Path, str, Path]]:
    """(copy's file, name, source's file) for every `marker` (a plain copy's by default) in the
    numbered folders."""
    copies = []
    for path in sorted(root.glob("[0-9][0-9]_*/*.py")):
        for line in path.read_text().splitlines():
            if found := marker.match(line):
                copies.append((path, found[2], root / found[1]))
    return copies


def changed_copies(root: Path = ROOT) -> list[tuple[Path, str, Path]]:
    """(copy's file, name, source's file) for every `changed:` marker."""
    return marked_copies(root, CHANGED)


def text_of(path: Path, name: str) -> list[str]:
    start, end = definitions(path)[name]
    return path.read_text().splitlines()[start:end + 1]


def diff_of(path: Path, name: str, source: Path, root: Path = ROOT) -> list[str]:
    """A changed copy's unified diff from its source, lines counted from the `def` or `class`."""
    return list(difflib.unified_diff(
        text_of(source, name), text_of(path, name), f"{source.relative_to(root)}: {name}",
        f"{path.relative_to(root)}: {name}", n=1, lineterm=""))


def pinned_diffs(text: str) -> dict[tuple[str, str], list[str]]:
    """(copy's file, name) -> its diff, from the pinned diffs' text."""
    pinned, lines, key = {}, text.splitlines(), None
    for k, line in enumerate(lines):
        header = re.match(r"\+\+\+ (\S+\.py): (\w+)$", lines[k + 1]) if k + 1 < len(lines) \
            else None
        if line.startswith("--- ") and header:
            key = (header[1], header[2])
            pinned[key] = []
        if key:
            pinned[key].append(line)
    return pinned


def changed_copy_problems(root: Path = ROOT, pinned: Path = PINNED) -> list[str]:
    """One line a changed copy whose diff from its source is not its pinned one, the diff it
    has now below it; one a pinned diff with no changed copy."""
    expected, problems = pinned_diffs(pinned.read_text() if pinned.exists() else ""), []
    for path, name, source in changed_copies(root):
        key, diff = (str(path.relative_to(root)), name), diff_of(path, name, source, root)
        if diff != expected.pop(key, None):
            problems.append(
                f"{key[0]}: {name} differs from {source.relative_to(root)}'s otherwise than its "
                f"pinned diff ({PINNED.relative_to(ROOT)}); if meant, `python "
                f"tests/test_copies.py --pin`. Its diff now:\n" + "\n".join(diff))
    problems += [f"{file}: {name} has a pinned diff but no `changed:` marker"
                 for file, name in expected]
    return problems


def copy_problems(root: Path = ROOT) -> list[str]:
    """One line a marked copy that differs from its source."""
    return [f"{path.relative_to(root)}: {name} differs from {source.relative_to(root)}'s: "
            "change the source, then `make fix-copies`"
            for path, name, source in marked_copies(root)
            if text_of(path, name) != text_of(source, name)]


def fix(root: Path = ROOT) -> int:
    """Rewrite every marked copy from its source; return how many changed. Changed copies are
    left as they are: those that drifted from their pinned diff are named."""
    changed = 0
    for path, name, source in marked_copies(root):
        lines, wanted = path.read_text().splitlines(), text_of(source, name)
        start, end = definitions(path)[name]
        if lines[start:end + 1] != wanted:
            path.write_text("\n".join(lines[:start] + wanted + lines[end + 1:]) + "\n")
            changed += 1
            print(f"{path.relative_to(root)}: {name} rewritten from {source.relative_to(root)}")
    for problem in changed_copy_problems(root):
        print(f"{problem.splitlines()[0]} (not rewritten: a changed copy)")
    return changed


def pin() -> None:
    """Pin every changed copy's diff from its source, as it is now."""
    diffs = [line for path, name, source in changed_copies() for line in
             diff_of(path, name, source)]
    PINNED.write_text("\n".join(diffs) + "\n")
    print(f"{PINNED.relative_to(ROOT)}: the diffs of {len(changed_copies())} changed copies")


def test_the_deliberate_copies_are_marked():
    """The ones a reader diffs: the 05 runtime in 1F1B's and DualPipe's scripts, ZeRO-1's
    partition and gradient clipping in ZeRO-2's and -3's, ZeRO-3's units in the offload's, the
    DDP wrap of the baselines, FSDP's sharding in the checkpointing script; and the changed
    copies: ZeRO-2's GradReducer in ZeRO-3's, ZeRO-1's Bucket, flatten and theory."""
    marked = {(path.name, name) for path, name, _ in marked_copies()}
    assert {("optimized_zero3_offload.py", name) for name in (
        "units_in_gradient_order", "Bucket", "partition", "flat_dtype", "first_rank",
        "broadcast_buffers", "shard_params", "owned_shards", "clip_grad_norm_", "ParamGatherer",
        "GradReducer", "zero3_bytes")} <= marked
    assert {(path.name, name) for path, name, _ in changed_copies()} >= {
        ("optimized_zero3.py", "GradReducer"), ("optimized_zero3.py", "Bucket"),
        ("optimized_zero2.py", "flatten"), ("optimized_zero2.py", "theory")}
    assert {("optimized_pipeline_1f1b.py", "PipelineRank"), ("optimized_pipeline_1f1b.py",
            "simulate"), ("optimized_pipeline_dualpipe.py", "MultiStagePipelineRank"),
            ("optimized_pipeline_dualpipe.py", "dualpipe_rank"), ("optimized_zero2.py",
            "partition"), ("optimized_zero3.py", "partition"),
            ("optimized_zero2.py", "clip_grad_norm_"), ("optimized_zero3.py", "clip_grad_norm_"),
            ("baseline_zero.py", "wrap_ddp")} <= marked
    assert {("optimized_fsdp_checkpoint.py", name) for name in (
        "build_mesh", "sharding_units", "batchnorms", "keep_batchnorm_fp32", "shard",
        "prefetch_one_ahead", "padded_numel", "theory", "AllToAllReduceScatter",
        "reduce_scatter_by_all_to_all_on_gloo")} <= marked
    assert {("optimized_fsdp_fp8.py", "AllToAllReduceScatter"),
            ("optimized_fsdp_fp8.py", "reduce_scatter_by_all_to_all_on_gloo")} <= marked
    # the flash pair wraps DDP alike, so that pair differs in the attention alone; PyTorch's
    # PowerSGD hook starts from the hand-written recipe's Q and keeps its shape rule and checks
    assert {("optimized_ddp_flash.py", "wrap_ddp"),
            ("optimized_ddp_flash.py", "block_gradient_mb"),
            *(("optimized_compression_powersgd_pytorch.py", name) for name in (
                "initial_qs", "worth_compressing", "compression_theory", "resolve_start_iter"))
            } <= marked
    # a formula is written once: DDP's bytes in the baselines that keep DDP's state, the uniform
    # bubble in the pipelines, the ZeRO stages' bytes in PyTorch's ZeRO
    assert {*((name, "ddp_bytes") for name in (
                "optimized_ddp.py", "baseline_fsdp.py", "baseline_zero.py",
                "baseline_pipeline_3d.py", "baseline_symmem_training.py")),
            *((name, "uniform_bubble") for name in (
                "optimized_pipeline_gpipe.py", "optimized_pipeline_1f1b.py",
                "optimized_pipeline_pytorch.py", "optimized_pipeline_3d.py")),
            ("optimized_zero_pytorch.py", "zero1_bytes"),
            ("optimized_zero_pytorch.py", "zero3_bytes"),
            # the sequence-parallel stream and loss_parallel's all-reduces, 03's 2-D source
            *((name, "sequence_parallel_bytes") for name in (
                "optimized_pipeline_3d.py", "baseline_symmem_tp.py", "optimized_symmem_tp.py",
                "optimized_symmem_tp_pytorch.py")),
            ("optimized_pipeline_3d.py", "loss_parallel_bytes")} <= marked


def test_every_marker_stands_right_above_its_definition_and_names_a_source():
    plain = {(path, name) for path, name, _ in marked_copies()}
    for path, name, source in [*marked_copies(), *changed_copies()]:
        lines = path.read_text().splitlines()
        start, _ = definitions(path)[name]
        assert MARKER.match(lines[start - 1]) or CHANGED.match(lines[start - 1]), \
            f"{path.name}: the marker of {name} is not above it"
        assert source.exists() and source != path, f"{path.name}: {name}'s source {source}"
        assert name in definitions(source), f"{source.name} has no {name}"
        assert (source, name) not in plain, \
            f"{path.name}: {name} is copied from a copy; name the original"


def test_every_copy_is_its_source_to_the_letter():
    assert not copy_problems(), "\n".join(copy_problems())


def test_every_changed_copy_differs_from_its_source_by_its_pinned_diff_alone():
    """What the `changed:` marker says in a line, its pinned diff shows in full; a copy that
    does not differ takes the plain marker."""
    assert not changed_copy_problems(), "\n\n".join(changed_copy_problems())
    for path, name, source in changed_copies():
        assert text_of(path, name) != text_of(source, name), \
            f"{path.relative_to(ROOT)}: {name} is {source.relative_to(ROOT)}'s to the letter: " \
            "mark it a plain copy"


def a_copy_of_the_folders(tmp_path: Path) -> Path:
    for path in ROOT.glob("[0-9][0-9]_*/*.py"):
        (tmp_path / path.parent.name).mkdir(exist_ok=True)
        shutil.copy(path, tmp_path / path.parent.name / path.name)
    return tmp_path


def edited(path: Path, name: str, old: str, new: str) -> None:
    """`old` replaced by `new` inside the definition `name` of `path`, once."""
    lines = path.read_text().splitlines()
    start, end = definitions(path)[name]
    block = "\n".join(lines[start:end + 1])
    assert block.count(old) == 1, (path, name, old)
    lines[start:end + 1] = block.replace(old, new).splitlines()
    path.write_text("\n".join(lines) + "\n")


def test_a_copy_that_drifts_fails_naming_its_file_and_block_and_fix_keeps_the_changes(
        tmp_path):
    """In a copy of the folders: a line of ZeRO-3's changed GradReducer edited beyond its pinned
    diff, and one of the offload's plain copy of it; each check names its file and block, and
    `make fix-copies` rewrites the plain copy but leaves the changed one as it stands."""
    root = a_copy_of_the_folders(tmp_path)

    def in_04(problems: list[str]) -> list[str]:
        return [problem for problem in problems if problem.startswith("04_zero/")]

    assert not in_04(changed_copy_problems(root)) and not in_04(copy_problems(root))
    zero3, offload = (root / "04_zero" / f"optimized_zero3{end}.py" for end in ("", "_offload"))
    edited(zero3, "GradReducer", "self.gatherer.free(i)", "pass  # the parameters kept")
    edited(offload, "GradReducer", "self.copied[i] += 1", "self.copied[i] += 2")
    [problem] = in_04(changed_copy_problems(root))
    assert problem.startswith("04_zero/optimized_zero3.py: GradReducer differs from "
                              "04_zero/optimized_zero2.py's")
    assert "+            pass  # the parameters kept" in problem.splitlines()  # the diff shown
    assert in_04(copy_problems(root)) == [
        "04_zero/optimized_zero3_offload.py: GradReducer differs from 04_zero/optimized_zero3.py's:"
        " change the source, then `make fix-copies`"]
    drifted = zero3.read_text()
    fix(root)  # the offload's copy rewritten from ZeRO-3's edited GradReducer, which stays
    assert zero3.read_text() == drifted and not in_04(copy_problems(root))
    assert text_of(offload, "GradReducer") == text_of(zero3, "GradReducer")


def test_the_offload_takes_zero3s_units_as_copies_and_changes_them_in_sight():
    """optimized_zero3_offload.py shares every unit it names as optimized_zero3.py does as a
    plain copy (its theory and main are its own); what it changes in them is visible in its
    own code: OffloadGradReducer, a subclass of the copied GradReducer overriding where the
    reduced gradient is kept, and shard_params' `in_host_memory`."""
    zero3, offload = (ROOT / "04_zero" / f"optimized_zero3{end}.py" for end in ("", "_offload"))
    copied = {name for path, name, _ in marked_copies() if path == offload}
    shared = definitions(offload).keys() & definitions(zero3).keys() - {"theory", "main"}
    assert shared == copied, f"shared with ZeRO-3 unmarked: {sorted(shared - copied)}"
    reducer = next(node for node in ast.parse(offload.read_text()).body
                   if getattr(node, "name", None) == "OffloadGradReducer")
    assert [ast.unparse(base) for base in reducer.bases] == ["GradReducer"]
    assert {node.name for node in reducer.body if isinstance(node, ast.FunctionDef)} == {
        "__init__", "reduced", "keep_reduced"}
    assert "in_host_memory=True" in "\n".join(text_of(offload, "ZeRO3Offload"))


def constants(path: Path) -> dict[str, str]:
    """Each module-level constant of a file (an UPPER_CASE name assigned at the top level): the
    text of the statement that assigns it."""
    text = path.read_text()
    lines, found = text.splitlines(), {}
    for node in parsed(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                found[target.id] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def names_used(path: Path, name: str) -> set[str]:
    """The names the definition `name` of a file reads."""
    node = next(n for n in parsed(path.read_text()).body if getattr(n, "name", None) == name)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def test_a_copy_reads_the_constants_its_source_reads_with_the_same_values():
    """A copy that reads a module-level constant (`LINE`, `SPIN_POLLS`, ...) is only the same
    code if its file assigns that constant as the source's file does."""
    checked = 0
    for path, name, source in marked_copies():
        theirs, ours = constants(source), constants(path)
        for constant in sorted(names_used(source, name) & theirs.keys()):
            assert ours.get(constant) == theirs[constant], \
                f"{path.relative_to(ROOT)}: {constant}, read by the copy of {name}, is not " \
                f"{source.relative_to(ROOT)}'s"
            checked += 1
    assert checked  # some copies do read constants: the check is not vacuous


if __name__ == "__main__":
    pin() if "--pin" in sys.argv[1:] else fix()
