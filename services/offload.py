"""CPU-bound work that would hold an event loop, run in a worker process with a deadline.

A tenant chooses the schemas its tools and forms declare, and an upstream chooses the results
those schemas check: either can make one check cost seconds of CPU. On the gateway's loop that
is every tenant's request waiting; on a session host's, every session on it (and a host blocked
long enough is declared hung). Such work goes to one worker process per serving process (pebble's
`ProcessPool`, started on first use with `spawn`: the parent holds threads and sockets a fork
would copy), which is killed and replaced when a task passes its deadline. The worker runs at a
lower priority (nice 10) from its first instruction: its start (it imports what its parent's main
module imports, seconds of CPU in a Ray worker) and its work never take the CPU from the serving
processes beside it.

Only work that may be slow comes here: callers do what they can inline within a small budget
first (services.tools.validation), so the common case never pays the round trip (about 0.1 ms
plus pickling). At most `MAX_PENDING` tasks wait or run at once per process; past that the
caller is told to come back (`Overloaded`, 503 with `Retry-After`), not queued without bound.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import pebble
import structlog

from kernel.errors import Overloaded
from services.fairshare import waiting

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: tasks waiting for or running in this process's worker at once; one more is refused
MAX_PENDING = 32
#: the longest one task may take before its worker is killed, the worker's start (1-3 s, once
#: per process) included: a check bounded by its own budget ends well before (about 1 s); this
#: is the backstop for what no budget foresaw
DEADLINE_S = 10.0
#: how soon a refused caller is told to retry
RETRY_AFTER_S = 1.0
#: the worker's niceness (and that of the pool's threads, which start it again after a kill)
NICE = 10


class NotFinished(Exception):
    """The task ran past its deadline (its worker was killed), its worker died under it, or its
    arguments could not be sent (pickled) to it."""


_lock = threading.Lock()
_pool: pebble.ProcessPool | None = None
_pending = 0


def _worker_pool() -> pebble.ProcessPool:
    global _pool
    with _lock:
        if _pool is None or not _pool.active:
            # before multiprocessing's own exit handler, which would wait for the worker forever;
            # once, however often the pool is started again
            atexit.unregister(shutdown)
            atexit.register(shutdown)
            _pool = _started_pool()
        return _pool


def _started_pool() -> pebble.ProcessPool:
    """A pool whose worker is started by a thread of lower priority: Linux keeps a niceness per
    thread, and a thread or process started from one inherits it, so the worker (and the pool's
    own threads, which start it again after a kill) run at NICE from the start, while every other
    thread of this process keeps its own."""
    made: list[pebble.ProcessPool | BaseException] = []

    def start() -> None:
        try:
            with contextlib.suppress(OSError):  # where a thread's niceness cannot be set: the initializer's only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            pool = pebble.ProcessPool(max_workers=1, initializer=_yield_cpu,
                                      context=multiprocessing.get_context("spawn"))
            pool.schedule(_started)  # the pool starts its threads and its worker here, in this thread
            made.append(pool)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            made.append(exc)

    starter = threading.Thread(target=start, name="offload-start")
    starter.start()
    starter.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _started() -> None:
    """In the worker: nothing (its first task makes the pool start it)."""


def _unpacked(payload: bytes) -> Any:
    """In the worker: the call `run` packed."""
    fn, args = pickle.loads(payload)
    return fn(*args)


def _yield_cpu() -> None:
    """In the worker: the serving processes beside it come first for the CPU (at NICE already
    when its starter's was; set, not added, so never lower)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, max(NICE, os.getpriority(os.PRIO_PROCESS, 0)))


async def run(fn: Callable[..., T], *args: Any, deadline_s: float | None = None) -> T:
    """`fn(*args)` in the worker process (`fn` and its arguments must pickle: a module-level
    function and plain data). Raises NotFinished past `deadline_s` (DEADLINE_S) or when the
    arguments cannot be sent, Overloaded when MAX_PENDING tasks are already in hand, and
    whatever `fn` raises."""
    global _pending
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    if _pending >= MAX_PENDING:
        raise Overloaded(f"{MAX_PENDING} schema checks are already in hand here; retry shortly",
                         retry_after=RETRY_AFTER_S, reason="host_busy")
    _pending += 1
    try:
        try:  # here, not in the pool's thread: a value that cannot be sent there would never come back
            payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, RecursionError, TypeError, AttributeError) as exc:
            raise NotFinished(f"the work could not be sent to the worker ({type(exc).__name__})") from None
        if multiprocessing.current_process().daemon:
            # a daemonic process may not start one (multiprocessing's rule): the work runs on a
            # thread instead, bounded by its own budget, and the event loop still takes turns
            _say_no_worker()
            async with waiting():
                return await asyncio.to_thread(_unpacked, payload)
        # from a thread: the first task starts the worker, a fork and exec of 0.1-0.2 s
        future = await asyncio.to_thread(_worker_pool().schedule, _unpacked, args=(payload,), timeout=deadline_s)
        try:
            async with waiting():  # the worker's CPU, not the loop's: other turns compute meanwhile
                return await asyncio.wrap_future(future)
        except FutureTimeout:
            log.warning("offload_deadline", task=getattr(fn, "__name__", "?"), deadline_s=deadline_s)
            raise NotFinished(f"the work ran past its {deadline_s:g} s deadline and was stopped") from None
        except pebble.ProcessExpired as exc:
            log.warning("offload_worker_died", task=getattr(fn, "__name__", "?"), exitcode=exc.exitcode)
            raise NotFinished("the worker doing it stopped before it finished") from None
        except asyncio.CancelledError:
            future.cancel()
            raise
    finally:
        _pending -= 1


@functools.cache
def _say_no_worker() -> None:
    log.warning("offload_on_a_thread", reason="a daemonic process cannot start the worker process")


def shutdown() -> None:
    """Stop this process's worker (it is started again on the next `run`)."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.stop()
        pool.join(timeout=5)
