"""LISTEN subscriptions: a callback per NOTIFY on one channel, on a connection held until closed.

Shared by the catalog channel (tools and bot config changed) and the cluster channel (the shard
count changed).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable
from typing import Any

import asyncpg

from storage.errors import translate
from storage.pool import hold_session_state

Callback = Callable[[str], Any]


class ChannelListener:
    """A live LISTEN on `channel`; `close()` ends it and returns a pooled connection."""

    def __init__(
        self, conn: asyncpg.Connection, channel: str, callback: Callback, *,
        pool: asyncpg.Pool | None, on_lost: Callable[[], Any] | None,
    ) -> None:
        self._conn = conn
        self._channel = channel
        self._callback = callback
        self._pool = pool
        self._on_lost = on_lost
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    #: the Postgres server process of the LISTEN connection, as that process reports it
    #: (`pg_backend_pid()`: a pooler hands its clients made-up ids in the start-up message)
    server_pid: int = 0

    # asyncpg runs these in the context the connection was opened in: often a turn's, with its
    # tenant and session bound for the log lines. Each runs in an empty context instead, and so
    # do the tasks it starts, so that nothing they log carries a stranger's ids.

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        contextvars.Context().run(self._deliver, payload)

    def _deliver(self, payload: str) -> None:
        result = self._callback(payload)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)  # keep a reference until done (asyncio holds tasks weakly)
            task.add_done_callback(self._tasks.discard)

    def _terminated(self, _conn: Any) -> None:
        if not self.closed and self._on_lost is not None:
            contextvars.Context().run(self._on_lost)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self._conn.is_closed():
                self._conn.remove_termination_listener(self._terminated)
                await self._conn.remove_listener(self._channel, self._notified)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            pass  # the connection is gone: nothing left to unsubscribe
        finally:
            if self._pool is not None:
                await self._pool.release(self._conn)


async def listen(
    source: asyncpg.Pool | asyncpg.Connection, channel: str, callback: Callback, *,
    on_lost: Callable[[], Any] | None = None, doing: str = "subscribing to notifications",
) -> ChannelListener:
    """Call `callback(payload)` for every NOTIFY on `channel` (a coroutine callback is scheduled
    as a task). With a pool, one of its connections is held until `close()`. `on_lost` is called
    if that connection dies: notifications meanwhile are lost, so re-read and subscribe again.
    Raises StorageUnavailable when Postgres cannot be reached."""
    pool = source if isinstance(source, asyncpg.Pool) else None
    with translate(doing):
        conn = await pool.acquire() if pool is not None else source
    hold_session_state(conn)  # LISTEN: the pool runs UNLISTEN * when it gets the connection back
    listener = ChannelListener(conn, channel, callback, pool=pool, on_lost=on_lost)
    try:
        with translate(doing):
            listener.server_pid = await conn.fetchval("SELECT pg_backend_pid()")
            await conn.add_listener(channel, listener._notified)
            conn.add_termination_listener(listener._terminated)
    except BaseException:
        if pool is not None:
            await pool.release(conn)
        raise
    return listener
