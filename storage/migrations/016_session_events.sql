-- A session's event log (GET /v1/sessions/{id}/events): what a watcher of the conversation sees,
-- numbered per session. Rows are written by the session's flush, in the transaction that writes
-- the turn which made them, and never changed; a watcher resuming after event N reads seq > N.
-- `session_id` is the session's row key (session_uid), as in ce_messages; the key leads with the
-- tenant, as every tenant table's does.
CREATE TABLE ce_session_events (
    session_id TEXT NOT NULL,
    seq        BIGINT NOT NULL,
    tenant_id  TEXT NOT NULL,
    type       TEXT NOT NULL,
    data       JSONB NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, seq)
);
