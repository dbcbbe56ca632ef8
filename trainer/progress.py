"""Progress of a training loop on a terminal: a compact line every few seconds, the events that
matter (view changes, catch-up, fast-forwards) when they happen, and a summary at the end.

Replica processes started by hand should say that they work; started by a harness (output to
a file), they stay quiet unless asked: ``mode="auto"`` prints only when the stream is a terminal.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO, cast

from .kernel.attempt import StepResult

EVENTS = {"catchup_start": "catching up from a snapshot", "catchup_fetch": "pulling a snapshot",
          "catchup_done": "caught up", "fast_forward": "fast-forwarded", "excluded": "left out of a view",
          "comm_error": "allreduce failed, retrying on the next view"}


class Progress:
    def __init__(self, name: str, *, mode: str = "auto", every: float = 5.0, stream: TextIO | None = None) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"progress mode must be auto, on or off, got {mode!r}")
        self.stream = stream or sys.stderr
        self.enabled = mode == "on" or (mode == "auto" and self.stream.isatty())
        self.name = name
        self.every = every
        self.t0 = self.t_last = time.monotonic()
        self.step0: int | None = None
        self.step_last = 0
        self.committed = self.retries = self.fast_forwarded = 0
        self.epoch: int | None = None
        self.loss: float | None = None
        self.lr: float | None = None
        self.catchups = 0
        self.res: StepResult | None = None

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"[{self.name}] {text}", file=self.stream, flush=True)

    def step(self, res: StepResult, epoch: int | None, loss: float | None = None, lr: float | None = None) -> None:
        if self.step0 is None:
            self.step0 = self.step_last = res.step - int(res.committed)
        self.res = res
        self.committed += int(res.committed)
        self.retries += res.retries
        self.fast_forwarded += res.fast_forwarded
        if loss is not None:
            self.loss = loss
        if lr is not None:
            self.lr = lr
        if epoch is not None and epoch != self.epoch:
            if self.epoch is not None:
                self._say(f"view e{epoch}: {res.role}, {res.contributors} contributing")
            self.epoch = epoch
        now = time.monotonic()
        if now - self.t_last >= self.every:
            rate = (res.step - self.step_last) / (now - self.t_last)
            parts = [f"step {res.step}", f"{rate:.1f} steps/s", f"{res.contributors} contributing", res.role]
            if self.loss is not None:
                parts.insert(1, f"loss {self.loss:.4f}")
            if self.lr is not None:
                parts.insert(2, f"lr {self.lr:.3g}")
            if self.epoch is not None:
                parts.append(f"view e{self.epoch}")
            self._say(" | ".join(parts))
            self.t_last, self.step_last = now, res.step

    def event(self, ev: Mapping[str, object]) -> None:
        kind = cast(str, ev.get("kind", ""))   # every event names its kind
        if kind == "catchup_done":
            self.catchups += 1
        text = EVENTS.get(kind)
        if text is None:
            return
        detail = {k: v for k, v in ev.items() if k not in ("t", "kind") and v is not None}
        self._say(f"{text} ({', '.join(f'{k} {v}' for k, v in detail.items())})" if detail else text)

    def summary(self, step: int) -> str:
        wall = time.monotonic() - self.t0
        start = self.step0 if self.step0 is not None else step
        text = (f"stopped at step {step} after {wall:.1f} s: {step - start} steps "
                f"({(step - start) / wall if wall > 0 else 0.0:.2f}/s), {self.committed} committed here, "
                f"{self.retries} retries, {self.fast_forwarded} fast-forwarded, {self.catchups} catch-ups")
        if self.loss is not None:
            text += f", last loss {self.loss:.4f}"
        self._say(text)
        return text


__all__ = ["Progress"]
