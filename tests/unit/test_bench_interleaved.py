"""The benchmark's arithmetic (bench/measure.py): ways in turns, pooled and paired figures, the peak."""

from __future__ import annotations

import math

import pytest

import bench.measure as bench
from bench.measure import (
    CpuShare,
    ProcessCpu,
    default_shards,
    interleaved_summary,
    open_loop,
    paired_growth,
    parse_args,
    peak_index,
    percentile,
    process_label,
    server_timing,
    slice_order,
    slice_sizes,
)


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


def test_the_paired_p99_moves_with_a_stall_in_one_slice_only():
    # 100 turns a slice; b's tail is 3 ms behind a's in every slice, but a stall of 300 ms hits
    # b's share of one slice: the pooled p99 is that stall, the paired one the 3 ms.
    def turns(base: float, tail: float) -> list[float]:
        return [base] * 98 + [tail, tail]

    slices = [{"a": (turns(5.0, 20.0), 0, 1.0), "b": (turns(7.0, 23.0), 0, 1.0)} for _ in range(4)]
    slices[1]["b"] = (turns(7.0, 23.0)[:90] + [300.0] * 10, 0, 1.0)
    out = interleaved_summary(slices, base="a")
    assert out["paired_added_p99_ms"] == {"b": pytest.approx(3.0)}
    assert out["ways"]["b"]["p99_ms"] - out["ways"]["a"]["p99_ms"] > 250


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
    assert interleaved_summary([], base="a") == {"ways": {}, "paired_added_p50_ms": {}, "paired_added_p99_ms": {}}


def test_the_latency_runs_take_a_given_rate_or_half_the_peak():
    assert parse_args([]).half_load_rate is None  # half the measured peak
    assert parse_args(["--half-load-rate", "20"]).half_load_rate == 20.0
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            parse_args(["--half-load-rate", bad])


def test_server_timing_reads_each_metrics_duration():
    assert server_timing("gateway;dur=14.02, host;dur=12.5, gate;dur=3") == {
        "gateway": 14.02, "host": 12.5, "gate": 3.0}
    assert server_timing('host;desc="session host";dur=7.25') == {"host": 7.25}
    # no duration, an unreadable one, an empty header: left out
    assert server_timing("cache, host;dur=abc, ;dur=4, gate;dur=1") == {"gate": 1.0}
    assert server_timing("") == {}


async def test_the_open_loop_keeps_the_hosts_times_of_each_answered_turn():
    # host times, a failure, a reply without them, ...
    answers = iter([(12.5, 2.0), None, (math.nan, math.nan), (7.0, 0.5)])

    async def send(sid: str, text: str) -> tuple[float, float] | None:
        return next(answers)

    times: list[tuple[float, float]] = []
    latencies, errors, _ = await open_loop(send, ["s1"], rate=1000.0, total=4, text=lambda: "hi", times=times)
    assert (len(latencies), errors) == (3, 1)
    assert times == [(12.5, 2.0), (7.0, 0.5)]


def test_a_half_load_variant_is_an_engine_setting():
    assert parse_args([]).half_load_variant == {}
    given = parse_args(["--half-load-variant", "CE_FLUSH_INTERVAL_MS=0", "--half-load-variant", "CE_X=a=b"])
    assert given.half_load_variant == {"CE_FLUSH_INTERVAL_MS": "0", "CE_X": "a=b"}
    for bad in ("CE_FLUSH_INTERVAL_MS", "PATH=/tmp", "=1"):
        with pytest.raises(SystemExit):
            parse_args(["--half-load-variant", bad])


def test_cpu_share_adds_up_only_the_measured_intervals(monkeypatch):
    readings = iter([(10.0, 0.0, 100.0), (13.0, 1.0, 104.0),  # busy 3 of 4 s, 1 s stolen
                     (50.0, 5.0, 500.0), (51.0, 5.0, 504.0)])  # (the time between is not counted)
    monkeypatch.setattr(bench.CpuShare, "_read", staticmethod(lambda: next(readings)))
    share = CpuShare()
    assert share.percent() == (0.0, 0.0)
    for _ in range(2):
        share.start()
        share.stop()
    assert share.percent() == (50.0, 12.5)
    share.stop()  # a stop without a start measures nothing
    assert share.percent() == (50.0, 12.5)


