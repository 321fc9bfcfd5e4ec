"""Prometheus metrics of the gateway (one registry per app, no globals) and host stats on scrape."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.wire import TurnReply

MAX_TOOL_LABELS = 500


class GatewayMetrics:
    def __init__(self) -> None:
        self._tool_labels: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages = Counter("ce_messages_total", "Chat messages handled", ["outcome"], registry=r)
        # kernel.errors.Overloaded's reasons: the caller's own limits (429) or the engine's
        # capacity or health (503: host_busy, restarting, host_unresponsive, storage_unavailable...)
        self.refused = Counter("ce_refused_total", "Requests answered 429/503 with Retry-After, by reason",
                               ["reason"], registry=r)
        self.rounds = Histogram("ce_turn_rounds", "Model rounds per turn", buckets=(1, 2, 3, 4, 5), registry=r)
        self.turn_latency = Histogram(
            "ce_turn_seconds", "Turn latency at the gateway",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )
        # Where a turn's time went (the session host's timing, as in the Server-Timing header):
        # ce_turn_seconds minus the host's share is the hop; the gate is part of the host's share.
        self.host_latency = Histogram(
            "ce_turn_host_seconds", "The session host's share of a turn (activation, model rounds, tools, gate)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )
        self.gate_latency = Histogram(
            "ce_turn_gate_seconds", "Of the host's share, the wait for the turn's state to be durable (output gate)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=r,
        )
        self.tool_calls = Counter("ce_tool_calls_total", "Tool calls", ["tool", "outcome"], registry=r)
        self.tool_latency = Histogram(
            "ce_tool_latency_seconds", "Tool call latency", ["tool"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.live_sessions = Gauge("ce_live_sessions", "Sessions cached per host", ["host"], registry=r)
        self.flush_ms = Gauge("ce_flush_last_ms", "Duration of the host's last flush", ["host"], registry=r)
        self.flushes = Gauge("ce_flushes", "Flush transactions per host since start", ["host"], registry=r)
        self.flushed_sessions = Gauge(
            "ce_flushed_sessions", "Session deltas written per host since start", ["host"], registry=r
        )
        self.host_turns = Gauge("ce_host_turns", "Turns a host was asked to run since start", ["host"], registry=r)
        self.lane_turns = Gauge(
            "ce_host_lane_turns", "Of those, turns that came over the host's lane (not Ray's task path)",
            ["host"], registry=r,
        )
        self.stored_turn_reads = Gauge(
            "ce_host_stored_turn_reads",
            "Reads of a stored answer for a client's message id the host's turn cache did not hold",
            ["host"], registry=r,
        )
        self.unwritten_turns = Gauge(
            "ce_host_unwritten_turns",
            "Turns a host ran whose state is not written yet (the database away); at ce_host_unwritten_turns_cap "
            "it refuses new turns (503 storage_unavailable)", ["host"], registry=r,
        )
        self.unwritten_cap = Gauge(
            "ce_host_unwritten_turns_cap", "The unwritten turns a host holds before it refuses new ones",
            ["host"], registry=r,
        )
        self.gc_paused = Gauge(
            "ce_host_gc_pause_seconds_total",
            "Seconds the host's cyclic garbage collector has stopped its event loop since it started", ["host"], registry=r,
        )
        self.gc_longest = Gauge(
            "ce_host_gc_pause_longest_seconds",
            "The host's longest single garbage-collector pause of the last minute (every turn in flight waits it out)",
            ["host"], registry=r,
        )
        self.share_waiting = Gauge(
            "ce_host_share_waiting", "Turns waiting for a compute slot on the host now, behind other turns "
            "(CE_HOST_CPU_SLOTS; a freed slot goes to the tenant with the fewest)", ["host"], registry=r,
        )
        self.share_overruns = Gauge(
            "ce_host_share_overruns_total", "Turns that waited a second for a compute slot and ran over the "
            "bound (log fair_share_overrun): a host short of CPU, or slots too few", ["host"], registry=r,
        )
        self.host_up = Gauge(
            "ce_host_up", "1 when the host answered this scrape; 0 when it did not (its other series keep "
            "their last values)", ["host"], registry=r,
        )
        self._per_host = (self.live_sessions, self.flush_ms, self.flushes, self.flushed_sessions,
                          self.host_turns, self.lane_turns, self.stored_turn_reads, self.unwritten_turns,
                          self.unwritten_cap, self.gc_paused, self.gc_longest, self.share_waiting,
                          self.share_overruns, self.host_up)
        self._hosts: set[str] = set()  # the hosts with series

    def observe_turn(self, reply: TurnReply, seconds: float) -> None:
        if reply.replay:  # the stored answer to a repeated message id: nothing ran
            self.messages.labels("replay").inc()
            return
        self.messages.labels("pending_approval" if reply.pending_approval else "ok").inc()
        self.rounds.observe(reply.rounds)
        self.turn_latency.observe(seconds)
        if reply.timing is not None:
            self.host_latency.observe(reply.timing.host_ms / 1000)
            self.gate_latency.observe(reply.timing.gate_ms / 1000)
        for call in reply.tool_calls:
            tool = self._tool_label(call.name)
            self.tool_calls.labels(tool, "success" if call.success else "failure").inc()
            self.tool_latency.labels(tool).observe(call.latency_ms / 1000)

    def _tool_label(self, name: str) -> str:
        # A contact can make the model name any tool: bound the label set so /metrics cannot grow
        # without limit (unknown names are refused in-band and land in "other" once it is full).
        if name in self._tool_labels:
            return name
        if len(self._tool_labels) >= MAX_TOOL_LABELS:
            return "other"
        self._tool_labels.add(name)
        return name

    def observe_hosts(self, stats: list[dict], expected: Iterable[str] = ()) -> None:
        """Set the per-host gauges from one scrape's host stats. A host `expected` (the shard
        count says it exists) that did not answer keeps its last values, with `ce_host_up` 0 (also
        one never seen, such as a host hung since this gateway started): one
        slow answer does not make its counters vanish and come back as resets. A host neither
        answering nor expected (retired by a scale-down) loses its label sets: Prometheus then
        marks its series stale instead of seeing its last values for ever."""
        answered = {s["host"] for s in stats}
        silent = set(expected) - answered
        for host in silent:
            self.host_up.labels(host).set(0)
        hosts = answered | silent
        for gone in self._hosts - hosts:
            for gauge in self._per_host:
                try:
                    gauge.remove(gone)
                except KeyError:  # never set for this host
                    pass
        self._hosts = hosts
        for s in stats:
            host = s["host"]
            self.host_up.labels(host).set(1)
            self.live_sessions.labels(host).set(s["live_sessions"])
            self.flush_ms.labels(host).set(s["last_flush_ms"])
            self.flushes.labels(host).set(s["flushes"])
            self.flushed_sessions.labels(host).set(s["flushed_sessions"])
            self.host_turns.labels(host).set(s.get("turn_calls", 0))
            self.lane_turns.labels(host).set(s.get("lane_calls", 0))
            self.stored_turn_reads.labels(host).set(s.get("stored_turn_reads", 0))
            if "gc_pause_s_total" in s:  # an older host does not measure them
                self.gc_paused.labels(host).set(s["gc_pause_s_total"])
                self.gc_longest.labels(host).set(s["gc_pause_longest_s"])
            if "share_waiting" in s:  # likewise
                self.share_waiting.labels(host).set(s["share_waiting"])
                self.share_overruns.labels(host).set(s["share_overruns"])
            if "unwritten_turns" in s:  # an older host says neither: no sample rather than a false 0
                self.unwritten_turns.labels(host).set(s["unwritten_turns"])
                self.unwritten_cap.labels(host).set(s["unwritten_turns_cap"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
