"""services.heap: a server process's collector settings."""

from __future__ import annotations

import gc

import pytest

from services.heap import YOUNG_THRESHOLD, collections, tune_collector


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 7, 9)
    yield
    gc.set_threshold(*saved)


def test_tune_collector_raises_only_the_young_threshold(thresholds):
    assert tune_collector() == (YOUNG_THRESHOLD, 7, 9) == gc.get_threshold()
    assert YOUNG_THRESHOLD > 700


def test_collections_counts_every_generation():
    before = collections()
    gc.collect(0)
    gc.collect(2)
    assert collections() == before + 2


def test_collector_pauses_keep_a_running_total_and_the_longest_of_the_last_window():
    from services.heap import CollectorPauses

    now = [100.0]
    pauses = CollectorPauses(clock=lambda: now[0], window_s=60.0)

    def collection(seconds: float, generation: int = 0) -> None:
        pauses.on_collection("start", {"generation": generation})
        now[0] += seconds
        pauses.on_collection("stop", {"generation": generation})

    assert pauses.read() == (0.0, 0.0)
    collection(0.004)
    collection(0.120, generation=2)  # a full collection over a large heap
    collection(0.002)
    total, longest = pauses.read()
    assert total == pytest.approx(0.126) and longest == pytest.approx(0.120)
    now[0] += 61.0  # a minute later the long one has left the window; the total keeps it
    collection(0.003)
    total, longest = pauses.read()
    assert total == pytest.approx(0.129) and longest == pytest.approx(0.003)


def test_collector_pauses_measure_this_processes_real_collections():
    from services.heap import CollectorPauses

    pauses = CollectorPauses()
    pauses.install()
    try:
        junk = [[i] for i in range(50_000)]
        gc.collect()
        del junk
        total, longest = pauses.read()
        assert total > 0 and 0 < longest <= total
    finally:
        pauses.uninstall()
    assert pauses.on_collection not in gc.callbacks
