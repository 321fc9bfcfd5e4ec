-- Tenant notifications (lead.created, appointment.booked, form.submitted, handoff.requested) go
-- through this outbox: written when the event happens, delivered by a background loop in every
-- session host, retried on a schedule until the tenant's endpoint takes them or the schedule ends.
-- Nothing is lost to a restart or an endpoint that is down for a while; a receiver de-duplicates
-- by `id` (the Standard Webhooks `webhook-id`), which stays the same on every attempt.
CREATE TABLE ce_notifications (
  id              TEXT PRIMARY KEY,
  tenant_id       TEXT NOT NULL,
  event_type      TEXT NOT NULL,
  payload         JSONB NOT NULL,          -- {"type", "timestamp", "data"}: the body as sent
  attempts        INTEGER NOT NULL DEFAULT 0,
  next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  delivered_at    TIMESTAMPTZ,
  failed_at       TIMESTAMPTZ,             -- gave up: the schedule ended or the failure is final
  last_error      TEXT,
  created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX ce_notifications_due_idx ON ce_notifications (next_attempt_at)
  WHERE delivered_at IS NULL AND failed_at IS NULL;
CREATE INDEX ce_notifications_tenant_idx ON ce_notifications (tenant_id, created_at);
