"""SIGTERM and SIGINT for the example replicas: a flag the loop reads, and a stop request to the
trainer so that whichever call the loop is in (``begin``, ``commit``, ``finish``) raises ``Stopped``."""
from __future__ import annotations

import signal
from typing import Protocol


class Stoppable(Protocol):
    def request_stop(self) -> None: ...


class StopOnSignal:
    """Installed at construction; ``attach`` the trainer once it exists."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.flag = False
        self._trainer: Stoppable | None = None
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def attach(self, trainer: Stoppable) -> None:
        self._trainer = trainer
        if self.flag:
            trainer.request_stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.flag = True
        if self._trainer is not None:
            self._trainer.request_stop()


__all__ = ["StopOnSignal"]
