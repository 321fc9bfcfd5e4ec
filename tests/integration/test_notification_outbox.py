"""Tenant notifications through the outbox (ce_notifications) on the real Postgres: an endpoint that
is down for a while gets the event when it is back; an event claimed by a process that died is sent
by the next one; two delivering processes send each event once; a schedule that ends gives up; a
tool's row and its event are written in one transaction."""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager

import msgspec
import pytest
import yarl
from structlog.testing import capture_logs

from services.builtins.notify import LIGHT_POLL_S, PRUNE_EVERY_S, Notifier, verify
from services.tools.ssrf import policy_from_entries
from services.tools.webhook import WebhookClient
from storage.repos.egress import EgressRepo
from storage.repos.notifications import NewNotification, NotificationRepo
from tests.support.builtin_services import SECRET, FakeConfigs, ctx, receiver, services


@asynccontextmanager
async def notifier(pool, configs: FakeConfigs, *, schedule_s=(0.05, 0.05, 0.05), lease_s=60.0, decrypt=None,
                   **more):
    """A notifier as another process would run one: its own client, the same outbox."""
    async with WebhookClient(policy=policy_from_entries(("127.0.0.1/32",))) as client:
        n = Notifier(client, NotificationRepo(pool), configs, attempt_timeout_s=2.0, schedule_s=schedule_s,
                     poll_s=0.05, lease_s=lease_s, decrypt=decrypt, **more)
        n.start()
        try:
            yield n
        finally:
            await n.close(timeout_s=0)


async def queued(pool, tenant_id: str) -> int:
    return await pool.fetchval("SELECT count(*) FROM ce_notifications WHERE tenant_id = $1", tenant_id)


async def row(pool, event_id: str):
    return await pool.fetchrow("SELECT * FROM ce_notifications WHERE id = $1", event_id)


