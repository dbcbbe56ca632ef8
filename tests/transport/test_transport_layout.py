"""Module structure of transport/: no import cycles, the server on top."""

from __future__ import annotations

import ast
from pathlib import Path

TRANSPORT = Path(__file__).resolve().parents[2] / "transport"


def _local_imports() -> dict[str, set[str]]:
    """module -> transport modules it imports (any import statement, also inside functions)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(TRANSPORT.glob("*.py")):
        mod = path.stem
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("p2pft.transport."):
                deps.add(node.module.split(".")[2])  # type: ignore[union-attr]
        graph[mod] = deps - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycles() -> None:
    graph = _local_imports()
    assert {"server", "tcp", "stream", "errors"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_server_is_on_top() -> None:
    graph = _local_imports()
    importers = sorted(m for m, deps in graph.items() if "server" in deps and m != "__init__")
    assert importers == [], f"{importers} import the server"
    assert {"staging", "nccl", "stream"} <= graph["server"]  # tcp through staging


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None

