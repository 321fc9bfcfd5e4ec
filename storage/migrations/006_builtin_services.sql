-- What the built-in tool services (services.builtins) need beyond 005.
--
-- Idempotency: a write tool call carries a key that is stable when a turn is resumed or replayed
-- (message id + tool call id), so a replayed booking, submission or handoff returns the row the
-- first run wrote instead of writing a second one. Keys are only unique within one session.
ALTER TABLE ce_appointments ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX ce_appointments_idempotency_idx
  ON ce_appointments (tenant_id, session_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

ALTER TABLE ce_form_submissions ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX ce_form_submissions_idempotency_idx
  ON ce_form_submissions (tenant_id, session_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

ALTER TABLE ce_handoffs ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX ce_handoffs_idempotency_idx
  ON ce_handoffs (tenant_id, session_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- recall_memory: a session's own facts, and the sessions a contact had (found through the
-- session variable that names the contact, `contact_id` by default).
CREATE INDEX ce_memories_tenant_session_idx ON ce_memories (tenant_id, session_id, created_at);
CREATE INDEX ce_session_variables_tenant_key_value_idx ON ce_session_variables (tenant_id, key, value);

-- Admin listings, newest first.
CREATE INDEX ce_leads_tenant_created_idx ON ce_leads (tenant_id, created_at);
ALTER TABLE ce_appointment_services
  ADD COLUMN created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  ADD COLUMN updated_at TIMESTAMPTZ NOT NULL DEFAULT now();
