"""The per-host gauges of /metrics follow the hosts of the latest scrape: a host retired by a
scale-down (or otherwise gone from the stats) stops being reported instead of keeping its last
values for ever."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics

PER_HOST = ("ce_live_sessions", "ce_flush_last_ms", "ce_flushes", "ce_flushed_sessions", "ce_host_turns",
            "ce_host_lane_turns", "ce_host_stored_turn_reads", "ce_host_unwritten_turns",
            "ce_host_unwritten_turns_cap", "ce_host_gc_pause_seconds_total", "ce_host_gc_pause_longest_seconds",
            "ce_host_share_waiting", "ce_host_share_overruns_total", "ce_host_up")


def _stats(host: str, live: int) -> dict:
    return {"host": host, "live_sessions": live, "last_flush_ms": 1.5, "flushes": 10, "flushed_sessions": 20,
            "turn_calls": 30, "lane_calls": 25, "stored_turn_reads": 2, "unwritten_turns": 3,
            "unwritten_turns_cap": 512, "gc_pause_s_total": 1.25, "gc_pause_longest_s": 0.04,
            "share_waiting": 4, "share_overruns": 2}


def _hosts(metrics: GatewayMetrics) -> dict[str, set[str]]:
    """metric name -> the hosts it has a sample for, as /metrics renders it."""
    seen: dict[str, set[str]] = {name: set() for name in PER_HOST}
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name in seen:
            seen[family.name] |= {s.labels["host"] for s in family.samples}
    return seen


def test_a_host_missing_from_the_next_scrape_is_no_longer_reported():
    metrics = GatewayMetrics()
    metrics.observe_hosts([_stats("ce-host-0", 5), _stats("ce-host-1", 6), _stats("ce-host-2", 7)])
    assert _hosts(metrics) == {name: {"ce-host-0", "ce-host-1", "ce-host-2"} for name in PER_HOST}

    metrics.observe_hosts([_stats("ce-host-0", 8), _stats("ce-host-1", 9)])  # after `chat-engine scale 2`

    assert _hosts(metrics) == {name: {"ce-host-0", "ce-host-1"} for name in PER_HOST}
    text = metrics.render().decode()
    assert 'ce_live_sessions{host="ce-host-0"} 8.0' in text  # the hosts that remain: this scrape's values
    assert 'ce-host-2' not in text


def test_a_host_that_comes_back_is_reported_again_from_its_new_stats():
    metrics = GatewayMetrics()
    metrics.observe_hosts([_stats("ce-host-0", 5), _stats("ce-host-1", 6)])
    metrics.observe_hosts([_stats("ce-host-0", 5)])
    metrics.observe_hosts([_stats("ce-host-0", 5), _stats("ce-host-1", 1)])  # scaled up again
    assert _hosts(metrics)["ce_live_sessions"] == {"ce-host-0", "ce-host-1"}
    assert 'ce_live_sessions{host="ce-host-1"} 1.0' in metrics.render().decode()


def test_a_host_that_misses_one_scrape_keeps_its_series_and_is_reported_down():
    # a slow or hung host is still expected (the shard count says it exists): before, its series
    # vanished for a scrape and came back, a counter reset to every rate() over them
    metrics = GatewayMetrics()
    hosts = ["ce-host-0", "ce-host-1"]
    metrics.observe_hosts([_stats("ce-host-0", 5), _stats("ce-host-1", 6)], expected=hosts)
    metrics.observe_hosts([_stats("ce-host-0", 7)], expected=hosts)  # ce-host-1 did not answer in time

    assert _hosts(metrics) == {name: {"ce-host-0", "ce-host-1"} for name in PER_HOST}
    text = metrics.render().decode()
    assert 'ce_host_up{host="ce-host-1"} 0.0' in text and 'ce_host_up{host="ce-host-0"} 1.0' in text
    assert 'ce_live_sessions{host="ce-host-1"} 6.0' in text  # its last values
    metrics.observe_hosts([_stats("ce-host-0", 7), _stats("ce-host-1", 8)], expected=hosts)
    assert 'ce_host_up{host="ce-host-1"} 1.0' in metrics.render().decode()
    metrics.observe_hosts([_stats("ce-host-0", 7)], expected=["ce-host-0"])  # then retired by a scale-down
    assert "ce-host-1" not in metrics.render().decode()


def test_an_expected_host_never_seen_is_reported_down():
    # a gateway (re)started while ce-host-1 is hung: the shard count expects it, it never answered
    metrics = GatewayMetrics()
    metrics.observe_hosts([_stats("ce-host-0", 1)], expected=["ce-host-0", "ce-host-1"])
    text = metrics.render().decode()
    assert 'ce_host_up{host="ce-host-1"} 0.0' in text and 'ce_host_up{host="ce-host-0"} 1.0' in text
    assert 'ce_live_sessions{host="ce-host-1"}' not in text  # no values to keep: none are made up
    metrics.observe_hosts([_stats("ce-host-0", 1), _stats("ce-host-1", 4)], expected=["ce-host-0", "ce-host-1"])
    assert 'ce_live_sessions{host="ce-host-1"} 4.0' in metrics.render().decode()


def test_a_hosts_unwritten_turns_and_their_cap_are_gauges_an_alert_can_compare():
    # Postgres away: turns pile up unwritten; at the cap the host refuses new ones (503
    # storage_unavailable). An operator alerts before that, on the ratio of the two.
    metrics = GatewayMetrics()
    metrics.observe_hosts([{**_stats("ce-host-0", 5), "unwritten_turns": 400}])
    text = metrics.render().decode()
    assert 'ce_host_unwritten_turns{host="ce-host-0"} 400.0' in text
    assert 'ce_host_unwritten_turns_cap{host="ce-host-0"} 512.0' in text


def test_a_host_that_does_not_count_unwritten_turns_gets_no_sample_rather_than_a_false_zero():
    # an older host during a rolling upgrade: its stats say neither figure
    metrics = GatewayMetrics()
    old = {k: v for k, v in _stats("ce-host-0", 5).items() if not k.startswith(("unwritten", "gc_pause", "share"))}
    metrics.observe_hosts([old, _stats("ce-host-1", 6)])
    seen = _hosts(metrics)
    assert seen["ce_host_unwritten_turns"] == {"ce-host-1"} and seen["ce_host_unwritten_turns_cap"] == {"ce-host-1"}
    assert seen["ce_live_sessions"] == {"ce-host-0", "ce-host-1"}


@pytest.mark.parametrize("samples", [
    # the collector's pauses
    ('ce_host_gc_pause_seconds_total{host="ce-host-0"} 1.25', 'ce_host_gc_pause_longest_seconds{host="ce-host-0"} 0.04'),
    # the fair share's waits and overruns
    ('ce_host_share_waiting{host="ce-host-0"} 4.0', 'ce_host_share_overruns_total{host="ce-host-0"} 2.0'),
])
def test_a_hosts_stats_are_gauges(samples):
    metrics = GatewayMetrics()
    metrics.observe_hosts([_stats("ce-host-0", 5)])
    text = metrics.render().decode()
    for sample in samples:
        assert sample in text
