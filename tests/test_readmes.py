"""What the READMEs tell a newcomer holds: the direct commands run as written on a fresh clone
(every `torchrun` or `python` command in a shell block, or an inline one naming a script, is
`.venv/bin/`'s or comes after the line that activates .venv: a fresh clone's python has no
torch), and a headline in the top README keeps the caveat of the folder table it quotes."""

import re

import pytest

import common

READMES = [common.ROOT / "README.md", common.ROOT / "report" / "README.md",
           *sorted(common.ROOT.glob("[0-9][0-9]_*/README.md"))]
ACTIVATE = "source .venv/bin/activate"
SHELLS = {"", "bash", "sh", "shell", "console"}
# a command word, after a prompt, `srun` or environment variables: what the shell runs
COMMAND = re.compile(r"^(?:\$ )?(?:srun (?:-\S+ )*)?(?:[A-Z_]+=\S* )*(torchrun|python3?)\b")
INLINE = re.compile(r"`((?:torchrun|python3?) [^`]*\.py[^`]*)`")


def direct_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each bare `torchrun`/`python` command: a shell block's line,
    or inline code outside the blocks that runs a script."""
    found, fence = [], None  # fence: the open block's language
    for number, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence is None:
            found += [(number, m.group(1)) for m in INLINE.finditer(line)]
        elif fence in SHELLS and COMMAND.match(line.strip()):
            found.append((number, line.strip()))
    return found


def test_the_check_finds_a_bare_command_and_passes_a_venv_one():
    text = ("```bash\nmake ddp\ntorchrun --nproc_per_node=2 01_ddp/x.py\n"
            ".venv/bin/python 01_ddp/x.py\n```\nRun `python 01_ddp/x.py --steps abc`.\n"
            "```python\npython = 1\n```\n")
    assert [line for _, line in direct_commands(text)] == [
        "torchrun --nproc_per_node=2 01_ddp/x.py", "python 01_ddp/x.py --steps abc"]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(common.ROOT)))
def test_direct_commands_say_how_to_find_torch(readme):
    lines = readme.read_text().splitlines()
    activated = next((n for n, line in enumerate(lines) if line.startswith(ACTIVATE)), None)
    early = [line for at, line in direct_commands("\n".join(lines))
             if activated is None or at < activated]
    assert not early, (f"{readme.relative_to(common.ROOT)}: {early[0]!r} runs before "
                       f"`{ACTIVATE}` (or write .venv/bin/{early[0].split()[0]})")


def test_a_headline_from_a_table_with_a_busy_host_row_says_so():
    """05's baseline ran on a busy host, so its speedups are overstated: the top README's
    headline for it says so, as its folder README does."""
    rows = [line for line in (common.ROOT / "README.md").read_text().splitlines()
            if re.match(r"\| \[`\d\d_\w+`\]", line)]
    assert len(rows) >= 6
    for row in rows:
        folder = re.match(r"\| \[`(\w+)`\]", row)[1]
        tables = [line for line in (common.ROOT / folder / "README.md").read_text().splitlines()
                  if line.startswith("|") and "(busy host)" in line]
        assert not tables or "busy host" in row.split("|")[3], \
            f"README.md: {folder}'s headline drops its table's busy host ({tables[0][:60]}...)"


def test_the_family_table_has_a_row_for_every_folder_and_an_answer_in_every_cell():
    """The front door's table of README blocks by model family: every technique folder has a row,
    every cell is a tick or a refusal whose line is quoted under the table."""
    readme = (common.ROOT / "README.md").read_text()
    section = readme.split("## Use a recipe in your own trainer")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "](0" in line]
    assert {re.search(r"\]\((\d\d_\w+)/README", row)[1] for row in rows} == {
        folder.name for folder in sorted(common.ROOT.glob("[0-9][0-9]_*"))}
    quoted = {int(n) for n in re.findall(r"^(\d+)\. `", section, flags=re.MULTILINE)}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")[1:]]
        assert len(cells) == 5, row
        for cell in cells:
            assert cell == "✔" or (re.fullmatch(r"refused \((\d+)\)", cell)
                                   and int(cell[9:-1]) in quoted), (row, cell)
