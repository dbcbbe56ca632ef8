"""Logging with the node, epoch and step in every line.

One process usually hosts one node, so the context lives in a small module-level dict that the
runtime updates as views and steps advance; a record's ``extra`` can override it (the simulator
hosts many nodes in one process).
"""
from __future__ import annotations

import logging
import os
import sys

_context: dict[str, object] = {"node": "-", "epoch": 0, "step": 0}

FORMAT = "%(asctime)s %(levelname)-5s [%(node)s e%(epoch)s s%(step)s] %(name)s: %(message)s"


def set_context(**fields: object) -> None:
    """Update the node/epoch/step shown in every following log line of this process."""
    _context.update(fields)


class ContextFilter(logging.Filter):
    """Fills node/epoch/step on records that did not bring their own."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """argparse type: a logging level name, any case; anything else is a usage error (not a
    silent INFO)."""
    import argparse
    if value.upper() not in LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {value!r}; expected one of {', '.join(LEVELS)}")
    return value.upper()


#: third-party loggers kept at INFO when p2pft logs at DEBUG
QUIET_LIBRARIES = ("matplotlib", "PIL", "asyncio", "urllib3")


def setup_logging(level: str | int | None = None, stream=None) -> None:
    """Configure the root logger once (CLI entry points call this)."""
    if level is None:
        level = os.environ.get("P2PFT_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_p2pft", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ContextFilter())
    handler._p2pft = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    # At DEBUG, our own lines, not every library's (matplotlib lists each font it scores).
    for noisy in QUIET_LIBRARIES:
        logging.getLogger(noisy).setLevel(max(level, logging.INFO))


class _Fallback(logging.StreamHandler):
    """p2pft's own lines for a program that configured no logging (``default_logging``). Once
    the program configures the root logger itself, it steps aside: the program's handlers and
    levels rule from then on (at most the record that notices it passes at INFO)."""

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        if root.handlers:
            lg = logging.getLogger("p2pft")
            lg.removeHandler(self)
            if lg.level == logging.INFO:
                lg.setLevel(logging.NOTSET)
            return
        super().emit(record)


def default_logging() -> bool:
    """When the program configured no logging at all (neither the root logger nor "p2pft" has
    a handler), show p2pft's lines at INFO in p2pft's format on stderr, instead of Python's
    last resort (warnings only, without their level). A program that configures logging keeps
    control: nothing is added then. True when it added the handler."""
    lg = logging.getLogger("p2pft")
    if lg.handlers or logging.getLogger().handlers:
        return False
    handler = _Fallback(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ContextFilter())
    lg.addHandler(handler)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    return True
