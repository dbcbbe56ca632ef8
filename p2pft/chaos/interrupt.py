"""Ctrl-C, SIGTERM and SIGHUP all end a chaos run the same way: stop, measure, report.

The handler only records the signal; the harness loop sees it within one tick, stops every
cluster (replicas, then witnesses and coordinators, then the process group), and reports what
was measured up to that moment. A later signal while stopping changes nothing: the stop is
bounded anyway, and a harness killed outright still takes its processes with it
(``p2pft.deploy.procs``).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The run was stopped by a signal before training began: nothing was measured."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} before training began")
        self.signum = signum


@dataclass
class Interrupt:
    signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def request(self, signum: int, frame: object = None) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise ``Interrupted`` if a signal came (for waits before any measurement)."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    @contextmanager
    def handling(self) -> Iterator["Interrupt"]:
        """Route SIGINT, SIGTERM and SIGHUP here for the duration; restore the old handlers after."""
        old = {s: signal.signal(s, self.request) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
