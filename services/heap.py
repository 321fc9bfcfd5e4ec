"""The cyclic garbage collector of the engine's long-running processes (session hosts, gateways).

CPython runs a young collection whenever its tracked objects allocated minus freed since the
last one exceed 700. A turn holds a few thousand objects at once for a moment (the SDK's request
and answer, aiohttp's and asyncpg's buffers and futures), and reference counting frees nearly all
of them when it ends; at 700, almost every turn's peak set off a young collection that walked
them and promoted the ones still in use, every tenth of those an older collection, and then full
ones over everything the process had built since start-up. At 10,000 the peaks pass under the
threshold, and a young collection comes only when what outlives turns has grown by that much.
Cycles are still collected, later and in one go. Measured (`make bench` in-process way, 3,000
one-tool-round messages after warm-up, this process's collections): at 700, 1,705-1,724 young,
155-156 older and 14 full collections, 0.67-0.91 s of collecting in all, pauses up to 13-22 ms;
at 10,000, 7 young collections, 23-36 ms in all, none older; resident memory the same
(README § Performance, optimisation 12).
"""

from __future__ import annotations

import gc

#: the youngest generation's threshold in a server process (CPython's default is 700)
YOUNG_THRESHOLD = 10_000


def tune_collector() -> tuple[int, int, int]:
    """Raise the young generation's threshold to YOUNG_THRESHOLD, leaving the older ones as
    they are; returns the thresholds now in force. Call once, early, in a server process."""
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_threshold()


def collections() -> int:
    """Cyclic-GC collections this process has run so far, all generations."""
    return sum(generation["collections"] for generation in gc.get_stats())
