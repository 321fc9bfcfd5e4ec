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

import collections as _collections
import gc
import time
from collections.abc import Callable
from typing import Any

#: the youngest generation's threshold in a server process (CPython's default is 700)
YOUNG_THRESHOLD = 10_000


def tune_collector() -> tuple[int, int, int]:
    """Raise the young generation's threshold to YOUNG_THRESHOLD, leaving the older ones as
    they are, and start measuring the collector's pauses (PAUSES); returns the thresholds now in
    force. Call once, early, in a server process."""
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    PAUSES.install()
    return gc.get_threshold()


def settle() -> None:
    """Once a server process is up: everything it imported and built so far (Ray's modules, the
    app's: a heap of a million objects or more) lives as long as it does, so it leaves the cyclic
    collector's reach (`gc.freeze`), and a full collection walks only what came after. Without it
    a gateway's full collections took 270-300 ms each, measured during a burst of a thousand
    clients (`make bench ARGS=--neighbours`), and every request on it waited them out."""
    gc.freeze()


def collections() -> int:
    """Cyclic-GC collections this process has run so far, all generations."""
    return sum(generation["collections"] for generation in gc.get_stats())


#: how far back `CollectorPauses.read` looks for the longest pause
PAUSE_WINDOW_S = 60.0
#: pauses shorter than this are only added to the total (the window keeps the ones worth seeing)
PAUSE_KEPT_S = 0.001


class CollectorPauses:
    """This process's cyclic-collector pauses, from `gc.callbacks`: their running total, and the
    longest of the last `window_s`. A collection stops the event loop for as long as it walks
    the generations it collects, a full one everything the process holds outside the frozen
    start-up heap: with many cached sessions, a stall every turn in flight pays at once
    (README § Performance). Session hosts report both in their stats (`ce_host_gc_pause_*`)."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, window_s: float = PAUSE_WINDOW_S) -> None:
        self._clock = clock
        self._window_s = window_s
        self._started = 0.0
        self.total_s = 0.0
        self._recent: _collections.deque[tuple[float, float]] = _collections.deque()  # (ended at, seconds)

    def install(self) -> None:
        if self.on_collection not in gc.callbacks:
            gc.callbacks.append(self.on_collection)

    def uninstall(self) -> None:
        while self.on_collection in gc.callbacks:
            gc.callbacks.remove(self.on_collection)

    def on_collection(self, phase: str, info: dict[str, Any]) -> None:
        """The `gc.callbacks` hook: `start` and `stop` of every collection."""
        now = self._clock()
        if phase == "start":
            self._started = now
            return
        paused = max(0.0, now - self._started)
        self.total_s += paused
        if paused >= PAUSE_KEPT_S:
            self._recent.append((now, paused))
        self._forget_older_than_window(now)  # bounded even when nobody reads

    def read(self) -> tuple[float, float]:
        """(seconds paused since installed, the longest single pause of the last window)."""
        self._forget_older_than_window(self._clock())
        return self.total_s, max((p for _, p in self._recent), default=0.0)

    def _forget_older_than_window(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()


#: this process's meter, installed by `tune_collector` (server processes)
PAUSES = CollectorPauses()
