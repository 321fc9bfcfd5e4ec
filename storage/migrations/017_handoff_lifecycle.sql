-- A handoff's lifecycle: requested (the bot escalated) -> assigned (a person claimed it) ->
-- resolved (closed, the session given back to the bot or not); requested -> resolved directly
-- too. A state only moves forward, by conditional updates (storage.repos.builtins.HandoffRepo).
-- `session_id` here is the tenant's own session id, as storage.repos.builtins writes it (005's
-- header says session_uid: true of ce_messages, not of the built-in tools' tables).
ALTER TABLE ce_handoffs
  ADD COLUMN state         TEXT NOT NULL DEFAULT 'requested',
  ADD COLUMN agent         TEXT,          -- who claimed it (the tenant's name for the person)
  ADD COLUMN assigned_at   TIMESTAMPTZ,
  ADD COLUMN resolved_at   TIMESTAMPTZ,
  ADD COLUMN return_to_bot BOOLEAN,       -- set when resolved; NULL on rows 017 closed itself
  ADD COLUMN updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  ADD CONSTRAINT ce_handoffs_state_check CHECK (state IN ('requested', 'assigned', 'resolved')),
  ADD CONSTRAINT ce_handoffs_assigned_check CHECK (state <> 'assigned' OR (agent IS NOT NULL AND assigned_at IS NOT NULL)),
  ADD CONSTRAINT ce_handoffs_resolved_check CHECK ((state = 'resolved') = (resolved_at IS NOT NULL));

-- Rows written before 017 stay 'requested': nothing could close a handoff until now, so each one's
-- session is still handed off (the bot silent), and only resolving the handoff gives it back.
-- Marking them 'resolved' would leave those sessions handed off with nothing left to resolve.
UPDATE ce_handoffs SET updated_at = created_at;

-- At most one open handoff per session (below). A session could be escalated twice before (a
-- crash lost the session's handed-off flag, then a later message escalated again): the first
-- stays open, the later ones are closed as its duplicates, as `record` now answers a second
-- escalation with the open handoff.
UPDATE ce_handoffs h SET state = 'resolved', resolved_at = now(), updated_at = now()
WHERE EXISTS (
  SELECT 1 FROM ce_handoffs e
  WHERE e.tenant_id = h.tenant_id AND e.session_id = h.session_id AND (e.created_at, e.id) < (h.created_at, h.id)
);

CREATE UNIQUE INDEX ce_handoffs_one_open_idx ON ce_handoffs (tenant_id, session_id)
  WHERE state IN ('requested', 'assigned');

-- A tenant's handoffs in one state, newest first (without a state: ce_handoffs_tenant_idx of 005).
CREATE INDEX ce_handoffs_tenant_state_idx ON ce_handoffs (tenant_id, state, created_at);
