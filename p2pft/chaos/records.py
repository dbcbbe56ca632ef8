"""Reading the JSON-lines stats file that every replica process of a chaos run appends to."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_stats(path: Path) -> list[dict[str, Any]]:
    """Every complete record of ``path``; none if the file does not exist yet."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # the last line of a SIGKILLed process may be cut
    except FileNotFoundError:
        pass
    return out