def test_process_cpu_sums_each_label_over_the_measured_intervals_only(monkeypatch):
    readings = iter([
        {1: 1.0, 2: 5.0, 3: 0.5},            # start: the gateway, a host, a backend
        {1: 1.5, 2: 6.0, 3: 0.75, 4: 0.2},   # stop: 4 started inside the interval
        {1: 9.0, 2: 9.0, 4: 1.0},            # start again (the time between is not counted; 3 ended)
        {1: 9.25, 2: 9.5, 4: 1.1, 5: 0.3},
    ])
    monkeypatch.setattr(bench.ProcessCpu, "_read", staticmethod(lambda: next(readings)))
    names = {2: "ray::SessionHostActor", 3: "postgres: postgres postgres [local] idle", 4: "raylet", 5: "raylet"}
    monkeypatch.setattr(bench, "_process_name", lambda pid: names[pid])
    used = ProcessCpu({1: "gateway (bench)"})
    for _ in range(2):
        used.start()
        used.stop()
    # the gateway 0.5 + 0.25, the host 1.0 + 0.5, Postgres 0.25; a process first seen at a stop
    # counts nothing for that interval (4 and 5), and from its first read on after (4: 0.1)
    assert used.seconds == pytest.approx({"gateway (bench)": 0.75, "ray::SessionHostActor": 1.5, "postgres": 0.25, "raylet": 0.1})
    assert used.ms_per_message(100, top=2) == {"ray::SessionHostActor": 15.0, "gateway (bench)": 7.5, "other": 3.5}


def test_the_hosts_collector_pauses_between_two_reads():
    before = {"h0": (1.0, 0.002), "h1": (2.0, 0.004)}
    after = {"h0": (1.25, 0.003), "h1": (0.5, 0.001), "h2": (0.125, 0.03)}  # h1 restarted, h2 new
    assert bench.host_gc_pause_delta(before, after) == {"total_ms": 875.0, "longest_ms": 30.0}
    assert bench.host_gc_pause_delta({}, {}) == {"total_ms": 0.0, "longest_ms": 0.0}


def test_cpu_by_process_over_rounds_takes_each_labels_median_largest_first():
    rows = [{"gateway": 0.3, "host": 1.0}, {"gateway": 0.5, "host": 1.2, "raylet": 0.1}, {"host": 0.8, "gateway": 0.4}]
    assert bench._median_by_label(rows) == {"host": 1.0, "gateway": 0.4, "raylet": 0.0}
    assert list(bench._median_by_label(rows)) == ["host", "gateway", "raylet"]


def test_a_levels_growth_pairs_it_with_the_level_before_round_by_round():
    # The machine is twice as slow in the second round: each round, 64 clients do 10% more than 32.
    # Medians of each level's runs would compare 32's fast round with 64's slow one, and so on.
    assert paired_growth([(500.0, 550.0), (250.0, 275.0), (400.0, 440.0)]) == pytest.approx(1.1)
    assert paired_growth([(0.0, 10.0), (100.0, 90.0)]) == pytest.approx(0.9), "a round with nothing done before is left out"
    assert paired_growth([]) is None


def test_the_peak_is_the_last_level_that_beat_the_one_before_it():
    assert peak_index([None]) == 0
    assert peak_index([None, 1.3, 1.2, 0.9]) == 2  # the fourth level did less than the third
    assert peak_index([None, 1.3, 1.02]) == 2  # a little more (the sweep stops there, at its peak)
    assert peak_index([None, 0.95, 1.4]) == 0  # a climb ends at the first level that does not beat the one before
    assert peak_index([None, None]) == 0


def test_a_variant_changes_only_the_settings_its_variables_name():
    import msgspec

    from bench.measure import Bench
    from services.settings import Settings

    bench = Bench(parse_args(["--half-load-variant", "CE_FLUSH_INTERVAL_MS=0"]))
    bench.env = {"CE_SHARDS": "2", "CE_FLUSH_INTERVAL_MS": "5"}
    running = msgspec.structs.replace(Settings.from_env(bench.env), anthropic_base_url="http://127.0.0.1:9")
    variant = bench.variant_settings(running)
    assert variant.flush_interval_ms == 0 and running.flush_interval_ms == 5
    # everything else as the running stack has it, including what it set after reading the environment
    assert msgspec.structs.replace(variant, flush_interval_ms=5.0) == running


def test_sessions_per_host_counts_each_session_on_the_host_the_gateway_routes_it_to():
    from actors.sharding import rendezvous_index, session_key

    sessions = [f"b1-half-sharded-{i}" for i in range(64)]
    split = bench.sessions_per_host("t_1", sessions, 2)
    owners = [rendezvous_index(session_key("t_1", s), 2) for s in sessions]
    assert split == [owners.count(0), owners.count(1)] and sum(split) == 64
    assert bench.sessions_per_host("t_1", sessions, 1) == [64]


