"""A watcher's wait on its session's bell (actors.host._rung_within): the bell is shared by every
watcher of the session, so a wait that ends (rung, timed out, cancelled) leaves it as it was."""

from __future__ import annotations

import asyncio

import pytest

from actors.host import _rung_within


async def test_a_bell_rung_during_the_wait_ends_it_at_once():
    bell = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(_rung_within(bell, 60))
    await asyncio.sleep(0)
    bell.set_result(None)
    assert await asyncio.wait_for(waiting, 5) is True


async def test_a_quiet_bell_times_out_and_keeps_no_callback_of_the_waiter():
    bell = asyncio.get_running_loop().create_future()
    assert await _rung_within(bell, 0.01) is False
    assert not bell.done()
    assert not bell._callbacks


async def test_a_cancelled_wait_leaves_the_shared_bell_untouched():
    bell = asyncio.get_running_loop().create_future()
    others = asyncio.create_task(_rung_within(bell, 60))  # another watcher of the same session
    mine = asyncio.create_task(_rung_within(bell, 60))
    await asyncio.sleep(0)
    mine.cancel()
    with pytest.raises(asyncio.CancelledError):
        await mine
    assert not bell.cancelled() and len(bell._callbacks or ()) == 1
    bell.set_result(None)
    assert await asyncio.wait_for(others, 5) is True


async def test_a_bell_that_already_rang_needs_no_wait():
    bell = asyncio.get_running_loop().create_future()
    bell.set_result(None)
    assert await _rung_within(bell, 0) is True
