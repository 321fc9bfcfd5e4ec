"""`make bench` and `make loadtest` run end to end, on tiny settings, each starting its own stack.

What is checked is that every part of what they report is there and the load met no error;
never a time or a ratio's value (a shared CI machine: numbers are printed, not asserted).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL", "RAY_ADDRESS"))}
    done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def test_the_benchmark_reports_every_way_the_latency_split_the_peak_the_growth_and_live_sessions(tmp_path):
    out = tmp_path / "bench.json"
    # the run is kept under a results folder of the test's own, not the repository's bench/results
    results, table = tmp_path / "results", tmp_path / "benchmarks.md"
    done = _run(["bench.measure", "--data-dir", str(tmp_path / "data"), "--output", str(out),
                 "--results-dir", str(results), "--table", str(table),
                 "--messages", "40", "--concurrency", "4", "--sessions", "8", "--dedicated-sessions", "2",
                 "--warm-rounds", "1", "--peak-concurrency", "4,8", "--half-load-seconds", "1",
                 "--half-load-slices", "2", "--growth", "--growth-levels", "5,10", "--growth-messages", "20",
                 "--growth-concurrency", "4", "--reactivate", "4", "--burst", "10",
                 "--push-sessions", "4", "--push-rate", "20", "--push-seconds", "1",
                 "--idle-watchers", "20", "--idle-settle-seconds", "1"],
                tmp_path, timeout=540)
    doc = json.loads(out.read_text())

    ways = ("inprocess", "sharded", "dedicated")
    # the shape docs/performance.md promises for `make bench`'s .data/bench.json
    assert doc["gate"] is True and doc["gate_off"]["gate"] is False
    assert isinstance(doc["machine"], str) and doc["machine"]
    for part in (doc, doc["gate_off"]):  # gate on, then the same with the gate off
        assert set(part["ways"]) == set(ways)
        for way in ways:
            figures = part["ways"][way]
            assert figures["msgs_per_s"] > 0 and figures["cpu_s_per_msg"] > 0 and figures["peak_rss_mb"] > 0
            assert figures["p50_ms"] <= figures["p95_ms"] <= figures["p99_ms"]
        assert isinstance(part["ratio_sharded"], float) and isinstance(part["ratio_dedicated"], float)
        assert part["ratio_sharded"] > 0 and part["ratio_dedicated"] > 0
    for gate in ("gate_on", "gate_off"):
        for way in ways:
            assert all(run["errors"] == 0 for run in doc["detail"]["runs"][gate][way]), doc["detail"]["runs"][gate][way]

    half = doc["half_load"]  # (a), (b) and (b) through Ray's task path, by turns, at half the lower peak
    assert half["rate_msgs_per_s"] > 0 and not half["rate_given"]
    assert set(half["ways"]) == {"inprocess", "sharded", "sharded_ray"}
    assert all(w["errors"] == 0 and w["messages"] > 0 for w in half["ways"].values()), half["ways"]
    for figure in ("paired_added_p50_ms", "paired_added_p99_ms", "paired_host_added_p50_ms", "added_p99_ms"):
        assert isinstance(half[figure], float), figure
    assert half["gateway_own_p50_ms"]["sharded"] >= 0

    for way in ("inprocess", "sharded"):
        peak = doc["peak"][way]
        assert [p["concurrency"] for p in peak["points"]][:1] == [4]
        assert peak["peak"]["msgs_per_flush"] >= 1 and peak["peak"]["errors"] == 0

    growth = doc["growth"]
    assert [level["live_sessions"] for level in growth["levels"]] == [6, 11]  # the empty host's probe, then 5 and 10
    assert all(level["errors"] == 0 and level["flushes_per_s"] > 0 for level in growth["levels"])
    assert growth["empty_host_rss_mb"] > 0
    assert growth["burst"]["concurrent_sessions"] == 10 and growth["burst"]["errors"] == 0
    assert growth["reactivation"]["sessions"] == 4 and growth["reactivation"]["errors"] == 0
    assert growth["reactivation"]["p50_ms"] > 0

    push = doc["live"]["push"]  # agent messages to watched sessions: every one read on its stream, once
    assert push["handed_off"] == push["watchers"] == 4 and push["pushes"] == push["arrived"] == 20
    assert push["errors"] == 0 and 0 < push["p50_ms"] <= push["p99_ms"], push
    idle = doc["live"]["idle"]  # idle watchers connected, held, measured, closed
    assert idle["connected"] == 20 and idle["errors"] == 0 and idle["kb_per_watcher"] is not None, idle
    assert idle["watched_after_close"] == 0

    assert "gate on (one tool round per message)" in done.stdout + done.stderr  # the printed table
    kept = list(results.glob("*.json"))  # the run kept as data, and the page made from every run kept
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == doc
    assert kept[0].stem in table.read_text()
    assert "## Live sessions" in table.read_text()


def test_the_load_test_runs_every_scenario_writes_its_csvs_and_says_where_the_knee_is(tmp_path):
    data = tmp_path / "data"
    _run(["bench.loadtest", "--data-dir", str(data), "--stages", "4:5,8:6", "--think", "0.1:0.3"],
         tmp_path, timeout=300)
    summary = json.loads((data / "loadtest" / "summary.json").read_text())
    assert [s["users"] for s in summary["stages"]] == [4, 8]  # the sessions stepped up stage by stage
    for stage in summary["stages"]:
        assert stage["requests"] > 0 and stage["failures"] == 0, stage  # every scenario's own checks passed
    assert "knee" in summary

    with open(summary["csv"], newline="") as f:
        counts = {row["Name"]: int(row["Request Count"]) for row in csv.DictReader(f)}
    for scenario in ("order lookup", "lead capture", "booking (held)", "failing tool"):
        assert counts.get(scenario, 0) > 0, counts


def test_the_noisy_neighbour_run_reports_tenant_b_alone_and_beside_tenant_a_and_what_a_got(tmp_path):
    out = tmp_path / "neighbours.json"
    done = _run(["bench.measure", "--neighbours", "--data-dir", str(tmp_path / "data"), "--output", str(out),
                 "--neighbours-rate", "5", "--neighbours-seconds", "2", "--neighbours-sessions", "4",
                 "--neighbours-burst", "50"], tmp_path, timeout=540)
    doc = json.loads(out.read_text())
    for phase in ("b_alone", "b_with_neighbours"):
        part = doc[phase]
        assert part["messages"] > 0 and part["answered"] + sum(part["errors"].values()) == part["messages"]
        assert part["p50_ms"] <= part["p99_ms"]
    assert doc["b_alone"]["errors"] == {}, doc["b_alone"]
    assert isinstance(doc["b_p99_ratio"], float) and isinstance(doc["b_errors_with_neighbours"], int)
    # every hostile load ran, and each was answered over HTTP (a refusal is an answer, a reset is not)
    assert set(doc["a"]["statuses"]) == {"giant_schemas", "wide_schemas", "heavy_outputs", "version_flood", "burst"}
    assert doc["a"]["connection_failures"] == {}, doc["a"]
    assert doc["a"]["statuses"]["burst"] and all(s.isdigit() for s in doc["a"]["statuses"]["burst"])
    assert "| with A's loads |" in done.stdout and "B's p99 with neighbours / alone" in done.stdout
