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
