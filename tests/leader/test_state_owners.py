"""One owner per piece of state: only the scheduler writes a Sequence.

An AST scan of nvllm/leader: outside scheduler.py (and sequence.py itself) no statement
may assign, augment, delete or subscript-assign an attribute named as a Sequence field,
nor call a mutating method on one (``seq.token_ids.append``). Receivers named ``self`` are
another class's own state. The KV-cache manager's share of a sequence lives in its
``SeqBlocks`` (``seq.blocks``), whose fields have names of their own.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from nvllm.leader.sequence import Sequence

LEADER = pathlib.Path(__file__).resolve().parents[2] / "nvllm" / "leader"
OWNERS = {"scheduler.py", "sequence.py"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
            "update", "add", "discard", "setdefault", "popitem", "__setitem__"}
FIELDS = {f.name for f in dataclasses.fields(Sequence)}


def _field_of(node: ast.AST) -> str | None:
    """The Sequence field an expression names (``x.f``, ``x.f[i]``), unless ``self.f``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if (isinstance(node, ast.Attribute) and node.attr in FIELDS
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
        return node.attr
    return None


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every write to a Sequence-named attribute in `tree`."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            targets = [node.func.value]
        for target in targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            if any(_field_of(t) for t in elts):
                found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return sorted(found)


def test_the_scan_sees_each_kind_of_write():
    src = ("seq.num_computed_tokens = 0\nseq.num_pending += 1\nseq.token_ids.append(1)\n"
           "s.token_ids[0] = 2\na, seq.status = 1, 2\nself.status = 3\nx.other = 4\n")
    assert [line for line, _ in writes(ast.parse(src))] == [1, 2, 3, 4, 5]


def test_only_the_scheduler_writes_sequences():
    offenders = {}
    for path in sorted(LEADER.glob("*.py")):
        if path.name not in OWNERS:
            found = writes(ast.parse(path.read_text()))
            if found:
                offenders[path.name] = found
    assert offenders == {}
