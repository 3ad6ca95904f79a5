"""CPU-only checks of OPTIMIZATION.md, the optimization checklist.

The file opens with one ordered table (the checklist), names the code of every step by its
repository path, keeps the experiments that were not merged in one "Tried and left" table and
stays a checklist rather than a dated log. These tests hold that shape, and they fail when the
code moves and a path in the file no longer exists (the checker is also run on planted text
below, so that it is known to be able to fail).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "OPTIMIZATION.md"

MAX_LINES = 1200
CHECKLIST_COLUMNS = ["#", "step", "where it lives now", "effect", "nsight", "commit"]
TRIED_COLUMNS = ["idea", "result", "why not kept"]
PATH_ROOTS = ("csrc", "flash_cuda", "bench", "tests")
# A backticked repository path: `csrc/core/mask.cuh`, `csrc/core/mask.cuh:120`,
# `csrc/core/mask.cuh (keys_of)`, `bench/run.py --features`, `bench/results/decode-h100/`.
CODE_SPAN = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
PATH_START = re.compile(r"^(?:%s)/" % "|".join(PATH_ROOTS))
SHORT_HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DIARY_WORDS = re.compile(r"\b(this stop|today|yesterday|tonight|this morning|this evening)\b", re.IGNORECASE)


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _tables(text: str):
    """Markdown tables in order: (line index of the header, header cells, body rows)."""
    lines = text.splitlines()
    tables, i = [], 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            header = _cells(lines[i])
            rows, j = [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            tables.append((i, header, rows))
            i = j
        else:
            i += 1
    return tables


def _cells(line: str):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def repo_paths(text: str):
    """Every repository path written in backticks, reduced to the path itself (a `:line` or
    `:symbol` suffix, arguments after a space, a `(symbol)` or `#anchor` tail dropped)."""
    found = []
    for span in CODE_SPAN.findall(text):
        span = " ".join(span.split())
        if not PATH_START.match(span):
            continue
        path = re.split(r"[\s(#]", span, maxsplit=1)[0]
        path = path.split(":", 1)[0].rstrip(".,;")
        found.append(path)
    return found


def missing_paths(text: str, root: Path = ROOT):
    return sorted({p for p in repo_paths(text) if not (root / p.rstrip("/")).exists()})


def test_checklist_is_the_first_table():
    tables = _tables(_text())
    assert tables, "OPTIMIZATION.md has no table"
    _, header, rows = tables[0]
    lowered = [h.lower() for h in header]
    for column in CHECKLIST_COLUMNS:
        assert any(column in h for h in lowered), f"checklist column {column!r} missing from {header}"
    assert len(rows) >= 10, "the checklist has fewer than 10 steps"
    numbers = [int(r[0]) for r in rows]
    assert numbers == list(range(numbers[0], numbers[0] + len(rows))), "steps are not numbered in order"
    where = next(i for i, h in enumerate(lowered) if "where" in h)
    commit = next(i for i, h in enumerate(lowered) if "commit" in h)
    for row in rows:
        assert len(row) == len(header), f"step {row[0]}: {len(row)} cells for {len(header)} columns"
        assert repo_paths(row[where]), f"step {row[0]} names no repository path"
        assert SHORT_HASH.search(row[commit]), f"step {row[0]} names no commit"


def test_checklist_opens_the_file():
    text = _text()
    first_table = _tables(text)[0][0]
    headings_before = [l for l in text.splitlines()[:first_table] if l.startswith("## ")]
    assert headings_before == ["## The checklist"], headings_before


def test_every_step_has_a_section():
    text = _text()
    _, _, rows = _tables(text)[0]
    sections = {int(m) for m in re.findall(r"^### (\d+)\. ", text, re.MULTILINE)}
    missing = [r[0] for r in rows if int(r[0]) not in sections]
    assert not missing, f"steps without a '### N. ...' section: {missing}"


def test_every_repository_path_exists():
    paths = repo_paths(_text())
    assert len(paths) >= 20, "expected the checklist to name the code of its steps"
    assert missing_paths(_text()) == []


def test_the_path_check_can_fail(tmp_path):
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "csrc" / "core" / "mask.cuh").write_text("")
    text = ("| a | `csrc/core/mask.cuh (keys_of)` | `csrc/core/mask.cuh:120` |\n"
            "see `csrc/kernels/mma_fwd.cuh` and `bench/run.py\n--features`, not `python x.py`\n")
    assert repo_paths(text) == ["csrc/core/mask.cuh", "csrc/core/mask.cuh", "csrc/kernels/mma_fwd.cuh",
                                "bench/run.py"]
    assert missing_paths(text, tmp_path) == ["bench/run.py", "csrc/kernels/mma_fwd.cuh"]


def test_tried_and_left_table():
    text = _text()
    match = re.search(r"^## Tried and left\s*$", text, re.MULTILINE)
    assert match, "no '## Tried and left' section"
    start = text[: match.start()].count("\n")
    after = [t for t in _tables(text) if t[0] > start]
    assert after, "the 'Tried and left' section has no table"
    _, header, rows = after[0]
    lowered = [h.lower() for h in header]
    for column in TRIED_COLUMNS:
        assert any(column in h for h in lowered), f"'Tried and left' column {column!r} missing from {header}"
    assert len(rows) >= 10
    result = next(i for i, h in enumerate(lowered) if "result" in h)
    for row in rows:
        assert re.search(r"\d", row[result]), f"tried-and-left row without a number: {row[0]}"
    assert len(re.findall(r"^## Tried and left", text, re.MULTILINE)) == 1


def test_closing_section():
    assert re.search(r"^## Where it stands", _text(), re.MULTILINE)


def test_length():
    n = len(_text().splitlines())
    assert n < MAX_LINES, f"OPTIMIZATION.md has {n} lines (limit {MAX_LINES})"


def test_no_dated_diary():
    text = _text()
    for line in text.splitlines():
        if line.startswith("#"):
            assert not DATE.search(line), f"dated heading: {line}"
            assert not DIARY_WORDS.search(line), f"diary heading: {line}"
    assert not DIARY_WORDS.findall(text), DIARY_WORDS.findall(text)
    # A date may only appear inside a results file's name (grid-2026-11-27c.md, ..._2026-11-27.csv).
    loose = [m.group(0) for m in DATE.finditer(text) if text[m.start() - 1] not in "-_"]
    assert not loose, f"dates outside a file name: {loose}"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not available")
def test_checklist_commits_exist():
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("shallow clone: older commits are absent")
    _, header, rows = _tables(_text())[0]
    commit = next(i for i, h in enumerate(header) if "commit" in h.lower())
    hashes = {h for row in rows for h in SHORT_HASH.findall(row[commit])}
    unknown = sorted(h for h in hashes if git("cat-file", "-e", f"{h}^{{commit}}").returncode != 0)
    assert not unknown, f"checklist commits not in this repository: {unknown}"
