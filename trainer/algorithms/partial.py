"""The span a DiLoCo replica trains after coming back mid-span: it ends when a peer starts the sync.

The replica trains inner steps from the global weights until a peer starts the sync (its ring
call at our data server: ``StepEngine.ring_calling``), then contributes the steps it took (the
kernel's ``short``; docs/diloco.md, "Partial spans"). A replica of one rank watches on a thread
of its own and starts the sync at once, from the weights of its last completed inner step, while
its training thread may still be in the next one (dropped at its ``commit``): the peers wait for
nobody. The ranks of an island must agree on the inner step the span ends at, so they look
together after each inner step instead (a collective): the peers then wait at most the inner
step the island is in.
"""
from __future__ import annotations

import threading
from typing import Callable

from ..kernel.engine import StepEngine
from ..kernel.span import Spans
from ..kernel.stepbuf import StepBuffer

WATCH_S = 0.005   # how often a one-rank replica looks for the peers' call


class PartialSpan:
    """Whether the current span is partial, and where it ends."""

    def __init__(self, kernel: StepEngine, spans: Spans, load: Callable[[], StepBuffer]) -> None:
        self.kernel, self.spans, self._load = kernel, spans, load
        self.lock = threading.Lock()   # an inner optimizer step, or the watcher's load of the pseudo-gradient
        self.active = False
        self.short: int | None = None  # set once the sync started in the background: samples left untrained
        self._ended = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def sent(self) -> bool:
        """The sync of this span runs already (started by the watcher)."""
        return self.short is not None

    def start(self) -> None:
        """A partial span begins (the replica is promoted, its local weights are the global ones)."""
        self.active, self.short = True, None
        if self.kernel.world == 1:
            self._ended.clear()
            self._watcher = threading.Thread(target=self._watch, args=(self.kernel.att_epoch,), daemon=True,
                                             name="p2pft-partial-span")
            self._watcher.start()

    def ends_here(self) -> int | None:
        """After an inner step, on an island: the samples left untrained when a peer has
        started the sync (the span ends here), else None. Collective over the island's ranks."""
        if not self.active or self._watcher is not None or not self.kernel.ring_calling():
            return None
        return self.spans.untrained

    def finish(self) -> None:
        """The span's sync is under way or done: stop watching."""
        self.active, self.short = False, None
        self._ended.set()
        w, self._watcher = self._watcher, None
        if w is not None and w is not threading.current_thread():
            w.join(5.0)

    def _watch(self, epoch: int) -> None:
        """One rank: poll for the peers' call; once it comes (and an inner step is done), load
        the pseudo-gradient of the weights as they are and start the sync in the background."""
        while not self._ended.wait(WATCH_S):
            if self.spans.k == 0 or not self.kernel.comms.calling(epoch):
                continue
            with self.lock:   # not inside an inner optimizer step
                if self._ended.is_set() or not self.active:
                    return
                short = self.spans.untrained
                self.spans.send(self._load(), short)
                self.short = short
                return


__all__ = ["PartialSpan"]
