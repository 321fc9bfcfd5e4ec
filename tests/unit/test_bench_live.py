"""The live-session benchmark's pure parts (bench/live.py, bench/stats.py): a session's event stream
parsed however the network splits it, a push run's figures, the memory per idle watcher, the flags."""

from __future__ import annotations

import msgspec
import pytest

from bench.live import SseFrame, SseParser, per_watcher_kb, push_summary
from bench.measure import parse_args
from bench.stats import percentile

#: what the gateway sends a watcher: the retry line, a batch of two events, a comment while idle
STREAM = (b"retry: 1000\n\n"
          b'id: 1\nevent: message\ndata: {"seq":1,"type":"message","author":"contact","text":"/handoff"}\n\n'
          b'id: 2\nevent: handoff\ndata: {"seq":2,"type":"handoff","state":"requested"}\n\n'
          b": waiting\n\n"
          b'id: 3\nevent: message\ndata: {"seq":3,"type":"message","author":"agent","message_id":"m-3"}\n\n')


def test_a_stream_read_in_one_piece_gives_each_event_with_its_number_type_and_data():
    parser = SseParser()
    frames = parser.feed(STREAM)
    assert [(f.id, f.event) for f in frames] == [(1, "message"), (2, "handoff"), (3, "message")]
    assert msgspec.json.decode(frames[2].data) == {"seq": 3, "type": "message", "author": "agent", "message_id": "m-3"}
    assert parser.retry_ms == 1000 and parser.comments == 1


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_a_stream_split_anywhere_gives_the_same_events_each_once_its_last_byte_is_in(size):
    parser = SseParser()
    frames: list[SseFrame] = []
    for at in range(0, len(STREAM), size):
        frames += parser.feed(STREAM[at:at + size])
    assert frames == SseParser().feed(STREAM)
    assert parser.retry_ms == 1000 and parser.comments == 1


def test_a_frame_is_given_only_once_its_blank_line_has_come():
    parser = SseParser()
    assert parser.feed(b'id: 7\nevent: message\ndata: {"a":1}\n') == []
    assert parser.feed(b"\n") == [SseFrame(id=7, event="message", data=b'{"a":1}')]


def test_the_retry_line_alone_dispatches_no_event_and_is_kept():
    parser = SseParser()
    assert parser.feed(b"retry: 1000\n\n") == [] and parser.retry_ms == 1000


def test_crlf_lines_several_data_lines_and_a_frame_without_id_or_event_read_as_the_spec_says():
    frames = SseParser().feed(b"data: one\r\ndata:two\r\n\r\nid: x\ndata: three\n\n")
    assert frames == [SseFrame(id=None, event="message", data=b"one\ntwo"),
                      SseFrame(id=None, event="message", data=b"three")]


def test_a_push_run_sums_up_its_latencies_and_counts_every_kind_of_error():
    latencies = [float(ms) for ms in range(1, 101)]  # 1..100 ms
    out = push_summary(latencies, pushes=104, post_errors=1, missing=2, duplicates=1, wrong_stream=0,
                       streams_lost=0, elapsed_s=2.0)
    assert (out["p50_ms"], out["p95_ms"], out["p99_ms"], out["max_ms"]) == (51.0, 96.0, 100.0, 100.0)
    assert out["arrived"] == 100 and out["errors"] == 4 and out["pushes_per_s"] == 52.0


def test_a_push_run_where_nothing_arrived_reports_zeros_not_a_failure():
    out = push_summary([], pushes=0, post_errors=0, missing=0, duplicates=0, wrong_stream=0, streams_lost=2,
                       elapsed_s=0.0)
    assert out["p99_ms"] == 0.0 and out["pushes_per_s"] == 0.0 and out["errors"] == 2


def test_memory_per_watcher_is_what_they_added_over_how_many_there_were():
    assert per_watcher_kb(400.0, 600.0, 10_000) == pytest.approx(20.48)  # 200 MB over 10,000
    assert per_watcher_kb(400.0, 399.0, 1024) == -1.0  # a process gave memory back: said as it is
    assert per_watcher_kb(400.0, 600.0, 0) is None


def test_the_percentile_is_the_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, p) for p in (0, 50, 99, 100)] == [1.0, 3.0, 5.0, 5.0]
    assert percentile([], 99) == 0.0


def test_the_live_runs_default_to_the_targets_scale_and_can_be_skipped():
    args = parse_args([])
    assert (args.push, args.push_sessions, args.push_rate, args.idle_watchers) == (True, 1000, 100.0, 10_000)
    args = parse_args(["--no-push", "--idle-watchers", "0"])
    assert not args.push and args.idle_watchers == 0


@pytest.mark.parametrize("flags", [["--push-rate", "0"], ["--push-sessions", "0"], ["--idle-watchers", "-1"]])
def test_a_live_count_below_what_runs_is_refused_by_name(flags, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert flags[0] in capsys.readouterr().err
