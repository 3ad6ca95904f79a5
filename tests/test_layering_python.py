"""The Python package's layering: no module of flash_cuda reaches into another module's
underscore names, and neither does a script of bench/.

A name used across modules is public within the package (no leading underscore), so that
what a module keeps to itself can change without a search of the whole package. Checked on
the source with ``ast``: ``from .x import _name`` (relative or ``flash_cuda.x``), and
``x._name`` where ``x`` is a flash_cuda module bound by an import in that file. Private
*modules* (``_ext``, ``_build``) may be imported; their underscore attributes may not. Dunder
names (``__version__``) and third-party access (``torch._C``) are outside the rule. bench/*.py
is held to the same rule towards flash_cuda (what a benchmark needs, the package names
publicly).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional

import pytest

PACKAGE = "flash_cuda"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
BENCH = ROOT.parent / "bench"

# Underscore names of another flash_cuda module that a module may still use, as the check
# reports them ("flash_cuda.user: flash_cuda.owner._name"). Empty: an entry would be a debt,
# paid by giving the name a public one.
ALLOWED: set = set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of a (possibly relative) import's module."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def violations(source: str, module: str, is_package: bool, submodules: set) -> List[str]:
    """The cross-module underscore uses in ``source``, the text of flash_cuda module ``module``
    (``submodules``: every flash_cuda module's dotted name)."""
    tree = ast.parse(source)
    found = []
    bound: Dict[str, str] = {}  # local name -> the flash_cuda module it is bound to

    def ours(name: str) -> bool:
        return name == PACKAGE or name.startswith(PACKAGE + ".")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, is_package, node.level, node.module)
            if not ours(source_module):
                continue
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if full in submodules:  # a module (private ones too) may be imported
                    bound[alias.asname or alias.name] = full
                elif _is_private(alias.name) and source_module != module:
                    found.append(f"{module}: from {source_module} import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        base = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound:
            continue
        owner = bound[base.id]
        for attr in reversed(chain):
            if f"{owner}.{attr}" in submodules:
                owner = f"{owner}.{attr}"
                continue
            if _is_private(attr) and owner != module:
                found.append(f"{module}: {owner}.{attr}")
            break
    return sorted(set(found))


def _package_files():
    return sorted(ROOT.rglob("*.py"))


def test_no_module_uses_another_modules_underscore_names():
    submodules = {_module_name(p, ROOT) for p in _package_files()}
    found = []
    for path in _package_files():
        module = _module_name(path, ROOT)
        found += [v for v in violations(path.read_text(), module, path.name == "__init__.py", submodules)
                  if v not in ALLOWED]
    assert not found, "underscore names used across flash_cuda's modules:\n" + "\n".join(found)


def test_bench_uses_no_underscore_names_of_flash_cuda():
    submodules = {_module_name(p, ROOT) for p in _package_files()}
    scripts = sorted(BENCH.glob("*.py"))
    assert scripts
    found = []
    for path in scripts:
        found += violations(path.read_text(), f"bench.{path.stem}", False, submodules)
    assert not found, "underscore names of flash_cuda used by bench/:\n" + "\n".join(found)


_SUBMODULES = {"flash_cuda", "flash_cuda._ext", "flash_cuda.ops", "flash_cuda.validation",
               "flash_cuda.integrations", "flash_cuda.integrations.sdpa", "flash_cuda.distributed",
               "flash_cuda.ring", "flash_cuda.kvcache", "flash_cuda.kvcache_checks", "flash_cuda.kvcache_ops"}


@pytest.mark.parametrize("line,module,bad", [
    ("from .validation import _check_rank", "flash_cuda.ops", True),
    ("from flash_cuda.validation import _check_rank", "flash_cuda.ops", True),
    ("from ..ops import _backward", "flash_cuda.integrations.sdpa", True),
    ("from . import ops\nops._backward(None)", "flash_cuda.interface", True),
    ("import flash_cuda.ops as o\no._is_empty(1, 2)", "flash_cuda.kvcache", True),
    ("import flash_cuda\nflash_cuda.ops._is_empty(1, 2)", "flash_cuda.kvcache", True),
    ("from .. import _ext\n_ext._C", "flash_cuda.integrations.sdpa", True),
    ("from . import _ext\n_ext.require()", "flash_cuda.ops", False),            # a private module
    ("from .validation import check_device, PREFIX", "flash_cuda.ops", False),
    ("import torch\ntorch._C._are_functorch_transforms_active()", "flash_cuda.ops", False),
    ("from . import ops\nops.fwd.__name__", "flash_cuda.interface", False),    # dunder
    ("from .validation import _check_rank", "flash_cuda.validation", False),   # its own name
    ("from . import kvcache_checks\nkvcache_checks._plans.clear()", "flash_cuda.kvcache", True),
    ("from .kvcache_checks import plan_call, plain", "flash_cuda.kvcache", False),
    # a bench script (outside the package)
    ("from flash_cuda import distributed as fcd\nfcd._Config", "bench.ring", True),
    ("from flash_cuda.ring import _plan", "bench.ring", True),
    ("import flash_cuda\nflash_cuda.ring._Chunk(0, 0, 1)", "bench.ring", True),
    ("import flash_cuda._ext as ext\next._C", "bench.ab_builds", True),
    ("from flash_cuda import ring as fcr\nfcr.RingAttention.apply", "bench.ring", False),
    ("from flash_cuda import ring\ncfg = ring.Config\ncfg._replace", "bench.ring", False),
    ("import flash_cuda._ext as ext\next.is_available()", "bench.ab_builds", False),
])
def test_the_check_itself(line, module, bad):
    """The checker finds what it must find and nothing else (a check that cannot fail proves
    nothing)."""
    is_package = module in ("flash_cuda", "flash_cuda.integrations")
    assert bool(violations(line, module, is_package, _SUBMODULES)) == bad, violations(line, module, is_package,
                                                                                    _SUBMODULES)