def test_round_medians_take_a_breakdown_part_by_part():
    # each round's run carries the CPU of Ray's own processes by name: a dict, not a figure
    rows = [{"msgs_per_s": 100.0, "cpu_ray_other_ms_per_msg_by_process": {"raylet": 0.02, "gcs_server": 0.01}},
            {"msgs_per_s": 300.0, "cpu_ray_other_ms_per_msg_by_process": {"raylet": 0.04}},
            {"msgs_per_s": 200.0, "cpu_ray_other_ms_per_msg_by_process": {"raylet": 0.03, "gcs_server": 0.03}}]
    assert bench._median_ways(rows) == {
        "msgs_per_s": 200.0, "cpu_ray_other_ms_per_msg_by_process": {"gcs_server": 0.01, "raylet": 0.03}}


def test_the_tail_split_says_where_the_slowest_turns_spent_their_time():
    # 100 turns: 98 quick ones; two slow ones whose host time grew (at 10.00 s and 10.05 s: one
    # burst) and one whose hop grew (at 30 s: a burst of its own).
    quick = [(float(i), 10.0, 8.0, 2.0, 9.0) for i in range(97)]
    slow = [(10.0, 60.0, 57.0, 30.0, 58.0), (10.05, 62.0, 58.0, 31.0, 59.0), (30.0, 50.0, 8.0, 2.0, 9.0)]
    out = bench.tail_split(quick + slow, p=97)
    assert out["turns"] == 3
    assert out["bursts"] == 2, "turns within a quarter of a second of each other are one burst"
    assert out["burst_starts_s"] == [10.0, 30.0], "from the first scheduled send"
    assert out["latency_ms"] == pytest.approx(60.0)
    assert out["host_ms"] == pytest.approx(57.0)
    assert out["gate_ms"] == pytest.approx(30.0)
    assert out["hop_ms"] == pytest.approx(4.0)  # latency less the host's (42, 3, 4): their median
    assert out["gateway_own_ms"] == pytest.approx(1.0)
    assert out["host_share"] == pytest.approx((57 + 58 + 8) / (60 + 62 + 50))


def test_the_tail_split_of_turns_without_host_times_says_only_what_it_knows():
    records = [(float(i), float(i), math.nan, math.nan, math.nan) for i in range(1, 101)]
    out = bench.tail_split(records, p=98)
    assert out["turns"] == 2 and out["latency_ms"] == pytest.approx(99.5)
    assert out["host_ms"] is None and out["hop_ms"] is None and out["host_share"] is None
    assert bench.tail_split([], p=99) is None


def test_the_way_through_rays_task_path_can_be_left_out_of_the_latency_runs():
    assert parse_args([]).via_ray is True
    assert parse_args(["--no-via-ray"]).via_ray is False


def test_a_tail_split_over_rounds_takes_each_figures_median():
    rounds = [{"turns": 3, "bursts": 1, "burst_starts_s": [4.0], "host_ms": 9.0},
              None, {"turns": 3, "bursts": 3, "burst_starts_s": [1.0], "host_ms": None},
              {"turns": 3, "bursts": 2, "burst_starts_s": [2.0], "host_ms": 5.0}]
    assert bench._median_tail(rounds) == {"turns": 3, "bursts": 2, "host_ms": 7.0}
    assert bench._median_tail([None, None]) is None


def test_a_streamed_turns_reply_is_its_done_events_data():
    raw = (b'event: delta\ndata: {"text":"done"}\n\n'
           b'event: tool_call\ndata: {"name":"check_order"}\n\n'
           b'event: done\ndata: {"reply":"Shipped.","rounds":2}\n\n')
    assert bench.sse_done(raw) == {"reply": "Shipped.", "rounds": 2}
    assert bench.sse_done(b'event: error\ndata: {"status":503}\n\n') is None  # no reply: counted an error
    assert parse_args(["--stream"]).stream and not parse_args([]).stream


def test_way_b_runs_one_host_per_two_cpus_unless_told():
    assert [default_shards(n) for n in (1, 2, 3, 4, 8)] == [1, 1, 1, 2, 4]
    assert parse_args([]).shards == default_shards()
    assert parse_args(["--shards", "3"]).shards == 3


def test_a_process_is_labelled_by_its_command_line_and_a_kernel_thread_by_its_whole_name():
    assert process_label(["ray::SessionHostActor"], "ray::SessionHo") == "ray::SessionHostActor"
    assert process_label(["/usr/bin/python3", "-u", "/x/ray/_private/log_monitor.py", "--a"], "python3") == (
        "python3 log_monitor.py")
    assert process_label(["/v/bin/python", "-m", "services.bench", "worker"], "python") == "python services.bench"
    assert process_label(["/usr/lib/postgresql/16/bin/postgres", "-D", "/d"], "postgres") == "postgres"
    assert process_label([], "kworker/0:1") == "kworker/0:1"  # before: "0:1"
    assert process_label([], "") == "unnamed"
