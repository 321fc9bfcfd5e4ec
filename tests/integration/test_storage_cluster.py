"""ClusterRepo on a real Postgres: the stored shard count, its two-step change, NOTIFY, the lock."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

from kernel.errors import Conflict
from storage.repos.cluster import _RESCALE_LOCK, ClusterRepo, ShardState


@pytest.fixture
def group() -> str:
    return f"test-{secrets.token_hex(3)}-"  # each test its own host group: the pool's database is shared


async def test_the_first_count_stored_wins_over_later_defaults(pool, group):
    repo = ClusterRepo(pool)
    assert await repo.get(group) is None
    first = await repo.ensure(group, 4)
    assert first == ShardState(shards=4, pending=None, generation=1, host_group=group)
    assert await repo.ensure(group, 9) == first  # a gateway started with another CE_SHARDS adopts it


async def test_a_rescale_goes_through_pending_to_committed_each_step_a_new_generation(pool, group):
    repo = ClusterRepo(pool)
    await repo.ensure(group, 2)
    pending = await repo.begin(group, 4)
    assert (pending.shards, pending.pending, pending.generation) == (2, 4, 2)
    committed = await repo.commit(group, 4)
    assert (committed.shards, committed.pending, committed.generation) == (4, None, 3)
    assert await repo.get(group) == committed


async def test_every_change_is_notified_with_its_host_group(pool, group):
    repo = ClusterRepo(pool)
    await repo.ensure(group, 2)
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await repo.listen(heard.put_nowait)
    try:
        await repo.begin(group, 3)
        await repo.commit(group, 3)
        got = [await asyncio.wait_for(heard.get(), 5), await asyncio.wait_for(heard.get(), 5)]
    finally:
        await listener.close()
    assert got == [group, group]


async def test_changing_a_group_that_was_never_stored_is_a_conflict(pool, group):
    with pytest.raises(Conflict, match="no shard count is stored for host group"):
        await ClusterRepo(pool).begin(group, 3)


async def test_only_one_rescale_of_a_group_runs_at_a_time(pool, group):
    repo = ClusterRepo(pool)
    async with repo.exclusive(group):
        with pytest.raises(Conflict, match="another rescale of the session hosts is running"):
            async with repo.exclusive(group):
                pass
        async with repo.exclusive(group + "other"):  # another group is not blocked
            pass
    async with repo.exclusive(group):  # released on exit
        pass


async def test_a_rescale_lock_whose_unlock_is_lost_goes_with_the_connection(pool, group, monkeypatch):
    # The unlock can fail (a connection error, suppressed); the pool's reset of that connection
    # then releases the lock, or the group could never be rescaled again.
    from storage.pool import Connection

    execute = Connection.execute

    async def lose_unlock(self, query, *args, **kwargs):
        if "pg_advisory_unlock(" in query:
            raise asyncpg.InterfaceError("the unlock was lost")
        return await execute(self, query, *args, **kwargs)

    repo = ClusterRepo(pool)
    monkeypatch.setattr(Connection, "execute", lose_unlock)
    async with repo.exclusive(group):
        pass
    monkeypatch.undo()
    held = await pool.fetchval(  # by any connection: the lock is re-entrant for the one holding it
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::bigint::oid", _RESCALE_LOCK)
    assert held == 0


async def test_a_commit_over_a_pending_state_that_moved_on_writes_nothing(pool, group):
    repo = ClusterRepo(pool)
    await repo.ensure(group, 2)
    pending = await repo.begin(group, 4)
    settled = await repo.commit(group, 2, generation=pending.generation)  # a host rolled it back first
    assert (settled.shards, settled.pending, settled.generation) == (2, None, 3)
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await repo.listen(heard.put_nowait)
    try:
        # the rescale that began it, its lock lost with its connection: its commit must not
        # overrule the rollback, and says what stands instead (nor is anything notified)
        assert await repo.commit(group, 4, generation=pending.generation) == settled
        # a commit retried after its answer was lost finds itself written, not written twice
        assert await repo.commit(group, 2, generation=pending.generation) == settled
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(heard.get(), 0.3)
    finally:
        await listener.close()
    assert await repo.get(group) == settled


async def test_a_pending_state_is_rolled_back_only_once_no_rescale_holds_the_lock(pool, group):
    repo = ClusterRepo(pool)
    assert await repo.settle_abandoned(group) is None  # nothing stored
    first = await repo.ensure(group, 2)
    assert await repo.settle_abandoned(group) == first  # nothing pending: left as it is
    pending = await repo.begin(group, 3)
    async with repo.exclusive(group):  # the rescale that began it is running
        assert await repo.settle_abandoned(group) == pending
    assert await repo.get(group) == pending
    settled = await repo.settle_abandoned(group)  # its process is gone, and its lock with it
    assert (settled.shards, settled.pending, settled.generation) == (2, None, 3)
    assert await repo.get(group) == settled
