"""Waiting on the event loop without sleeping on the clock."""

from __future__ import annotations

import asyncio


async def spin(until, *, limit: int = 1000) -> None:
    """Yield to the loop until `until()` holds; fails instead of hanging."""
    for _ in range(limit):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")
