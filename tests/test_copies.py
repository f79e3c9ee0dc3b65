"""Deliberate copies stay copies: a script stays standalone (it imports only `common`), so where
it repeats another script's function or class on purpose, the copy starts with

    # Copied from 05_pipeline/optimized_pipeline_gpipe.py: PipelineRank

on the line above its `def` or `class`, and this test fails when the copy differs from its
source (HuggingFace transformers' `# Copied from` convention). After changing a source,
`make fix-copies` (this file run as a script) rewrites its copies."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^# Copied from (\S+\.py): (\w+)$")


def definitions(path: Path) -> dict[str, tuple[int, int]]:
    """Each top-level function and class of a file: its first and last line (0-based,
    inclusive; decorators included)."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found[node.name] = (start - 1, node.end_lineno - 1)
    return found


def marked_copies() -> list[tuple[Path, str, Path]]:
    """(copy's file, name, source's file) for every marker in the numbered folders."""
    copies = []
    for path in sorted(ROOT.glob("[0-9][0-9]_*/*.py")):
        for line in path.read_text().splitlines():
            if found := MARKER.match(line):
                copies.append((path, found[2], ROOT / found[1]))
    return copies


def text_of(path: Path, name: str) -> list[str]:
    start, end = definitions(path)[name]
    return path.read_text().splitlines()[start:end + 1]


def fix() -> int:
    """Rewrite every marked copy from its source; return how many changed."""
    changed = 0
    for path, name, source in marked_copies():
        lines, wanted = path.read_text().splitlines(), text_of(source, name)
        start, end = definitions(path)[name]
        if lines[start:end + 1] != wanted:
            path.write_text("\n".join(lines[:start] + wanted + lines[end + 1:]) + "\n")
            changed += 1
            print(f"{path.relative_to(ROOT)}: {name} rewritten from {source.relative_to(ROOT)}")
    return changed


def test_the_deliberate_copies_are_marked():
    """The ones a reader diffs: the 05 runtime in 1F1B's and DualPipe's scripts, ZeRO-1's
    partition and gradient clipping in ZeRO-2's and -3's, the DDP wrap of the baselines, FSDP's
    sharding in the checkpointing script."""
    marked = {(path.name, name) for path, name, _ in marked_copies()}
    assert {("optimized_pipeline_1f1b.py", "PipelineRank"), ("optimized_pipeline_1f1b.py",
            "simulate"), ("optimized_pipeline_dualpipe.py", "TwoStagePipelineRank"),
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
    for path, name, source in marked_copies():
        lines = path.read_text().splitlines()
        start, _ = definitions(path)[name]
        assert MARKER.match(lines[start - 1]), f"{path.name}: the marker of {name} is not above it"
        assert source.exists() and source != path, f"{path.name}: {name}'s source {source}"
        assert name in definitions(source), f"{source.name} has no {name}"
        assert not any(p == source and n == name for p, n, _ in marked_copies()), \
            f"{path.name}: {name} is copied from a copy; name the original"


def test_every_copy_is_its_source_to_the_letter():
    for path, name, source in marked_copies():
        assert text_of(path, name) == text_of(source, name), \
            f"{path.relative_to(ROOT)}: {name} differs from {source.relative_to(ROOT)}'s: " \
            "change the source, then `make fix-copies`"


def constants(path: Path) -> dict[str, str]:
    """Each module-level constant of a file (an UPPER_CASE name assigned at the top level): the
    text of the statement that assigns it."""
    lines, found = path.read_text().splitlines(), {}
    for node in ast.parse("\n".join(lines)).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                found[target.id] = "\n".join(lines[node.lineno - 1:node.end_lineno])
    return found


def names_used(path: Path, name: str) -> set[str]:
    """The names the definition `name` of a file reads."""
    node = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name)
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
    fix()
