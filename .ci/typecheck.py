"""Type-check the package as it is installed: ``mypy -p p2pft`` over the layout pyproject declares.

pyproject's ``package-dir`` maps ``p2pft.transport`` to ``transport/`` and ``p2pft.trainer`` to
``trainer/``. mypy finds modules by directory and cannot follow that mapping (an editable install
resolves it through an import hook mypy does not run), so this builds the installed layout as a tree
of symlinks, runs mypy there with the project's configuration (``[tool.mypy]`` in pyproject.toml),
and prints every path as it is in the source tree. The tree lives under ``.mypy_cache/`` next to
mypy's own cache and is rebuilt on every run, so incremental runs stay fast and nothing stale is
checked.

Usage: ``python .ci/typecheck.py [extra mypy arguments]``; the exit status is mypy's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache"
TREE = CACHE / "layout"
# Package -> source directory, as in pyproject's [tool.setuptools] package-dir.
MAPPED = {"transport": "transport", "trainer": "trainer"}
BACK = re.compile(r"(?<![\w./-])p2pft/(" + "|".join(MAPPED) + r")/")


def build_tree() -> Path:
    """The installed layout: p2pft/<each entry of p2pft/> plus p2pft/<mapped> -> <source dir>."""
    pkg = TREE / "p2pft"
    if TREE.exists():
        shutil.rmtree(TREE)
    pkg.mkdir(parents=True)
    for entry in sorted((ROOT / "p2pft").iterdir()):
        if entry.name == "__pycache__" or entry.name in MAPPED:
            continue
        (pkg / entry.name).symlink_to(entry)
    for sub, src in MAPPED.items():
        (pkg / sub).symlink_to(ROOT / src, target_is_directory=True)
    return TREE


def main(argv: list[str]) -> int:
    tree = build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(CACHE), *argv, "-p", "p2pft"]
    env = dict(os.environ, MYPY_FORCE_COLOR="0")
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    for stream, text in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        stream.write(BACK.sub(r"\1/", text))
        stream.flush()
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
