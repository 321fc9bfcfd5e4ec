"""What a benchmark run reports: `make bench`'s JSON document, its printed table, and the runs kept
as data.

`report` builds the document (.data/bench.json, the shape the HTTP API's contract promises) from
what bench/measure.py measured; `print_table` prints it. Every run is also kept under
bench/results/ as `<UTC time>.json`, and docs/benchmarks.md is generated from every JSON there
(`results_table`: documents in, markdown out). `python -m bench.report` regenerates that page
without running the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: where `make bench` keeps its runs, and the page generated from them (both in the repository)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
TABLE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
#: how a run's file is named: its UTC time, sortable, no colon
STAMP_FORMAT = "%Y-%m-%dT%H%M%SZ"

CONTRACT_KEYS = ("msgs_per_s", "p50_ms", "p95_ms", "p99_ms", "cpu_s_per_msg", "peak_rss_mb")


def machine() -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return (f"{platform.node()}: {os.cpu_count()} cpu ({platform.processor() or platform.machine()}), "
            f"{mem:.0f} GiB, {platform.system()} {platform.release()}, Python {platform.python_version()}")


def report(result: dict[str, Any], args: argparse.Namespace, growth: dict[str, Any] | None,
           live: dict[str, Any] | None = None) -> dict[str, Any]:
    on = result["gate_on"]
    doc: dict[str, Any] = {
        "ways": {w: {k: round(v[k], 6) for k in CONTRACT_KEYS} for w, v in on["ways"].items()},
        "ratio_sharded": on["ratio_sharded"], "ratio_dedicated": on["ratio_dedicated"],
        "gate": True, "machine": machine(),
    }
    if result["gate_off"]:
        off = result["gate_off"]
        doc["gate_off"] = {
            "ways": {w: {k: round(v[k], 6) for k in CONTRACT_KEYS} for w, v in off["ways"].items()},
            "ratio_sharded": off["ratio_sharded"], "ratio_dedicated": off["ratio_dedicated"], "gate": False,
            "machine": doc["machine"],
        }
    doc["paired_ratios"] = {"gate_on": on["paired_ratios"],
                            "gate_off": result["gate_off"]["paired_ratios"] if result["gate_off"] else None}
    doc["half_load"] = result["half_load"]
    doc["peak"] = result["peak"]
    doc["detail"] = {
        "command": "python -m bench.measure " + " ".join(sys.argv[1:]),
        # where the run is kept is not part of what was measured
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "results_dir", "table")},
        "gate_on": on["ways"], "gate_off": result["gate_off"]["ways"] if result["gate_off"] else None,
        "runs": result["runs"],
        "notes": "medians over --repeat rounds; cpu = engine processes + Postgres (helpers apart); "
                 "rss = way's processes (a: the worker; b/c: gateway process, Ray daemons, its session actors)",
    }
    if growth is not None:
        doc["growth"] = growth
    if live is not None:
        doc["live"] = live
    return doc


def tail_text(t: dict[str, Any]) -> str:
    share = "" if t.get("host_share") is None else f", host {t['host_share'] * 100:.0f}% of it"
    ms = {k: ms_text(t[k], signed=False) for k in ("latency_ms", "host_ms", "gate_ms", "hop_ms")}
    return (f"{t['turns']:.0f} turns in {t['bursts']:.0f} bursts, p50 {ms['latency_ms']} "
            f"(host {ms['host_ms']}, gate {ms['gate_ms']}, hop {ms['hop_ms']}{share})")


def each_way_text(values: dict[str, float], fmt: str) -> str:
    return ", ".join(f"{w.replace('_ray', '/ray')} {fmt.format(v)}" for w, v in values.items())


def by_process_text(used: dict[str, float]) -> str:
    return ", ".join(f"{label} {ms:.2f}" for label, ms in used.items())


def ms_text(value: float | None, *, signed: bool = True) -> str:
    """A difference in ms (a duration with `signed` False), or "-" where no slice gave one."""
    if value is None:
        return "-"
    return f"{value:+.1f} ms" if signed else f"{value:.1f} ms"


def print_table(doc: dict[str, Any]) -> None:
    def block(title: str, part: dict[str, Any]) -> None:
        print(f"\n{title}")
        print(f"  {'way':<10} {'msgs/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'cpu ms/msg':>11} "
              f"{'peak RSS MB':>12} {'ratio':>6}")
        base = part["ways"].get("inprocess", {}).get("msgs_per_s") or 0
        for w, v in part["ways"].items():
            ratio = v["msgs_per_s"] / base if base else float("nan")
            print(f"  {w:<10} {v['msgs_per_s']:>8.1f} {v['p50_ms']:>8.1f} {v['p95_ms']:>8.1f} {v['p99_ms']:>8.1f} "
                  f"{v['cpu_s_per_msg'] * 1000:>11.2f} {v['peak_rss_mb']:>12.0f} {ratio:>6.2f}")

    block("gate on (one tool round per message)", doc)
    if "gate_off" in doc:
        block("gate off (lossy; benchmark only)", doc["gate_off"])
    for gate, paired in (doc.get("paired_ratios") or {}).items():
        if paired:
            print(f"{gate}: median of per-round ratios " + ", ".join(f"{w} {r:.2f}" for w, r in paired.items()))
    half = doc.get("half_load")
    if half:
        load = "--half-load-rate" if half.get("rate_given") else "half peak load"
        print(f"\n{load} ({half['rate_msgs_per_s']:.0f} msg/s, open loop, the ways in turns over {half['slices']} slices): gateway + Ray add "
              f"{half['added_p50_ms']:+.1f} ms p50, {half['added_p99_ms']:+.1f} ms p99 "
              f"(in process p50 {half['ways']['inprocess']['p50_ms']:.1f} / p99 {half['ways']['inprocess']['p99_ms']:.1f}; "
              f"sharded p50 {half['ways']['sharded']['p50_ms']:.1f} / p99 {half['ways']['sharded']['p99_ms']:.1f})")
        if half.get("paired_added_p50_ms") is not None:
            via_ray = half.get("paired_added_p50_ms_via_ray")
            print(f"  p50 added, median over {half['slices']} slices of each slice's difference: "
                  f"{half['paired_added_p50_ms']:+.1f} ms"
                  + (f" (through Ray's task path {via_ray:+.1f} ms)" if via_ray is not None else ""))
            if half.get("paired_added_p99_ms") is not None:
                print(f"  p99 added, the same way (each slice's p99 difference, median over slices): "
                      f"{half['paired_added_p99_ms']:+.1f} ms (pooled over every slice: {half['added_p99_ms']:+.1f} ms)")
            in_host = half.get("paired_host_added_p50_ms")
            if in_host is not None:
                hop = half["paired_added_p50_ms"] - in_host
                print(f"  of which the session host's own time of a turn (Server-Timing `host`, the same way paired): "
                      f"{in_host:+.1f} ms; the rest, the hop (client, gateway, lane): {hop:+.1f} ms")
                in_gateway = (half.get("gateway_own_p50_ms") or {}).get("sharded")
                if in_gateway is not None:
                    print(f"  of the hop, in the gateway (Server-Timing `gateway` less `host`, p50): {in_gateway:.1f} ms "
                          f"(its handler and the lane both ways); about {hop - in_gateway:+.1f} ms the client, "
                          "the HTTP legs and the gateway's HTTP server around its handler")
        if half.get("gate_p50_ms"):
            print("  the output gate's p50 wait, each way: " + each_way_text(half["gate_p50_ms"], "{:.1f} ms"))
        variant = half.get("variant")
        if variant:
            print(f"  (b) on hosts with {' '.join(f'{k}={v}' for k, v in variant['env'].items())}: "
                  f"{ms_text(variant['paired_added_p50_ms'])} p50 added (median over slices; the host's own "
                  f"{ms_text(variant['paired_host_added_p50_ms'])}), {ms_text(variant['added_p99_ms'])} p99 "
                  f"({ms_text(variant.get('paired_added_p99_ms'))} median over slices)")
        tails = {w: t for w, t in (half.get("tail") or {}).items() if t}
        if tails:
            print("  the slowest 1% of each way's turns (medians over rounds): "
                  + "; ".join(f"{w} {tail_text(t)}" for w, t in tails.items()))
        if half.get("busy_pct"):
            print("  the machine's CPU busy while each way ran its slices: " + each_way_text(half["busy_pct"], "{:.0f}%"))
        if half.get("gc_pause_ms"):
            print("  collector pauses per round, (a)'s process in its slices / the shard hosts over the whole run "
                  "(longest): " + ", ".join(f"{g['inprocess']:.0f} / {g['hosts']:.0f} ({g['hosts_longest']:.0f}) ms"
                                            for g in half["gc_pause_ms"]))
        for way, used in (half.get("cpu_ms_per_msg_by_process") or {}).items():
            print(f"  {way}'s CPU ms per message by process, in its slices: {by_process_text(used)}")
        if "added_p50_ms_via_ray" in half:
            print(f"  the same hosts, turns through Ray's actor task path instead of their lanes: "
                  f"{half['added_p50_ms_via_ray']:+.1f} ms p50, {half['added_p99_ms_via_ray']:+.1f} ms p99")
    det = doc["detail"]["gate_on"]
    if "sharded" in det:
        print(f"group commit at {doc['detail']['config']['concurrency']} clients (sharded, gate on): "
              f"{det['sharded']['msgs_per_flush']:.1f} messages per flush transaction "
              f"({det['sharded']['sessions_per_flush']:.1f} sessions)")
    for way, sweep in (doc.get("peak") or {}).items():
        top = sweep["peak"]
        print(f"peak load ({way}, gate on): {top['msgs_per_s']:.1f} msg/s at {top['concurrency']} clients, "
              f"{top['msgs_per_flush']:.1f} messages per flush transaction; sweep: " + ", ".join(
                  f"{p['concurrency']}: {p['msgs_per_s']:.0f}/s {p['msgs_per_flush']:.1f}/flush"
                  + (f" x{p['growth']:.2f}" if p.get("growth") is not None else "") for p in sweep["points"])
              + " (xN: msgs/s over the level before, paired by rounds)")
    g = doc.get("growth")
    if g:
        print(f"\ngrowth on {g['shards']} host(s), empty host set {g['empty_host_rss_mb']:.0f} MB")
        print(f"  {'live':>7} {'msgs/s':>8} {'p99 ms':>8} {'host MB':>8} {'KB/session':>11} {'flush/s':>8} "
              f"{'msgs/flush':>10} {'errors':>7}")
        for lv in g["levels"]:
            print(f"  {lv['live_sessions']:>7} {lv['msgs_per_s']:>8.1f} {lv['p99_ms']:>8.1f} {lv['host_rss_mb']:>8.0f} "
                  f"{lv['rss_per_idle_session_kb']:>11.1f} {lv['flushes_per_s']:>8.1f} {lv['msgs_per_flush']:>10.1f} "
                  f"{lv['errors']:>7}")
        if g.get("burst"):
            b = g["burst"]
            print(f"  {b['concurrent_sessions']} concurrent sessions through the gateway: {b['messages']} messages, "
                  f"{b['errors']} errors, p99 {b['p99_ms']:.0f} ms")
        r = g["reactivation"]
        print(f"  activation of a passivated session from Postgres: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms "
              f"({r['sessions']} sessions)")
    live = doc.get("live") or {}
    if live:
        print("\nlive sessions (sharded, through the gateway; targets: " + TARGETS_TEXT + ")")
    push = live.get("push")
    if push:
        print(f"  push {push_text(push)}: p50 {push['p50_ms']:.1f} ms, p99 {push['p99_ms']:.1f} ms "
              f"({_verdict(push_met(push))}), max {push['max_ms']:.1f} ms; errors {push_errors_cell(push)}")
    idle = live.get("idle")
    if idle:
        print(f"  idle watchers: {idle_connected_cell(idle)}; KB per watcher {idle_kb_cell(idle)} "
              f"(of it gateway / hosts {idle_split_cell(idle)})")


#: what live sessions should do (docs/performance.md § Live sessions), shown beside the figures
PUSH_P99_TARGET_MS = 25.0
IDLE_KB_TARGET = 20.0
IDLE_WATCHERS_TARGET = 10_000
TARGETS_TEXT = (f"push p99 ≤ {PUSH_P99_TARGET_MS:.0f} ms without error, ≤ {IDLE_KB_TARGET:.0f} KB per idle watcher, "
                f"{IDLE_WATCHERS_TARGET:,} idle watchers without error")


def _verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def push_text(push: dict[str, Any]) -> str:
    """What a push run did: `1,000 sessions, 100/s for 30 s`."""
    return f"{push['watchers']:,} sessions, {push['rate']:g}/s for {push['seconds']:g} s"


def push_met(push: dict[str, Any]) -> bool:
    """The push p99 is met only at or under its target with no push gone wrong (a missing event
    would be slower than any that came)."""
    return push["p99_ms"] <= PUSH_P99_TARGET_MS and push["errors"] == 0 and push["arrived"] > 0


def push_p99_cell(push: dict[str, Any]) -> str:
    return f"{push['p99_ms']:.1f}, {_verdict(push_met(push))}"


def push_errors_cell(push: dict[str, Any]) -> str:
    parts = [f"{push[k]} {label}" for k, label in (
        ("post_errors", "refused"), ("missing", "missing"), ("duplicates", "twice"), ("wrong_stream", "on another stream"),
        ("streams_lost", "streams lost")) if push.get(k)]
    return f"{push['errors']} of {push['pushes']:,}" + (f" ({', '.join(parts)})" if parts else "")


def idle_connected_cell(idle: dict[str, Any]) -> str:
    """Idle watchers connected against the target: met only with as many as the target tried,
    every one connected, none lost while idle."""
    text = f"{idle['connected']:,} of {idle['watchers']:,}, {idle['errors']} errors"
    if idle["watchers"] < IDLE_WATCHERS_TARGET:
        return f"{text}, target not tried"
    return f"{text}, {_verdict(idle['errors'] == 0 and idle['connected'] >= IDLE_WATCHERS_TARGET)}"


def idle_kb_cell(idle: dict[str, Any]) -> str:
    kb = idle.get("kb_per_watcher")
    return "–" if kb is None else f"{kb:.1f}, {_verdict(kb <= IDLE_KB_TARGET)}"


def idle_split_cell(idle: dict[str, Any]) -> str:
    return f"{_figure(idle.get('gateway_kb_per_watcher'), '.1f')} / {_figure(idle.get('hosts_kb_per_watcher'), '.1f')}"


def record_run(doc: dict[str, Any], results_dir: Path, table: Path, *, now: datetime | None = None) -> Path:
    """Keep `doc` as `<results_dir>/<UTC time>.json` and regenerate `table` from every run there.

    Returns the run's file."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{(now or datetime.now(UTC)).strftime(STAMP_FORMAT)}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    write_table(results_dir, table)
    return path


