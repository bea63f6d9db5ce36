"""The notes pages (bench/notes-*.md) as a newcomer reads them: each fits on two screens, every
file it cites exists in this tree (history is cited as `git show REV:path`, which is not checked
here), and no source comment points at a section number of the notes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "bench").glob("notes-*.md"))
MAX_LINES = 150

# A path in the tree (a folder of the repository, then a file or folder), or the bare name of a
# result file (the notes cite bench/results/ files by name too). `git show REV:path` and `REV:path`
# citations are history and are dropped before matching.
TREE_PATH = re.compile(r"(?<![\w:/.-])((?:bench|tests|src|python|scripts|include|cmake|data)"
                       r"/[\w./*{},-]*[\w*}])")
RESULT_NAME = re.compile(r"(?<![\w:/.-])([\w-]+\.(?:json|png|txt|csv|log))\b")
HISTORY = re.compile(r"\b[0-9a-f]{7,40}:[\w./-]+")


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every tree path and result-file name in text; brace alternatives
    ({a,b}) expanded."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = HISTORY.sub("", line)
        for m in TREE_PATH.finditer(line):
            path = m.group(1)
            if "{" in path and "}" in path:
                head, rest = path.split("{", 1)
                alternatives, tail = rest.split("}", 1)
                found += [(lineno, head + a + tail) for a in alternatives.split(",")]
            else:
                found.append((lineno, path))
        found += [(lineno, "bench/results/" + m.group(1)) for m in RESULT_NAME.finditer(line)]
    return found


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_cited_paths_parsed():
    text = ("see `bench/results/a.json` and bench/{x,y}.py, `git show 1234567:bench/results/gone.json`"
            " (or 89abcde:src/old.cu); b.png, src/kernels/.")
    assert cited_paths(text) == [(1, "bench/results/a.json"), (1, "bench/x.py"), (1, "bench/y.py"),
                                 (1, "src/kernels"), (1, "bench/results/b.png")]


def test_there_are_notes_pages():
    assert {p.name for p in PAGES} >= {"notes-attention.md", "notes-trimul.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_notes_page_fits_on_two_screens(page):
    lines = page.read_text().count("\n")
    assert lines <= MAX_LINES, f"{page.name} has {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_notes_page_cites_only_files_in_the_tree(page):
    missing = [f"{page.name}:{n}: {p}" for n, p in cited_paths(page.read_text()) if not exists(p)]
    assert not missing, ("cited but not in the tree (cite history as `git show REV:path`):\n" +
                         "\n".join(missing))


def test_no_source_comment_points_at_a_notes_section():
    pointer = re.compile(r"notes[-\w.]*(?:'s)?\W{0,3}(?:§|section|part)\s*\d|§\s*\d", re.I)
    hits = []
    for folder in ("src", "include", "python", "tests", "bench", "scripts"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix not in {".h", ".cuh", ".cu", ".cpp", ".py", ".sh", ""} or not f.is_file():
                continue
            if f == Path(__file__).resolve():
                continue
            try:
                text = f.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            hits += [f"{f.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                     if pointer.search(line)]
    assert not hits, "source comments point at notes sections:\n" + "\n".join(hits)
