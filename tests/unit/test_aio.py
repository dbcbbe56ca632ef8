"""The control plane's cheap waits (p2pft/net/aio.py): a timed wake-up flag and a read with an idle
timeout, on real sockets."""
from __future__ import annotations

import asyncio
import time

from p2pft.net import aio
from p2pft.net.aio import Wakeup, read_or_idle


def test_wakeup_times_out_wakes_and_remembers_a_set_before_the_wait() -> None:
    async def main() -> None:
        w = Wakeup()
        t = time.monotonic()
        assert await w.wait(0.05) is False
        assert 0.04 <= time.monotonic() - t < 1.0
        w.set()
        assert w.is_set() and await w.wait(5.0) is True      # set before the wait: at once
        w.clear()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, w.set)
        t = time.monotonic()
        assert await w.wait(5.0) is True
        assert time.monotonic() - t < 1.0
        w.clear()
        waiter = asyncio.ensure_future(w.wait(5.0))            # a cancelled wait leaves no timer behind
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert await w.wait(0.01) is False
    aio.run(main())


def test_read_or_idle_returns_data_then_none_and_aborts_after_the_idle_timeout() -> None:
    async def main() -> None:
        got: list[bytes | None] = []
        done = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await read_or_idle(reader, writer, 100, 5.0))
            got.append(await read_or_idle(reader, writer, 100, 0.1))
            done.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        await writer.drain()
        await asyncio.wait_for(done.wait(), 5.0)
        assert got == [b"hello", None]
        assert await asyncio.wait_for(reader.read(1), 5.0) == b""   # the server side aborted it
        writer.close()
        server.close()
        await server.wait_closed()
    aio.run(main())
