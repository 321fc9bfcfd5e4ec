"""ClusterRepo: the shard count of the session hosts, agreed through Postgres (table ce_cluster).

A gateway reads it at start (`ensure` inserts CE_SHARDS the first time) and follows changes on
`LISTEN ce_cluster`; a session host reads it when it starts, so a host that Ray restarted comes
back with the count in force, not the one it was created with. A rescale (`chat-engine scale N`)
moves it in two steps under an advisory lock: `begin` (pending = N: sessions that move have no
owner while their old host flushes them) then `commit` (shards = N). Each step bumps
`generation` and sends `NOTIFY ce_cluster, '<host_group>'` in the same transaction. A rescale
commits over the pending state it began (compare-and-set on `generation`), and a pending state
that no rescale holds the lock for any more is rolled back by `settle_abandoned`: whichever of the
two commits first stands, the other writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import msgspec

from kernel.errors import Conflict
from storage.errors import translate
from storage.pool import hold_session_state
from storage.repos.notify import ChannelListener, listen

CLUSTER_CHANNEL = "ce_cluster"

#: pg_try_advisory_lock namespace for rescales ("ce-scale"); the host group is the second key
_RESCALE_LOCK = 0x63652D73


class ShardState(msgspec.Struct, frozen=True, kw_only=True):
    """The shard count in force for a host group; `pending` is the target of a rescale under way."""

    shards: int
    pending: int | None = None
    generation: int = 0
    host_group: str = ""


_COLUMNS = "host_group, shards, pending, generation"
_NOTIFY = "SELECT pg_notify('ce_cluster', $1)"


def _state(row: asyncpg.Record) -> ShardState:
    return ShardState(shards=row["shards"], pending=row["pending"], generation=row["generation"],
                      host_group=row["host_group"])


class ClusterRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def get(self, host_group: str = "") -> ShardState | None:
        """The group's shard state, or None before any gateway stored one."""
        with translate("reading the shard count"):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM ce_cluster WHERE host_group = $1", host_group)
        return None if row is None else _state(row)

    async def ensure(self, host_group: str, shards: int) -> ShardState:
        """The group's shard state; stores `shards` (generation 1) when there is none yet."""
        with translate("storing the initial shard count"):
            await self._pool.execute(
                "INSERT INTO ce_cluster (host_group, shards) VALUES ($1, $2) ON CONFLICT (host_group) DO NOTHING",
                host_group, shards,
            )
        state = await self.get(host_group)
        assert state is not None
        return state

    async def begin(self, host_group: str, target: int) -> ShardState:
        """Step 1 of a rescale: `pending = target`. Returns the new state."""
        return await self._change(
            host_group, "UPDATE ce_cluster SET pending = $2, generation = generation + 1, updated_at = now() "
            f"WHERE host_group = $1 RETURNING {_COLUMNS}", target,
        )

    async def commit(self, host_group: str, target: int, *, generation: int | None = None) -> ShardState:
        """Step 2 of a rescale (or a rollback to the old count): `shards = target`, no pending.

        With `generation` (that of the pending state the caller began or found), nothing is
        written unless the stored state is still that one. Returns the stored state either way:
        the caller sees whether its commit stands (`pending` None, `shards` its count), also
        when an earlier attempt was written but its answer lost.
        """
        return await self._change(
            host_group, "UPDATE ce_cluster SET shards = $2, pending = NULL, generation = generation + 1, "
            "updated_at = now() WHERE host_group = $1 AND ($3::bigint IS NULL OR generation = $3) "
            f"RETURNING {_COLUMNS}", target, generation,
        )

    async def settle_abandoned(self, host_group: str = "") -> ShardState | None:
        """The group's shard state, after rolling back a rescale that stopped between its steps.

        A state left `pending` while no rescale holds the group's lock was left by a rescale that
        no longer runs (`chat-engine scale` killed, or Postgres away through all its commit
        retries): a session that moves is owned by no host until a count is committed, so the
        count in force (`shards`) is committed again, over that pending state only (see
        `commit`; a rescale whose lock went with its connection may still be committing, and
        only one of the two commits is written). While a rescale holds the lock, the state is
        returned as it is: that rescale commits it. Returns None when the group has no stored
        state; raises StorageUnavailable/StorageError when Postgres fails.
        """
        state = await self.get(host_group)
        if state is None or state.pending is None:
            return state
        async with contextlib.AsyncExitStack() as held:
            try:
                await held.enter_async_context(self.exclusive(host_group))
            except Conflict:
                return state  # a rescale holds the lock: it is alive, and commits its own state
            state = await self.get(host_group)  # that rescale may have finished meanwhile
            if state is not None and state.pending is not None:
                state = await self.commit(host_group, state.shards, generation=state.generation)
        return state

    async def _change(self, host_group: str, sql: str, *args: Any) -> ShardState:
        with translate("changing the shard count"):
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(sql, host_group, *args)
                if row is not None:
                    await conn.execute(_NOTIFY, host_group)
                    return _state(row)
                row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM ce_cluster WHERE host_group = $1", host_group)
        if row is None:
            raise Conflict(f"no shard count is stored for host group {host_group!r}; start a gateway first")
        return _state(row)  # a compare-and-set that found another generation: nothing written

    @contextlib.asynccontextmanager
    async def exclusive(self, host_group: str = "") -> AsyncIterator[None]:
        """Hold the group's rescale lock for the block. Raises Conflict when another rescale holds it."""
        with translate("taking the rescale lock"):
            conn = await self._pool.acquire()
        try:
            hold_session_state(conn)  # a lock not unlocked below is released with the connection
            with translate("taking the rescale lock"):
                got = await conn.fetchval("SELECT pg_try_advisory_lock($1, hashtext($2))", _RESCALE_LOCK, host_group)
            if not got:
                raise Conflict("another rescale of the session hosts is running; wait for it to finish, then retry")
            try:
                yield
            finally:
                with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await conn.execute("SELECT pg_advisory_unlock($1, hashtext($2))", _RESCALE_LOCK, host_group)
        finally:
            await self._pool.release(conn)

    async def listen(self, callback: Callable[[str], Any], *, on_lost: Callable[[], Any] | None = None) -> ClusterListener:
        """Call `callback(host_group)` on every change; holds one pool connection until `close()`.

        `on_lost` is called if that connection dies (notifications meanwhile are lost: re-read).
        """
        return await listen(self._pool, CLUSTER_CHANNEL, callback, on_lost=on_lost,
                            doing="subscribing to shard count changes")


ClusterListener = ChannelListener
