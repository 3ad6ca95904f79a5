"""README.md as a user meets it (no GPU needed): short enough to read, every relative link leads
to a file (and every #anchor into a markdown file to one of its headings), and every python
example runs as written. The examples run on CPU tensors through the CPU stand-in of the kernels
(conftest's ``mock_extension``), with their ``"cuda"`` device read as ``"cpu"``. An example that
needs what a CPU cannot stand in for (CUDA graph capture, torchrun) ends with a line
``# requires: <what>``; it is skipped with that reason, after the checks that need no running:
it compiles and uses no name it does not define."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 260
# The markdown files whose relative links are checked: README and the pages it sends readers to.
LINKED_PAGES = [README, ROOT / "docs" / "reference.md", ROOT / "bench" / "README.md",
                ROOT / "bench" / "results" / "README.md"]

FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
REQUIRES = re.compile(r"^# requires: (.+)$", re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks():
    """(first line number, source) of every ```python block of README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks()


def _block_id(block):
    return f"line{block[0]}"


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it at most {MAX_LINES} (details go to docs/)"


def test_readme_has_examples():
    assert len(BLOCKS) >= 4, "README.md lost its python examples"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.is_file(), f"{page.relative_to(ROOT)} is missing"
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def _undefined_names(src: str) -> list:
    """Names a block reads but neither defines, imports nor gets from builtins (order ignored)."""
    tree = ast.parse(src)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(loaded - bound)


@pytest.mark.parametrize("block", BLOCKS, ids=_block_id)
def test_example_defines_what_it_uses(block):
    line, src = block
    compile(src, f"README.md:{line}", "exec")
    assert not _undefined_names(src), f"README.md:{line}: the example uses undefined names {_undefined_names(src)}"
    assert "..." not in src.replace('"..."', ""), f"README.md:{line}: an example with '...' cannot run"


@pytest.fixture
def tiny_pretrained(monkeypatch, tmp_path):
    """transformers' AutoModelForCausalLM.from_pretrained reading a tiny random Llama-style model
    saved in tmp_path, whatever name it is given (no download), on CPU."""
    import hf_models

    transformers = hf_models.transformers
    eager, _ = hf_models.build("llama", torch.float32, "cpu")
    eager.save_pretrained(tmp_path)
    load = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(name, *args, device_map=None, **kwargs):
        return load(tmp_path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)


@pytest.mark.parametrize("block", BLOCKS, ids=_block_id)
def test_example_runs(block, mock_extension, request):
    line, src = block
    need = REQUIRES.search(src)
    if need:
        pytest.skip(f"README.md:{line} requires {need.group(1)}")
    # The stand-in's small blocks mirror the kernels' tiles; the examples' sizes run faster in
    # larger ones (the blocks move only rounding).
    small_blocks = mock_extension._kwargs
    mock_extension._kwargs = lambda *args: {**small_blocks(*args), "block_m": 1024, "block_n": 1024}
    if "from transformers import" in src:
        request.getfixturevalue("tiny_pretrained")
    sdpa = None
    if "flash_cuda.integrations.sdpa" in src:
        if not hasattr(torch.nn.attention, "activate_flash_attention_impl"):
            pytest.skip("this torch has no flash-attention registry (torch 2.10 and newer)")
        from flash_cuda.integrations import sdpa
    code = compile(src.replace('"cuda"', '"cpu"'), f"README.md:{line}", "exec")
    try:
        exec(code, {"__name__": "__readme__"})
    finally:
        if sdpa is not None:
            sdpa.deactivate()  # the example restores it; this only cleans up after a failure
    assert mock_extension.fwd_calls > 0 or sdpa is not None, \
        f"README.md:{line}: the example never reached flash_cuda's kernels"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_ci_runs_the_readme_test_commands():
    """.ci/run installs the package and runs the tests the way README's Test section says."""
    import shlex

    (block,) = re.findall(r"^```bash\n(.*?)^```", _section("Test"), re.M | re.S)
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.split("#")[0].strip()]
    ci = [shlex.split(line.split("#")[0]) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.split("#")[0].strip()]
    assert commands and any("[test]" in " ".join(c) for c in commands), block
    for command in commands:
        assert any(set(command) <= set(line) for line in ci), f".ci/run does not run README's `{shlex.join(command)}`"
