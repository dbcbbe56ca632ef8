"""The chaos package's imports point one way: no cycle among its modules or with ``p2pft.cli``.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import hides
a cycle from the interpreter, not from a reader.
"""
from __future__ import annotations

import ast
from pathlib import Path

import p2pft

ROOT = Path(p2pft.__file__).parent
FILES = {f"p2pft.{p.stem}": p for p in ROOT.glob("*.py")} | {
    f"p2pft.chaos.{p.stem}": p for p in (ROOT / "chaos").glob("*.py")}


def _imports(module: str, path: Path) -> set[str]:
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.removesuffix(".__init__") for m in out if m in FILES or m.removesuffix(".__init__") in FILES}


def _cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_through_the_chaos_package() -> None:
    graph = {m: _imports(m, p) - {m} for m, p in FILES.items()}
    assert "p2pft.chaos.cli" in graph["p2pft.cli"]  # the command is registered: the edge is real
    cycles = [c for m in FILES if m.startswith("p2pft.chaos.") or m == "p2pft.cli"
              for c in [_cycle_through(m, graph)] if c]
    assert not cycles, " | ".join(" -> ".join(c) for c in cycles)
