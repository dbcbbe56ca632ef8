"""Rounds every ``span`` inner steps (local SGD, DiLoCo): the kernel's piece for algorithms whose
replicas train on their own between syncs.

At a span's start ``begin()`` is the kernel's collective begin and the round's samples are split
over the span's inner steps, in order (each inner step's share then over the replica's ranks, so
the first k inner steps train a prefix of the round's samples: a partial span, ``round(short)``,
leaves exactly the rest to the cursor); every inner step beats, so a span longer than ``loop_timeout`` does
not get the replica left out as stalled (an algorithm cannot forget it). A round may also be
reduced in the background during the span's last inner steps (``send`` / ``join``: Streaming
DiLoCo's overlap), on a device stream of its own.
"""
from __future__ import annotations

import threading

from ...transport.device import SideStream, written_event
from .attempt import StepResult
from .engine import StepEngine
from .errors import StepTimeout, Stopped
from .stepbuf import StepBuffer

JOIN_MARGIN_S = 30.0   # beyond the step timeout, how long a span's end waits for a round in flight


class Spans:
    """Where a replica is in its span of inner steps, and the round at its end."""

    def __init__(self, kernel: StepEngine, span: int, like: StepBuffer) -> None:
        if isinstance(span, bool) or not isinstance(span, int) or span < 1:
            raise ValueError(f"the span between syncs must be a positive int, got {span!r}")
        self.kernel = kernel
        self.span = span
        self.k = 0                          # inner steps run in the current span
        self.samples: list[int] = []        # the slot's samples for the round, every rank's ([] : none)
        self._side = SideStream(like.flat)  # the background round's stream (a no-op on CPU)
        self._inflight: threading.Thread | None = None
        self._out: list[StepResult | BaseException] = []

    @property
    def starting(self) -> bool:
        return self.k == 0

    def begin(self, stop: bool = False) -> list[int]:
        """This inner step's samples; at a span's start, the kernel's collective begin. Beats."""
        self.kernel.beat()
        if self.k == 0:
            self.kernel.begin(stop)
            self.samples = self.kernel.slot_samples()
        elif stop or self.kernel.stopping:
            raise Stopped("stop requested")
        per = len(self.samples) // self.span
        block = self.samples[self.k * per:(self.k + 1) * per]
        share = len(block) // self.kernel.world
        return block[self.kernel.rank * share:(self.kernel.rank + 1) * share]

    def stepped(self) -> bool:
        """One inner step taken: True when the span is complete (its round is due)."""
        self.k += 1
        return self.k >= self.span

    @property
    def untrained(self) -> int:
        """Samples of the round the inner steps not taken (yet) would have trained."""
        return (self.span - self.k) * (len(self.samples) // self.span)

    def round(self, short: int = 0) -> StepResult:
        """The round at the span's end, on this thread (or the one sent early); a new span next.
        `short`: the round's samples left untrained (a partial span: ``untrained``)."""
        self.k = 0
        return self.join() if self._inflight is not None else self.kernel.commit(short)

    def send(self, buf: StepBuffer, short: int = 0) -> None:
        """Reduce the round now, on a thread, while inner steps go on (`buf`: the contribution
        as this thread's stream wrote it; `short`: its samples left untrained)."""
        ready = written_event(buf.flat)
        out: list[StepResult | BaseException] = []

        def run() -> None:
            try:   # on a stream of its own: neither serialized with training nor racing its writes
                with self._side.use(after=ready):
                    out.append(self.kernel.commit(short))
            except BaseException as exc:  # handed to the training thread at the span's end
                out.append(exc)
        self._out = out
        self._inflight = threading.Thread(target=run, name=f"p2pft-sync-{self.kernel.step}", daemon=True)
        self._inflight.start()

    def join(self) -> StepResult:
        t = self._inflight
        assert t is not None
        t.join(self.kernel.step_timeout + JOIN_MARGIN_S)
        if t.is_alive():
            raise StepTimeout(f"the sync of step {self.kernel.step} did not end within {self.kernel.step_timeout} s")
        self._inflight = None
        self._side.join(self.kernel.buf.flat)   # the training stream waits for the round's device work
        got = self._out[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight.join(self.kernel.step_timeout + JOIN_MARGIN_S)


__all__ = ["JOIN_MARGIN_S", "Spans"]
