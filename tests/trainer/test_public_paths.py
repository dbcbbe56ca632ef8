"""The import paths users write keep working: every ``p2pft.trainer...`` path that README.md and
docs/*.md show, and the module paths documented before trainer/ was grouped into packages."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"\bp2pft\.trainer(?:\.[A-Za-z_]\w*)*")
FROM_IMPORT = re.compile(r"\bfrom (p2pft\.trainer(?:\.\w+)*) import ([\w, ]+)")

# old module path -> the object's home since the modules moved (same object, not a copy)
MOVED = {
    "p2pft.trainer.hsdp.HSDP": "p2pft.trainer.algorithms.hsdp.HSDP",
    "p2pft.trainer.outer.outer_sgd": "p2pft.trainer.algorithms.outer.outer_sgd",
    "p2pft.trainer.loader.StepLoader": "p2pft.trainer.data.loader.StepLoader",
    "p2pft.trainer.tokens.TokenFile": "p2pft.trainer.data.tokens.TokenFile",
    "p2pft.trainer.data.TextDataset": "p2pft.trainer.data.text.TextDataset",
}


# Third-party packages that only an extra installs (pyproject.toml): a documented integration
# module that imports one is checked where the extra is installed (.ci/run installs it and runs
# its tests), and here only that the package it lacks is such an extra's.
EXTRAS = {"torchtitan", "triton", "lightning", "torchft", "cupy"}


class NeedsExtra(Exception):
    """The path's module imports a package of an extra that is not installed here."""


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if missing and missing != "p2pft":
                if missing in EXTRAS:
                    raise NeedsExtra(missing) from e
                raise
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def documented_paths() -> set[str]:
    out: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        out.update(m.group(0) for m in DOTTED.finditer(text))
        for m in FROM_IMPORT.finditer(text):
            out.update(f"{m.group(1)}.{name.strip()}" for name in m.group(2).split(",") if name.strip())
    return out


def test_every_documented_path_resolves() -> None:
    paths = documented_paths()
    assert {"p2pft.trainer.FaultTolerant", "p2pft.trainer.data.TextDataset"} <= paths, sorted(paths)
    bad = []
    for p in sorted(paths):
        try:
            resolve(p)
        except NeedsExtra:
            continue
        except (ImportError, AttributeError) as e:
            bad.append(f"{p}: {e!r}")
    assert not bad, "documented paths that do not import:\n" + "\n".join(bad)


def test_moved_modules_keep_their_old_paths() -> None:
    for old, new in MOVED.items():
        assert resolve(old) is resolve(new), old
    module, name = "p2pft.trainer.loader", "StepLoader"
    assert getattr(importlib.import_module(module), name) is resolve("p2pft.trainer.StepLoader")


def test_old_paths_import_first_thing_in_a_fresh_interpreter() -> None:
    """``from p2pft.trainer.loader import StepLoader`` as a script's first import."""
    code = ("from p2pft.trainer.loader import StepLoader\nfrom p2pft.trainer.hsdp import HSDP\n"
            "import p2pft.trainer.tokens, p2pft.trainer.outer\n"
            "assert StepLoader.__module__ == 'p2pft.trainer.data.loader', StepLoader.__module__\n"
            "assert HSDP.__module__ == 'p2pft.trainer.algorithms.hsdp', HSDP.__module__\n"
            "print(p2pft.trainer.tokens.TokenFile.__name__, p2pft.trainer.outer.outer_sgd.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["TokenFile", "outer_sgd"]
