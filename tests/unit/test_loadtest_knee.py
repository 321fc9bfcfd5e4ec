"""The load test's knee: the first stage whose p95 grew faster than its throughput."""

from __future__ import annotations

from bench.loadtest import find_knee


def stage(users: int, ok_rps: float, p95_ms: float) -> dict:
    return {"users": users, "ok_rps": ok_rps, "p95_ms": p95_ms}


def test_the_knee_is_the_first_stage_whose_latency_outgrew_its_throughput():
    stages = [stage(25, 27.0, 31), stage(50, 53.0, 51), stage(100, 104.0, 90), stage(150, 150.0, 300),
              stage(200, 155.0, 900)]
    knee = find_knee(stages)
    assert knee is not None and knee["users"] == 150 and knee["previous_users"] == 100
    assert knee["sustained_rps"] == 104.0 and knee["p95_ms_before"] == 90
    assert knee["p95_growth"] > knee["throughput_growth"]


def test_no_knee_while_throughput_keeps_pace_with_latency():
    assert find_knee([stage(10, 10.0, 20), stage(20, 20.0, 30), stage(40, 40.0, 50)]) is None
    assert find_knee([stage(10, 10.0, 20)]) is None and find_knee([]) is None


def test_a_stage_that_answered_nothing_is_not_a_baseline():
    # nothing answered (every request shed): growth over it means nothing
    assert find_knee([stage(10, 0.0, 0.0), stage(20, 20.0, 500)]) is None
    knee = find_knee([stage(10, 0.0, 0.0), stage(20, 20.0, 30), stage(40, 22.0, 300)])
    assert knee is not None and knee["users"] == 40
