"""What the READMEs tell a newcomer holds: the direct commands run as written on a fresh clone
(every `torchrun` or `python` command in a shell block, or an inline one naming a script, is
`.venv/bin/`'s or comes after the line that activates .venv: a fresh clone's python has no
torch); the top README's headlines are 25 words at most, quote figures their folder's README
holds, and no ratio of a table with a busy host's rows unless they say so; every line outside
code fits 200 characters; every link to a README's section finds its heading."""

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


ROOT_READMES = [common.ROOT / "README.md", common.ROOT / "CONTRIBUTING.md",
                common.ROOT / "report" / "README.md",
                *sorted(common.ROOT.glob("[0-9][0-9]_*/README.md"))]
HEADLINE_WORDS = 25
LINE_CHARS = 200
# a figure a headline quotes: a ratio (1.49x), a decimal (38.4) or a power of ten (5e-6)
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?x|\d+\.\d+|\d+e-\d+)(?![\w])")
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)")


def headlines() -> dict[str, str]:
    """The top README's Techniques table: each folder's headline, its third column."""
    rows = [line for line in (common.ROOT / "README.md").read_text().splitlines()
            if re.match(r"\| \[`\d\d_\w+`\]", line)]
    return {re.match(r"\| \[`(\w+)`\]", row)[1]: row.split("|")[3].strip() for row in rows}


def outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside ``` blocks, the fences themselves left out."""
    found, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            found.append((number, line))
    return found


def tables(text: str) -> list[list[str]]:
    """Each markdown table of a README outside code: its run of lines that start with `|`."""
    blocks, block = [], []
    for _, line in outside_code(text) + [(0, "")]:
        if line.lstrip().startswith("|"):
            block.append(line)
        elif block:
            blocks, block = blocks + [block], []
    return blocks


def busy_host_ratios(headline: str, readme_text: str) -> list[str]:
    """The ratios a headline quotes that stand in a table with a busy host's rows: a row timed
    on a busy host, or compared with one, overstates or understates the ratio; [] where the
    headline says `busy host` itself."""
    if "busy host" in headline:
        return []
    busy = [" ".join(block) for block in tables(readme_text)
            if any("busy host" in row for row in block)]
    return [ratio for ratio in RATIO.findall(headline)
            if any(re.search(rf"(?<![\w.]){re.escape(ratio)}(?!\w)", table) for table in busy)]


def test_the_top_readme_has_a_headline_for_every_folder():
    assert set(headlines()) == {folder.name for folder in common.ROOT.glob("[0-9][0-9]_*")}


@pytest.mark.parametrize("folder", sorted(headlines()))
def test_a_headline_is_25_words_or_fewer(folder):
    words = headlines()[folder].split()
    assert len(words) <= HEADLINE_WORDS, \
        f"README.md: {folder}'s headline runs {len(words)} words, over {HEADLINE_WORDS}: " \
        "its one figure against the baseline, one caveat at most; the rest to its README"


@pytest.mark.parametrize("folder", sorted(headlines()))
def test_a_headline_quotes_figures_its_folder_readme_holds(folder):
    """A headline's figures come from its folder's tables and what they say, never from memory:
    a figure its README no longer holds is a stale headline."""
    readme = (common.ROOT / folder / "README.md").read_text()
    missing = [figure for figure in FIGURE.findall(headlines()[folder])
               if not re.search(rf"(?<![\w.]){re.escape(figure)}(?!\d)", readme)]
    assert not missing, f"README.md: {folder}'s headline quotes {missing}, not in its README"


@pytest.mark.parametrize("folder", sorted(headlines()))
def test_a_headline_quotes_no_ratio_of_a_busy_hosts_table_without_saying_so(folder):
    readme = (common.ROOT / folder / "README.md").read_text()
    assert not busy_host_ratios(headlines()[folder], readme), \
        f"README.md: {folder}'s headline quotes {busy_host_ratios(headlines()[folder], readme)} " \
        "from a table with busy-host rows: say `busy host`, or quote a quiet table's figure"


def test_the_busy_host_check_finds_a_ratio_beside_a_busy_baseline():
    """05's case: the schedules' rows are quiet, their baseline's was not."""
    readme = ("| script | speedup | status |\n| --- | --- | --- |\n"
              "| baseline_pipeline | | ok (busy host) |\n| optimized_pipeline_1f1b | 1.71x | ok |\n"
              "\nprose 1.72x\n\n| script | speedup | status |\n| --- | --- | --- |\n"
              "| optimized_pipeline_1f1b | 1.72x | ok |\n")
    assert busy_host_ratios("1F1B 1.71x naive model parallelism", readme) == ["1.71x"]
    assert busy_host_ratios("1F1B 1.71x naive model parallelism (busy host)", readme) == []
    assert busy_host_ratios("on the Llama 1F1B 1.72x naive model parallelism", readme) == []


@pytest.mark.parametrize("readme", ROOT_READMES, ids=lambda p: str(p.relative_to(common.ROOT)))
def test_every_line_outside_code_fits_200_characters(readme):
    """Prose wraps at about 100 columns; a table row cannot wrap, so its cells stay short (the
    measured tables too: `python -m report` prints them narrow, the detail below them)."""
    long = [(number, len(line)) for number, line in outside_code(readme.read_text())
            if len(line) > LINE_CHARS]
    assert not long, f"{readme.relative_to(common.ROOT)}: lines over {LINE_CHARS} characters " \
        f"(line, length): {long}"


TABLE_COLUMNS = 8


@pytest.mark.parametrize("readme", sorted(common.ROOT.glob("[0-9][0-9]_*/README.md")),
                         ids=lambda p: p.parent.name)
def test_a_folder_readmes_tables_fit_a_screen_at_8_columns(readme):
    """The measured tables as `python -m report` prints them: run, step, speedup, peak, state,
    bytes, Δloss, status; the setup above, the spread and theory below (`--wide`: all)."""
    wide = [block[0][:60] for block in tables(readme.read_text())
            if len(block[0].strip().strip("|").split("|")) > TABLE_COLUMNS]
    assert not wide, f"{readme.relative_to(common.ROOT)}: tables of more than {TABLE_COLUMNS} " \
        f"columns: {wide} (paste `python -m report`'s narrow table, not `--wide`)"


def slugs(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading's anchor suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for _, line in outside_code(text):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_every_link_to_a_readme_section_finds_its_heading():
    broken = []
    for readme in ROOT_READMES:
        for target, anchor in re.findall(r"\]\(([\w./]*?)#([\w-]+)\)", readme.read_text()):
            path = (readme.parent / target).resolve() if target else readme
            if anchor not in slugs(path.read_text()):
                broken.append(f"{readme.relative_to(common.ROOT)}: {target}#{anchor}")
    assert not broken, "links to no heading:\n" + "\n".join(broken)


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
