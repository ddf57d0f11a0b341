"""docs/architecture.md stays true: every ``file:function`` it names exists, and every
package imports only what its table allows."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
REF = re.compile(r"`(nvllm/[\w/]+\.py):([\w.]+)`")
# package -> the nvllm packages its modules may import (besides itself).
ALLOWED = {
    "common": set(),
    "leader": {"common"},
    "worker": {"common", "kernels"},
    "kernels": {"common"},
}


def _defined(path: pathlib.Path) -> set[str]:
    """Top-level functions and classes of a module, and Class.method for methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{n.name}" for n in node.body
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def test_every_named_function_exists():
    refs = REF.findall(DOC.read_text())
    assert len(refs) > 30, "the request trace names its hops as `file:function`"
    missing = [f"{f}:{name}" for f, name in refs
               if not (ROOT / f).is_file() or name not in _defined(ROOT / f)]
    assert missing == []


def test_no_document_links_outside_the_repository():
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)", doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name} links outside: {target}"
            assert path.exists(), f"{doc.name} links to a missing file: {target}"


def _nvllm_imports(path: pathlib.Path) -> set[str]:
    out = set()
    package = path.relative_to(ROOT).parent.parts  # ("nvllm", "leader") for a leader module
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            # `from ..worker import x`, `from nvllm import worker`: resolve the module, and
            # count each imported name as a possible submodule.
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            mods = [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            parts = m.split(".")
            if parts[0] == "nvllm" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_follow_the_rules(package):
    bad = {}
    for path in sorted((ROOT / "nvllm" / package).rglob("*.py")):
        extra = _nvllm_imports(path) - ALLOWED[package] - {package}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert bad == {}
