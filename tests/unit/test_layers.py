"""Layer contracts, read from the source: imports point one way (trainer -> p2pft -> transport),
no module imports itself back through a cycle, and the protocol cores are sans-IO.

The chaos harness (``p2pft/chaos``) sits on top of all three layers; the console entry
(``p2pft/cli.py``, ``p2pft/__main__.py``) dispatches to it lazily.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# source folder -> package name (see pyproject's package-dir)
FOLDERS = {"p2pft": "p2pft", "transport": "p2pft.transport", "trainer": "p2pft.trainer"}
TOP = ("p2pft.chaos", "p2pft.cli", "p2pft.__main__")
# The protocol cores: pure state machines driven by messages and clock ticks. They may not do
# I/O, read a clock, start threads or touch torch; the driver and the simulator bind them.
CORES = "p2pft.core"   # every module below it
IO_MODULES = ("asyncio", "socket", "selectors", "ssl", "threading", "subprocess", "time", "torch",
              "numpy", "uvloop")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [] if rel.name == "__init__" and rel.parent == Path(".") else list(rel.parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ours that `name` imports (any nesting level, lazy imports included)."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                mod = f"{anchor}.{node.module}" if node.module else anchor
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule (and runs pkg's __init__ first, which
            # a package's own modules never need to import back); `from pkg import name` the package.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _layer(mod: str) -> str:
    if mod.startswith("p2pft.transport"):
        return "transport"
    if mod.startswith("p2pft.trainer"):
        return "trainer"
    if mod.startswith(TOP):
        return "top"
    return "p2pft"


RANK = {"transport": 0, "p2pft": 1, "trainer": 2, "top": 3}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_imports_point_one_way() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in _graph().items() for t in ts if RANK[_layer(t)] > RANK[_layer(m)])
    assert not bad, "imports against trainer -> p2pft -> transport:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle_and_a_wrong_direction(tmp_path: Path) -> None:
    """The two tests above can fail: the same reading flags a planted cycle and upward import."""
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    known = {"p2pft.a", "p2pft.b"}
    assert _imports("p2pft.a", tmp_path / "a.py", known) == {"p2pft.b"}
    assert _imports("p2pft.b", tmp_path / "b.py", known) == {"p2pft.a"}
    assert RANK[_layer("p2pft.trainer.kernel")] > RANK[_layer("p2pft.runtime")] > RANK[_layer("p2pft.transport.tcp")]


def _foreign_imports(path: Path) -> set[str]:
    """Top-level names of every module outside the project that a file imports (lazy ones too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_protocol_cores_are_sans_io() -> None:
    mods = _modules()
    cores = [m for m in mods if m == CORES or m.startswith(CORES + ".")]
    assert len(cores) >= 10, cores   # views, gossip, Raft, the step core...
    bad = sorted(f"{c} imports {m}" for c in cores for m in _foreign_imports(mods[c]) if m in IO_MODULES)
    assert not bad, "protocol cores must stay sans-IO:\n" + "\n".join(bad)


def test_the_sans_io_reader_sees_io(tmp_path: Path) -> None:
    (tmp_path / "core.py").write_text("import random\ndef f():\n"
                                      "    import asyncio.tasks\n    from time import monotonic\n")
    assert _foreign_imports(tmp_path / "core.py") == {"random", "asyncio", "time"}