def load_runs(results_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every run under `results_dir` as (file name without .json, document), oldest first; a file
    that is not a JSON object is left out."""
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            runs.append((path.stem, doc))
    return runs


def write_table(results_dir: Path, table: Path) -> None:
    """Write the markdown page of every run under `results_dir` to `table`."""
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(results_table(load_runs(results_dir), source=_shown(results_dir)))


def _shown(path: Path) -> str:
    """`path` relative to the repository when it is inside it (bench/results), else as given."""
    try:
        return str(path.resolve().relative_to(RESULTS_DIR.parent.parent))
    except ValueError:
        return str(path)


def _figure(value: Any, fmt: str) -> str:
    return "–" if not isinstance(value, int | float) else format(value, fmt)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_table(runs: Sequence[tuple[str, dict[str, Any]]], *, source: str = "bench/results") -> str:
    """The markdown page of benchmark runs: one row per (label, bench.json document), in the
    order given. A figure a run did not measure is shown as "–". Pure: no file is read."""
    lines = [
        (f"<!-- generated by `make bench` (bench/report.py) from {source}/*.json; "
         "regenerate with `python -m bench.report`; do not edit -->"),
        "# Benchmark runs",
        "",
        (f"Generated by `make bench` from every run kept in `{source}/` (one JSON per run, the "
         "shape of `.data/bench.json`), oldest first. Gate on, one tool round per message, medians "
         "over the run's rounds: (a) in process, (b) sharded session hosts behind the gateway, "
         "(c) one actor per session. Peak: the highest load of the sweep; added p50: what the gateway "
         "and Ray add to (a) at half that load."),
        "",
    ]
    if not runs:
        return "\n".join([*lines, "No run recorded yet: `make bench` adds one.", ""])
    lines += [
        ("| run (UTC) | msgs/s (a) | msgs/s (b) | msgs/s (c) | (b)/(a) | (c)/(a) | p99 ms (b) "
         "| cpu ms/msg (b) | peak msgs/s (a) / (b) | added p50 ms | machine | command |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for label, doc in runs:
        ways = doc.get("ways") or {}
        a, b, c = (ways.get(w) or {} for w in ("inprocess", "sharded", "dedicated"))
        peak = doc.get("peak") or {}
        peaks = [((peak.get(w) or {}).get("peak") or {}).get("msgs_per_s") for w in ("inprocess", "sharded")]
        half = doc.get("half_load") or {}
        added = half.get("paired_added_p50_ms", half.get("added_p50_ms"))
        cpu = b.get("cpu_s_per_msg")
        machine_text = str(doc.get("machine") or "–").partition(": ")[2] or str(doc.get("machine") or "–")
        command = (doc.get("detail") or {}).get("command")
        row = [
            label,
            _figure(a.get("msgs_per_s"), ".1f"), _figure(b.get("msgs_per_s"), ".1f"),
            _figure(c.get("msgs_per_s"), ".1f"),
            _figure(doc.get("ratio_sharded"), ".2f"), _figure(doc.get("ratio_dedicated"), ".2f"),
            _figure(b.get("p99_ms"), ".1f"),
            _figure(cpu * 1000 if isinstance(cpu, int | float) else None, ".2f"),
            " / ".join(_figure(p, ".0f") for p in peaks) if any(p is not None for p in peaks) else "–",
            _figure(added, "+.1f"),
            _cell(machine_text),
            f"`{_cell(command)}`" if command else "–",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join([*lines, *live_table(runs), ""])


def live_table(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The page's live-session section: one row per run that measured push latency or idle
    watchers, the targets beside the figures; nothing when no run did."""
    measured = [(label, doc["live"]) for label, doc in runs if doc.get("live")]
    if not measured:
        return []
    lines = [
        "",
        "## Live sessions",
        "",
        ("Sharded session hosts behind the gateway, measured from a client process (bench/live.py). Push: "
         "agent messages (`POST .../agent-messages`) sent open loop to handed-off sessions, each watched "
         "by one SSE stream; latency from the POST's start to the client's parse of the frame carrying its "
         "`message_id`. Idle: SSE watchers of quiet sessions held on one gateway; the resident memory they "
         "added to the gateway and the session hosts, per connected watcher. Targets: "
         f"{TARGETS_TEXT}. Method: [performance.md](performance.md#live-sessions)."),
        "",
        (f"| run (UTC) | push | push p50 ms | push p99 ms (≤ {PUSH_P99_TARGET_MS:.0f}) | push errors "
         f"| idle watchers ({IDLE_WATCHERS_TARGET:,}, no error) | KB per idle watcher (≤ {IDLE_KB_TARGET:.0f}) "
         "| of it gateway / hosts KB |"),
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for label, live in measured:
        push, idle = live.get("push"), live.get("idle")
        row = [label]
        row += ([push_text(push), _figure(push["p50_ms"], ".1f"), push_p99_cell(push), push_errors_cell(push)]
                if push else ["–"] * 4)
        row += [idle_connected_cell(idle), idle_kb_cell(idle), idle_split_cell(idle)] if idle else ["–"] * 3
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.report`: regenerate the page from the runs kept, without running anything."""
    p = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="the runs, one JSON each")
    p.add_argument("--table", default=str(TABLE), help="the markdown page to write")
    args = p.parse_args(argv)
    write_table(Path(args.results_dir), Path(args.table))
    print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
