"""docs/architecture.md stays true: every ``file:function`` it names exists, and every
package imports only what its table allows; and every link in README.md and docs/ leads
to a file of the repository and a heading that exist."""

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
    "kernels": set(),  # a leaf: the kernels take shapes and tensors, never configs
    "router": {"common"},  # a client of the leaders: the wire, never the engine
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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """Markdown without its code: fenced blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped,
    lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(doc: pathlib.Path) -> set[str]:
    """Every anchor a document has: its headings' slugs (repeats numbered as GitHub
    does) and explicit ``<a id=...>`` / ``name=...`` targets."""
    text = FENCE.sub("", doc.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_is_githubs():
    assert slug("Remote access and authentication") == "remote-access-and-authentication"
    assert slug("Engine settings (`LLM(...)` and `nvllm-launch`)") == \
        "engine-settings-llm-and-nvllm-launch"
    assert slug("Leader ⇄ workers (internal)") == "leader--workers-internal"
    assert slug("See [the guide](x.md) now") == "see-the-guide-now"


def test_every_document_link_resolves():
    """README.md and every docs/ page: a relative link names a file inside the repository
    that exists, and its #anchor (or a bare #anchor, in the same page) is a heading there."""
    assert len(DOCS) > 5
    bad = []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            where = f"{doc.relative_to(ROOT)} -> {target}"
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.is_relative_to(ROOT):
                bad.append(f"{where}: outside the repository")
            elif not path.exists():
                bad.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{where}: no such heading")
    assert bad == []


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
