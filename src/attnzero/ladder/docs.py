"""The ladder's documents include their code from the real files, so the text cannot drift.

In ``docs/ladder.md`` (and ``docs/ladder.zh-CN.md``) a line ::

    <!-- include: attnzero/flash.py::_forward_rows -->

is followed by a fenced block holding the source of that function (or class, or ``Class.method``)
as the file has it now; ``<!-- output: 4 -->`` is followed by a ``text`` block with what rung 4
printed when the docs were last generated. ``attnzero ladder --docs`` rewrites both kinds of blocks
(and the pictures in ``docs/ladder/``); the tests fail when an included block differs from its file.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2]  # the folder that holds the attnzero package
_DIRECTIVE = re.compile(r"^<!-- (include|output): (\S+) -->$")


@dataclass(frozen=True)
class Block:
    """One directive and the fenced block after it: lines ``[start, end)`` of the document are the
    block's body (between the fences)."""

    kind: str  # "include" or "output"
    target: str  # "attnzero/flash.py::_forward_rows" or a rung number
    start: int
    end: int


def source_of(ref: str) -> str:
    """The source text of ``path::Name`` (a function or class at top level, or ``Class.method``),
    decorators included, dedented."""
    path, _, name = ref.partition("::")
    file = SRC / path
    if not file.is_file() or not name:
        raise ValueError(f"include: expected 'attnzero/<file>.py::<name>' naming a file under {SRC}, got {ref!r}")
    text = file.read_text(encoding="utf-8")
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.stmt | None = None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            raise ValueError(f"include: {path} has no function or class {name!r}")
        body = node.body if isinstance(node, ast.ClassDef) else []
    assert node is not None and node.end_lineno is not None
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines = text.splitlines()[first - 1 : node.end_lineno]
    indent = min(len(s) - len(s.lstrip()) for s in lines if s.strip())
    return "\n".join(s[indent:] for s in lines)


def blocks(text: str) -> list[Block]:
    """The directives of a document with the fenced block that follows each."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _DIRECTIVE.match(line.strip())
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise ValueError(f"line {i + 1}: {line.strip()} must be followed by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"line {i + 1}: the fenced block after {line.strip()} is not closed")
        found.append(Block(m.group(1), m.group(2), i + 2, end))
    return found


def refresh(text: str, outputs: dict[int, list[str]] | None = None) -> str:
    """The document with every include block replaced by its source now, and every output block of
    a rung in ``outputs`` by those lines."""
    lines = text.splitlines()
    for b in reversed(blocks(text)):
        if b.kind == "include":
            lines[b.start : b.end] = source_of(b.target).splitlines()
        elif outputs is not None and int(b.target) in outputs:
            lines[b.start : b.end] = outputs[int(b.target)]
    return "\n".join(lines) + "\n"


def stale(text: str) -> list[str]:
    """The include targets whose block in ``text`` differs from the file now."""
    lines = text.splitlines()
    return [
        b.target
        for b in blocks(text)
        if b.kind == "include" and "\n".join(lines[b.start : b.end]) != source_of(b.target)
    ]
