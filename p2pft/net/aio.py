"""Event-loop helpers: uvloop when present, the stdlib loop otherwise; cheap waits for the
control plane's per-message loops."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed."""
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class Wakeup:
    """A flag one coroutine waits on with a timeout, with no Task and no ``wait_for`` per wait.

    The control plane's loops wait once per message sent and once per timer tick; with
    ``asyncio.wait_for(event.wait(), t)`` each wait costs a Task and its bookkeeping, which was
    most of an idle peer's CPU. Here a wait is one future and one timer handle. Loop thread only.
    """

    __slots__ = ("_flag", "_fut")

    def __init__(self) -> None:
        self._flag = False
        self._fut: asyncio.Future[bool] | None = None

    def set(self) -> None:
        self._flag = True
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(True)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    async def wait(self, timeout: float) -> bool:
        """True once set (at once if it is), False after `timeout` seconds."""
        if self._flag:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._fut = fut
        timer = loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self._fut = None


def _expire(fut: "asyncio.Future[bool]") -> None:
    if not fut.done():
        fut.set_result(False)


async def read_or_idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int,
                       timeout: float) -> bytes | None:
    """reader.read(n), or None after `timeout` s without data (the connection is then aborted).
    A timer per read rather than ``wait_for`` (a Task) per message received."""
    idle: list[bool] = []

    def expire() -> None:
        idle.append(True)
        writer.transport.abort()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        data = await reader.read(n)
    except (ConnectionError, OSError):
        if not idle:
            raise
    finally:
        timer.cancel()
    return None if idle else data