@pytest.mark.parametrize("status", [503, 404, 401])  # down, mid-deploy, mid secret rotation
async def test_an_endpoint_down_for_a_while_gets_the_event_once_it_is_back(pool, make_tenant, status):
    tenant, _ = await make_tenant("outbox")
    async with receiver() as rec, services(pool) as (_, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        rec.status = status
        async with notifier(pool, configs) as n:
            event_id = await n.emit(configs.configs[tenant.id], "lead.created", {"lead_id": 7}, tenant_id=tenant.id,
                                    key=7)
            assert event_id is not None
            await rec.wait(2)
            rec.status = 204  # back
            await n.drain(10)
        stored = await row(pool, event_id)
    assert stored["delivered_at"] is not None and stored["failed_at"] is None and stored["attempts"] == 3
    assert [h["webhook-id"] for h, _ in rec.requests] == [event_id] * 3  # one id: the receiver de-duplicates
    assert all(verify(SECRET, h, body) for h, body in rec.requests)  # each attempt signed afresh
    assert msgspec.json.decode(rec.requests[-1][1])["data"] == {"lead_id": 7}


async def test_an_event_claimed_by_a_process_that_died_is_sent_by_the_next_after_the_lease(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    configs = FakeConfigs()
    async with receiver() as rec:
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        outbox = NotificationRepo(pool)
        await outbox.enqueue(NewNotification(
            id="msg_orphan", tenant_id=tenant.id, event_type="lead.created",
            payload={"type": "lead.created", "timestamp": "2026-12-02T00:00:00+00:00", "data": {}}))
        # the first process claims it for 3 s, then dies before sending
        (claimed,) = await outbox.claim_due(10, lease_s=3.0)
        assert claimed.id == "msg_orphan" and claimed.attempts == 1
        async with notifier(pool, configs) as n:
            await asyncio.sleep(0.5)
            assert rec.requests == []  # leased by the dead process: not yet
            await rec.wait(1, timeout=20)
            await asyncio.sleep(0.2)
            assert n is not None
        stored = await row(pool, "msg_orphan")
    assert [h["webhook-id"] for h, _ in rec.requests] == ["msg_orphan"]
    assert stored["delivered_at"] is not None and stored["attempts"] == 2


async def test_a_lead_saved_while_the_endpoint_is_away_is_delivered_by_a_later_process(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    async with receiver() as rec:
        rec.status = 503
        # this process would try again in 30 s, but it stops before that
        async with services(pool, schedule_s=(30.0,), close_timeout_s=0) as (svc, configs):
            configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
            await svc.leads.collect({"name": "Jane", "email": "jane@example.com"}, ctx(tenant.id))
            await rec.wait(1)
        (pending,) = await pool.fetch("SELECT id FROM ce_notifications WHERE tenant_id = $1 "
                                      "AND delivered_at IS NULL AND failed_at IS NULL", tenant.id)
        await pool.execute("UPDATE ce_notifications SET next_attempt_at = now() WHERE id = $1", pending["id"])  # due
        rec.status = 204
        async with notifier(pool, configs) as n:
            await rec.wait(2)
            await asyncio.sleep(0.1)
            assert n is not None
        stored = await row(pool, pending["id"])
    assert stored["delivered_at"] is not None
    assert msgspec.json.decode(rec.requests[-1][1])["type"] == "lead.created"


async def test_two_delivering_processes_send_each_event_once(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    configs = FakeConfigs()
    async with receiver() as rec:
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        config = configs.configs[tenant.id]
        async with notifier(pool, configs) as a, notifier(pool, configs) as b:
            ids = [await (a if i % 2 else b).emit(config, "form.submitted", {"i": i}, tenant_id=tenant.id, key=i)
                   for i in range(30)]
            await asyncio.gather(a.drain(10), b.drain(10))
    sent = Counter(h["webhook-id"] for h, _ in rec.requests)
    assert set(sent) == set(ids) and set(sent.values()) == {1}, sent


async def test_when_the_schedule_ends_the_event_is_given_up_and_logged(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    configs = FakeConfigs()
    async with receiver() as rec:
        rec.status = 500
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        with capture_logs() as logs:
            async with notifier(pool, configs, schedule_s=(0.02, 0.02)) as n:
                event_id = await n.emit(configs.configs[tenant.id], "handoff.requested", {}, tenant_id=tenant.id,
                                        key="h1")
                await n.drain(10)
        stored = await row(pool, event_id)
    assert len(rec.requests) == 3 and stored["failed_at"] is not None and stored["delivered_at"] is None
    assert "500" in stored["last_error"], stored["last_error"]
    failures = [e for e in logs if e["event"] == "notification_failed" and e.get("webhook_id") == event_id]
    assert [e["final"] for e in failures] == [False, False, True]


async def test_a_lead_and_its_event_are_written_together_or_not_at_all(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    async with receiver() as rec, services(pool) as (svc, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        c = ctx(tenant.id)
        args = {"name": "Jane", "email": "jane@example.com"}
        broken = svc.notifier.build  # the event cannot be queued (here: a payload that cannot be encoded)
        svc.notifier.build = lambda *a, **k: msgspec.structs.replace(broken(*a, **k), payload={"bad": object()})
        with pytest.raises(Exception):  # noqa: B017 - whatever the storage error, nothing is kept
            await svc.leads.collect(args, c)
        assert await svc.repos.leads.list(tenant.id) == [] and await queued(pool, tenant.id) == 0
        svc.notifier.build = broken
        first = await svc.leads.collect(args, c)  # the call made again: lead and event, together
        again = await svc.leads.collect(args, c)  # a replay reaches the same lead: no second event
        assert first.result["lead_id"] == again.result["lead_id"]
        await rec.wait(1)
        await svc.notifier.drain(5)
    assert await queued(pool, tenant.id) == 1 and len(rec.requests) == 1
    assert msgspec.json.decode(rec.requests[0][1])["data"]["lead_id"] == first.result["lead_id"]


async def test_a_late_outcome_from_an_attempt_whose_lease_ran_out_changes_nothing(pool, make_tenant):
    tenant, _ = await make_tenant("outbox")
    outbox = NotificationRepo(pool)
    await outbox.enqueue(NewNotification(id="msg_late", tenant_id=tenant.id, event_type="lead.created",
                                         payload={"type": "lead.created", "timestamp": "t", "data": {}}))
    (slow,) = await outbox.claim_due(10, lease_s=0.0)  # process A claims; its lease runs out at once
    (fast,) = await outbox.claim_due(10, lease_s=60.0)  # process B claims it again and delivers
    assert (slow.attempts, fast.attempts) == (1, 2)
    await outbox.delivered(fast.id, fast.attempts)
    await outbox.give_up(slow.id, slow.attempts, "upstream_timeout")  # A's answer comes in late
    await outbox.retry_in(slow.id, slow.attempts, 5.0, "upstream_timeout")
    stored = await row(pool, "msg_late")
    assert stored["delivered_at"] is not None and stored["failed_at"] is None and stored["last_error"] is None


async def test_a_secret_stored_encrypted_signs_and_one_that_cannot_be_decrypted_fails_at_once(pool, make_tenant):
    # PUT /v1/bot-config stores the secret encrypted with CE_SECRET_KEY: the notifier decrypts it
    # to sign; with a key rotated away it cannot, and says so once instead of sending unsigned
    from services.tools.crypto import SecretBox, generate_key

    box = SecretBox([generate_key()])
    tenant, _ = await make_tenant("outbox")
    async with receiver() as rec, services(pool) as (_, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret_enc=box.encrypt(SECRET))
        async with notifier(pool, configs, decrypt=box.decrypt) as n:
            signed = await n.emit(configs.configs[tenant.id], "lead.created", {"lead_id": 8}, tenant_id=tenant.id, key=8)
            await n.drain(10)
        async with notifier(pool, configs, decrypt=SecretBox([generate_key()]).decrypt) as n:
            lost = await n.emit(configs.configs[tenant.id], "lead.created", {"lead_id": 9}, tenant_id=tenant.id, key=9)
            await n.drain(10)
        delivered, failed = await row(pool, signed), await row(pool, lost)
    assert delivered["delivered_at"] is not None and len(rec.requests) == 1
    assert verify(SECRET, *rec.requests[0])
    assert failed["failed_at"] is not None and failed["attempts"] == 1 and "cannot be decrypted" in failed["last_error"]


async def test_any_process_running_the_outbox_prunes_old_events_on_a_clock(pool, make_tenant):
    # A dedicated session actor polls every 30 s and exits after minutes idle: counting an hour of
    # idle polls, it never pruned, and its events stayed for ever (OPERATIONS.md says 7 days).
    assert LIGHT_POLL_S == 30.0 and PRUNE_EVERY_S == 3600.0
    tenant, _ = await make_tenant("outbox")

    async def settled(id: str, days_ago: float) -> None:
        await pool.execute(
            "INSERT INTO ce_notifications (id, tenant_id, event_type, payload, delivered_at) "
            "VALUES ($1, $2, 'lead.created', '{}'::jsonb, now() - make_interval(secs => $3))",
            id, tenant.id, days_ago * 86400)

    async def kept() -> set[str]:
        rows = await pool.fetch("SELECT id FROM ce_notifications WHERE tenant_id = $1", tenant.id)
        return {r["id"] for r in rows}

    async def until(expected: set[str]) -> None:
        async with asyncio.timeout(5):
            while await kept() != expected:
                await asyncio.sleep(0.02)

    clock = [1000.0]
    await settled("msg_old_1", 8)
    await settled("msg_recent", 1)
    async with notifier(pool, FakeConfigs(), monotonic=lambda: clock[0]):
        await until({"msg_recent"})  # the first idle poll of a process prunes
        await settled("msg_old_2", 8)
        clock[0] += PRUNE_EVERY_S - 1
        await asyncio.sleep(0.5)  # about ten idle polls within the hour: no second prune yet
        assert await kept() == {"msg_recent", "msg_old_2"}
        clock[0] += 1
        await until({"msg_recent"})


async def test_a_tenants_egress_allowance_opens_its_notification_webhook_to_it_alone(pool, make_tenant):
    # the client refuses loopback (no CE_WEBHOOK_ALLOW entry): only an operator's allowance for the
    # tenant lets its events through; the other tenant's, to the same receiver, fail as blocked
    (mine, _), (theirs, _) = await make_tenant("outbox-mine"), await make_tenant("outbox-theirs")
    configs = FakeConfigs()
    async with receiver() as rec, WebhookClient(policy=policy_from_entries(())) as client:
        for tenant in (mine, theirs):
            configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        await EgressRepo(pool).allow(mine.id, "127.0.0.1/32", yarl.URL(rec.url).port)
        n = Notifier(client, NotificationRepo(pool), configs, attempt_timeout_s=2.0, schedule_s=(0.05,),
                     poll_s=0.05, egress=EgressRepo(pool))
        n.start()
        try:
            sent = await n.emit(configs.configs[mine.id], "lead.created", {"lead_id": 1}, tenant_id=mine.id, key=1)
            blocked = await n.emit(configs.configs[theirs.id], "lead.created", {"lead_id": 2}, tenant_id=theirs.id,
                                   key=2)
            await n.drain(10)
        finally:
            await n.close(timeout_s=0)
        delivered, refused = await row(pool, sent), await row(pool, blocked)
    assert delivered["delivered_at"] is not None and [h["webhook-id"] for h, _ in rec.requests] == [sent]
    assert refused["failed_at"] is not None and "blocked" in (refused["last_error"] or ""), dict(refused)
