"""The docs (README.md, docs/*.md): every console example in docs/ still
prints what it shows, on the echo demo; every relative link leads to a file
(and a heading) that exists; and docs/architecture.md's lifecycle tables are
the code's transition tables.

A console example is a fenced block whose info string is ``console``: a
transcript of a shell. A line starting with ``$ `` begins a command, lines
starting with ``> `` continue it (bash's second prompt), and the lines after
it, up to the next command, are what it prints. Only examples that run offline
on the echo demo (`mola serve --demo echo`, http://127.0.0.1:8000) are marked
``console``; every other example stays ``bash``, ``python`` and so on.

Each block runs against one echo-demo server (127.0.0.1, a free port; the
docs' address is rewritten to it), each command through ``bash -o pipefail``
from the repository root, and what it prints must equal the block's lines
exactly, trailing spaces and trailing blank lines aside. Nothing is masked:
the examples print only what the demo answers the same way every time (no
ids, no times, no cache counters)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mola.config import AdapterSpec
from mola.engine import sequence
from mola.registry import records
from mola.bases import record as base_record

from helpers.servers import start_server

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")  # where the examples say the server is
MIN_BLOCKS = 5


@dataclass(frozen=True)
class Step:
    command: str  # what follows "$ ", its "> " lines joined with newlines
    expected: tuple[str, ...]  # the lines it prints


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    steps: tuple[Step, ...]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(text: str, info: str) -> list[tuple[int, list[str]]]:
    """(line of the opening fence, the lines inside) of each ```INFO block."""
    blocks, lines, start = [], text.splitlines(), None
    for i, line in enumerate(lines):
        if start is None and line.startswith("```"):
            start = i if line[3:].strip() == info else -1 - i  # negative: another block, skipped
        elif start is not None and line.startswith("```"):
            if start >= 0:
                blocks.append((start + 1, lines[start + 1: i]))
            start = None
    return blocks


def read_transcript(lines: list[str], where: str) -> tuple[Step, ...]:
    """The commands of a console block and what each prints."""
    steps: list[tuple[list[str], list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            steps.append(([line[2:]], []))
        elif not steps:
            raise ValueError(f"{where}: a console block must start with a '$ ' command, not {line!r}")
        elif line.startswith(">") and not steps[-1][1]:
            steps[-1][0].append(line[2:])
        else:
            steps[-1][1].append(line)
    if not steps:
        raise ValueError(f"{where}: an empty console block")
    return tuple(Step("\n".join(command), tuple(trimmed(out))) for command, out in steps)


def console_blocks() -> list[Block]:
    found = []
    for path in sorted(DOCS.glob("*.md")):
        for line, lines in fenced_blocks(path.read_text(), "console"):
            block_id = f"{path.relative_to(ROOT)}:{line}"
            found.append(Block(path, line, read_transcript(lines, block_id)))
    return found


def trimmed(lines) -> list[str]:
    """Lines without trailing spaces, and without blank lines at the end."""
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def run(step: Step, url: str) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run one command against the server at ``url``: what it printed."""
    command = step.command
    for doc_url in DOC_URLS:
        command = command.replace(doc_url, url)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return trimmed(done.stdout.splitlines()), done


def mismatch(step: Step, url: str) -> str | None:
    """None when the command prints what the block shows, else what differs."""
    got, done = run(step, url)
    if done.returncode == 0 and got == list(step.expected):
        return None
    return (f"$ {step.command}\n--- the docs show:\n" + "\n".join(step.expected)
            + f"\n--- it printed (exit status {done.returncode}):\n" + "\n".join(got)
            + (f"\n--- stderr:\n{done.stderr}" if done.stderr else ""))


BLOCKS = console_blocks()


@pytest.fixture(scope="module")
def server(echo_demo):
    """`mola serve --demo echo` as the docs run it: from the checkout (so
    that a relative adapter path is the checkout's), the echo base, its
    committed adapters."""
    model_dir, adapters = echo_demo
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        handle = start_server(model=str(model_dir), served_model_name="mola-demo",
                              adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()))
        yield handle
        handle.stop()


def test_the_docs_have_console_examples():
    assert len(BLOCKS) >= MIN_BLOCKS, f"found {len(BLOCKS)} console blocks in {DOCS}, want {MIN_BLOCKS} or more"
    assert all(step.expected for block in BLOCKS for step in block.steps[-1:]), "a block that shows no output"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_a_console_example_prints_what_the_docs_show(server, block):
    for step in block.steps:
        assert (problem := mismatch(step, server.url)) is None, f"{block.id}\n{problem}"


def test_a_changed_answer_is_caught(server):
    """The check can fail: the first example with an answer, one line edited."""
    step = next(s for b in BLOCKS for s in b.steps if s.expected)
    edited = Step(step.command, (step.expected[0] + " (edited)", *step.expected[1:]))
    assert mismatch(step, server.url) is None
    assert "(edited)" in mismatch(edited, server.url)


def test_a_transcript_is_read_as_commands_and_their_output():
    lines = ["$ echo one \\", ">   two", "one two", "$ printf 'a\\n\\nb \\n\\n'", "a", "", "b  ", ""]
    steps = read_transcript(lines, "here")
    assert steps == (Step("echo one \\\n  two", ("one two",)), Step("printf 'a\\n\\nb \\n\\n'", ("a", "", "b")))
    assert [run(s, "")[0] for s in steps] == [["one two"], ["a", "", "b"]]
    with pytest.raises(ValueError, match="must start with"):
        read_transcript(["output first", "$ true"], "here")
    text = "```bash\n$ not this\n```\n```console\n$ true\n```\n"
    assert fenced_blocks(text, "console") == [(4, ["$ true"])]


# ---- links --------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), ![alt](image)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    found, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for m in LINK.finditer(prose(page.read_text())):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---- lifecycles ---------------------------------------------------------------

LIFECYCLES = {  # where architecture.md's table names its source -> the code's table
    "engine/sequence.py": sequence.TRANSITIONS,
    "registry/records.py": records.TRANSITIONS,
    "bases/record.py": base_record.TRANSITIONS,
}


def documented_moves(source: str) -> dict[str, set[str]]:
    """The table after the paragraph that names ``source``: each row's state
    (the first `name` of its first cell) -> every `name` its second cell holds."""
    text = (DOCS / "architecture.md").read_text()
    lines = text[text.index(f"(`{source}`"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    moves = {}
    for row in lines[start + 2: end]:  # past the header and its rule
        first, second = row.split("|")[1:3]
        moves[re.search(r"`(\w+)`", first).group(1)] = set(re.findall(r"`(\w+)`", second))
    return moves


@pytest.mark.parametrize("source", list(LIFECYCLES))
def test_the_lifecycle_tables_are_the_codes(source):
    table = LIFECYCLES[source]
    want = {s.value: {t.value for t in allowed} for s, allowed in table.items()}
    assert documented_moves(source) == want
