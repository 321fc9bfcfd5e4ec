"""When a catalog listener may trust its cache (services/catalog_sync.py): the beats' timing and
the listener's comings and goings, with a row that answers when the test says so."""

from __future__ import annotations

import asyncio

from services.catalog_sync import CatalogSync


class HeldRow:
    """A listener row whose beats wait for `release`."""

    listener_id = "held"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.pids: list[int] = []

    async def beat(self, backend_pid, seen=0, *, drop_all=None) -> bool:
        self.pids.append(backend_pid)
        await self.release.wait()
        if drop_all is not None:
            drop_all(False)
        return False

    async def remove(self) -> None:
        pass


def make(now: list[float]) -> tuple[CatalogSync, HeldRow, list[object]]:
    dropped: list[object] = []
    sync = CatalogSync(None, lambda tenant=None: dropped.append(tenant), beat_s=3600, trust_s=5.0,
                       clock=lambda: now[0])
    row = HeldRow()
    sync._row = row
    return sync, row, dropped


async def test_a_beat_begun_before_the_listener_reconnected_grants_no_trust():
    now = [0.0]
    sync, row, _ = make(now)
    sync._listening = True  # as listener_up does, without starting the beat loop
    sync._backend_pid = 11
    beat = asyncio.ensure_future(sync.beat())
    await asyncio.sleep(0)
    assert row.pids == [11]
    sync.listener_lost()
    sync._listening, sync._backend_pid = True, 22  # back on a new connection (a new epoch)
    sync._epoch += 1
    row.release.set()
    await beat
    # that beat wrote the old connection's pid, which writers find gone: it must not count
    assert not sync.trusted()
    await sync.beat()
    assert sync.trusted() and row.pids[-1] == 22
    await sync.close()


async def test_trust_lapsing_while_a_beat_runs_drops_every_catalog():
    now = [0.0]
    sync, row, dropped = make(now)
    sync._listening, sync._backend_pid = True, 11
    row.release.set()
    await sync.beat()
    assert sync.trusted()
    dropped.clear()
    row.release.clear()
    beat = asyncio.ensure_future(sync.beat())
    await asyncio.sleep(0)
    now[0] += 6.0  # the beat took longer than the trust window: writers may have left us out
    row.release.set()
    await beat
    assert None in dropped
    assert not sync.trusted()  # trusted from when that beat was sent: 6 s ago
    await sync.beat()
    assert sync.trusted()
    dropped.clear()
    now[0] += 2.0
    await sync.beat()  # on time: nothing dropped
    assert dropped == [] and sync.trusted()
    await sync.close()
