"""The half-peak run's arithmetic (services/bench.py): ways in turns, pooled and paired figures."""

from __future__ import annotations

import pytest

from services.bench import interleaved_summary, parse_args, percentile, slice_order, slice_sizes


def test_slices_take_the_ways_forward_then_backward():
    ways = ["inprocess", "sharded", "sharded_ray"]
    assert [slice_order(ways, i) for i in range(3)] == [
        ways, ["sharded_ray", "sharded", "inprocess"], ways]
    assert ways == ["inprocess", "sharded", "sharded_ray"], "the caller's list is left alone"


def test_each_way_pools_its_slices():
    slices = [
        {"inprocess": ([10.0, 11.0, 12.0], 0, 1.0), "sharded": ([13.0, 14.0, 15.0], 1, 1.5)},
        {"inprocess": ([20.0, 21.0, 22.0], 0, 1.0), "sharded": ([23.0, 24.0, 25.0], 0, 1.5)},
    ]
    out = interleaved_summary(slices, base="inprocess")
    sharded = out["ways"]["sharded"]
    assert sharded["messages"] == 6 and sharded["errors"] == 1
    assert sharded["elapsed_s"] == pytest.approx(3.0) and sharded["msgs_per_s"] == pytest.approx(2.0)
    assert sharded["p50_ms"] == percentile([13.0, 14.0, 15.0, 23.0, 24.0, 25.0], 50)
    assert out["ways"]["inprocess"]["p99_ms"] == 22.0


def test_the_paired_difference_ignores_drift_between_slices():
    # The machine is ten times slower in the second slice; each slice, b is 2 ms behind a. Pooled
    # p50s compare across slices; the paired figure compares within each slice only.
    slices = [
        {"a": ([5.0, 5.0, 5.0], 0, 1.0), "b": ([7.0, 7.0, 7.0], 0, 1.0)},
        {"a": ([50.0, 50.0, 50.0], 0, 1.0), "b": ([52.0, 52.0, 52.0], 0, 1.0)},
        {"a": ([6.0, 6.0, 6.0], 0, 1.0), "b": ([8.0, 8.0, 8.0], 0, 1.0)},
    ]
    out = interleaved_summary(slices, base="a")
    assert out["paired_added_p50_ms"] == {"b": pytest.approx(2.0)}
    assert "a" not in out["paired_added_p50_ms"]


def test_messages_are_cut_into_even_slices_with_none_lost():
    assert slice_sizes(200, 10) == [20] * 10
    assert slice_sizes(203, 10) == [21, 21, 21] + [20] * 7
    assert sum(slice_sizes(7, 10)) == 7


def test_a_slice_without_replies_is_left_out_of_the_paired_figure():
    slices = [
        {"a": ([5.0], 0, 1.0), "b": ([], 3, 1.0)},
        {"a": ([5.0], 0, 1.0), "b": ([9.0], 0, 1.0)},
    ]
    assert interleaved_summary(slices, base="a")["paired_added_p50_ms"] == {"b": pytest.approx(4.0)}
    assert interleaved_summary(slices[:1], base="a")["paired_added_p50_ms"] == {"b": None}


def test_no_slices_no_figures():
    assert interleaved_summary([], base="a") == {"ways": {}, "paired_added_p50_ms": {}}


def test_the_latency_runs_take_a_given_rate_or_half_the_peak():
    assert parse_args([]).half_load_rate is None  # half the measured peak
    assert parse_args(["--half-load-rate", "20"]).half_load_rate == 20.0
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            parse_args(["--half-load-rate", bad])
