"""Locust scenarios for `make loadtest` (bench/loadtest.py runs this headless; it can also be
run by hand: `locust -f bench/locustfile.py --host $CE_URL` with CE_API_KEY set).

Each locust user is one contact with its own chat session, pausing between messages as a person
would. Scenarios, by weight:
- order lookups: "where is my order N?" -> check_order on the demo store (one tool round);
- lead capture: the built-in `collect_lead` (skipped when the engine has no built-ins);
- booking with approval: a write webhook tool held for approval, then
  POST /v1/sessions/{id}/approvals/{approval_id} approves it and the booking runs;
- failing tools: a webhook tool whose backend port is closed; every call fails in-band, and the
  third failure in a session opens its breaker so the tool is no longer offered.
A reply counts as a failure when the HTTP status is not 200 or the body does not say what the
scenario expects (the tool ran, failed in-band, or was held for approval); a 429 (admission
control: the tenant's rate or a session's mailbox) is counted apart as shed load. An approval
answered 429 or 503 is retried after Retry-After, as a person would, so the held turn is not
abandoned (a decision asked again answers as it did: nothing runs twice).

Stages (users, seconds) come from LT_STAGES ("10:20,25:20,..."); every request is also kept per
stage in LT_STAGE_FILE (JSON), from which bench/loadtest.py finds the knee.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid

from locust import LoadTestShape, between, events, task
from locust.contrib.fasthttp import FastHttpUser

API_KEY = os.environ.get("CE_API_KEY", "")
THINK = (float(os.environ.get("LT_THINK_MIN", "0.5")), float(os.environ.get("LT_THINK_MAX", "1.5")))
BOOK_TOOL = os.environ.get("LT_BOOK_TOOL", "lt_book_table")
FAILING_TOOL = os.environ.get("LT_FAILING_TOOL", "lt_stock_check")
LEADS = os.environ.get("LT_LEADS", "1") == "1"
STAGES = [tuple(int(x) for x in s.split(":")) for s in os.environ.get("LT_STAGES", "10:20,25:20,50:20").split(",")]
STAGE_FILE = os.environ.get("LT_STAGE_FILE", "")
SETTLE = float(os.environ.get("LT_SETTLE", "0.25"))  # the first part of a stage is ramp-up: not counted


class StagedShape(LoadTestShape):
    """Concurrent sessions stepped up stage by stage."""

    def tick(self):
        elapsed = self.get_run_time()
        end = 0.0
        for users, seconds in STAGES:
            end += seconds
            if elapsed < end:
                return users, min(max(users, 10), 100)  # spawn rate: reach the stage within seconds
        return None


def stage_at(elapsed: float) -> tuple[int, bool]:
    """(stage index, whether `elapsed` is past the stage's ramp-up) for a run time."""
    start = 0.0
    for i, (_users, seconds) in enumerate(STAGES):
        if elapsed < start + seconds:
            return i, elapsed >= start + seconds * SETTLE
        start += seconds
    return len(STAGES) - 1, True


_records: dict[int, dict[str, list]] = {}
_t0: list[float] = []


@events.test_start.add_listener
def _started(environment, **_kw):
    _t0[:] = [time.monotonic()]


@events.request.add_listener
def _record(request_type, name, response_time, response_length, exception, **_kw):
    if not _t0:
        return
    stage, settled = stage_at(time.monotonic() - _t0[0])
    if not settled:
        return
    rec = _records.setdefault(stage, {"ok": [], "fail": [], "shed": [], "t": []})
    rec["t"].append(time.monotonic() - _t0[0])
    if exception is not None and "HTTP 429" in str(exception):
        rec["shed"].append(response_time)  # refused by admission control (tenant rate, mailbox)
    else:
        (rec["fail"] if exception else rec["ok"]).append(response_time)


@events.quitting.add_listener
def _write(environment, **_kw):
    if not STAGE_FILE:
        return
    out = []
    start = 0.0
    for i, (users, seconds) in enumerate(STAGES):
        rec = _records.get(i, {"ok": [], "fail": [], "shed": [], "t": []})
        window = seconds * (1 - SETTLE)
        ok = sorted(rec["ok"])

        def pct(p, ok=ok):
            return ok[min(len(ok) - 1, int(len(ok) * p / 100))] if ok else 0.0

        sent = len(ok) + len(rec["fail"]) + len(rec["shed"])
        out.append({"users": users, "seconds": window, "requests": sent,
                    "failures": len(rec["fail"]), "shed_429": len(rec["shed"]),
                    "rps": sent / window if window else 0.0,
                    "ok_rps": len(ok) / window if window else 0.0,
                    "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99), "start_s": start})
        start += seconds
    with open(STAGE_FILE, "w") as f:
        json.dump(out, f, indent=2)


class Contact(FastHttpUser):
    """One contact in one chat session."""

    wait_time = between(*THINK)
    network_timeout = 120.0
    connection_timeout = 10.0

    def on_start(self):
        self.session_id = f"lt-{uuid.uuid4().hex[:16]}"
        self.headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        self.failing_calls = 0

    def _send(self, text: str, name: str, check) -> dict | None:
        body = json.dumps({"text": text, "message_id": uuid.uuid4().hex}).encode()
        with self.client.post(f"/v1/sessions/{self.session_id}/messages", data=body, headers=self.headers,
                              name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {(r.text or '')[:200]}")
                return None
            reply = r.json()
            problem = check(reply)
            if problem:
                r.failure(problem)
                return None
            r.success()
            return reply

    @task(6)
    def order_lookup(self):
        def check(reply):
            calls = reply.get("tool_calls") or []
            if not (calls and calls[0]["name"] == "check_order" and calls[0]["success"]):
                return f"check_order did not run: {json.dumps(calls)[:200]}"
            return None

        self._send(f"where is my order {random.randint(10000, 99999)}?", "order lookup", check)

    @task(2)
    def lead_capture(self):
        if not LEADS:
            return
        args = {"name": f"Contact {self.session_id[-4:]}", "email": f"{self.session_id}@example.com",
                "notes": "asked about bulk orders"}

        def check(reply):
            calls = reply.get("tool_calls") or []
            if not calls or calls[0]["name"] != "collect_lead":
                return f"collect_lead did not run: {json.dumps(calls)[:200]}"
            return None

        self._send(f"/call collect_lead {json.dumps(args)}", "lead capture", check)

    @task(1)
    def booking_with_approval(self):
        args = {"party": random.randint(1, 6), "time": f"2026-12-{random.randint(10, 28)}T19:00"}

        def held(reply):
            if not reply.get("pending_approval"):
                return f"booking was not held for approval: {json.dumps(reply)[:200]}"
            return None

        reply = self._send(f"/call {BOOK_TOOL} {json.dumps(args)}", "booking (held)", held)
        if reply is None:
            return
        approval_id = reply["pending_approval"]["approval_id"]
        for attempt in range(4):  # a person approving retries when told to wait
            with self.client.post(f"/v1/sessions/{self.session_id}/approvals/{approval_id}",
                                  data=b'{"approve": true}', headers=self.headers, name="booking (approve)",
                                  catch_response=True) as r:
                if r.status_code in (429, 503) and attempt < 3:
                    r.failure(f"HTTP {r.status_code}: {(r.text or '')[:120]}")  # 429 is counted as shed
                    time.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                self._approved(r)
                return

    @staticmethod
    def _approved(r) -> None:
        if r.status_code != 200:
            r.failure(f"HTTP {r.status_code}: {(r.text or '')[:200]}")
            return
        calls = r.json().get("tool_calls") or []
        if not any(c["name"] == BOOK_TOOL and c["success"] for c in calls):
            r.failure(f"approved booking did not run: {json.dumps(calls)[:200]}")
            return
        r.success()

    @task(1)
    def failing_tool(self):
        tripped = self.failing_calls >= 3  # the third failure opened the breaker in this session

        def check(reply):
            calls = [c for c in reply.get("tool_calls") or [] if c["name"] == FAILING_TOOL]
            if tripped:  # not offered any more; named anyway, it is refused without running
                if any(c["success"] or "too often" not in (c.get("error") or "") for c in calls):
                    return f"breaker did not stop {FAILING_TOOL}: {json.dumps(calls)[:200]}"
                return None
            if not calls or calls[0]["success"]:
                return f"{FAILING_TOOL} should have failed in-band: {json.dumps(calls)[:200]}"
            self.failing_calls += 1
            return None

        self._send(f"/call {FAILING_TOOL} {json.dumps({'sku': 'MUG-01'})}",
                   "failing tool (breaker open)" if tripped else "failing tool", check)
