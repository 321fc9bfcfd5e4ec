-- Session actors' durable state. `id`/`session_id` is storage.records.session_uid(tenant_id,
-- the tenant's session id), so two tenants may use the same session id without sharing rows.
-- `epoch` is the fencing token: every activation bumps it, and a flush carrying an older epoch
-- is refused (storage.repos.sessions).

CREATE TABLE ce_sessions (
  id            TEXT PRIMARY KEY,
  tenant_id     TEXT NOT NULL,
  session_key   TEXT NOT NULL,           -- the tenant's own session id
  epoch         BIGINT NOT NULL DEFAULT 0,
  owner         TEXT,                    -- the activation holding the lease (host / actor name)
  snapshot      JSONB NOT NULL DEFAULT '{}',
  message_count INTEGER NOT NULL DEFAULT 0,
  handoff       BOOLEAN NOT NULL DEFAULT false,
  created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  UNIQUE (tenant_id, session_key)
);
CREATE INDEX ce_sessions_tenant_updated_idx ON ce_sessions (tenant_id, updated_at DESC);

CREATE TABLE ce_messages (
  id         BIGSERIAL PRIMARY KEY,
  tenant_id  TEXT NOT NULL,
  session_id TEXT NOT NULL,
  seq        INTEGER NOT NULL,
  role       TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
  content    JSONB NOT NULL,             -- LLM content blocks
  message_id TEXT,                       -- the client's message_id of the turn, when given
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  UNIQUE (session_id, seq)
);
CREATE INDEX ce_messages_tenant_session_idx ON ce_messages (tenant_id, session_id, seq);

-- The first answer to each client message_id: a retried message returns it and runs nothing.
CREATE TABLE ce_turns (
  tenant_id  TEXT NOT NULL,
  session_id TEXT NOT NULL,
  message_id TEXT NOT NULL,
  response   JSONB NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (session_id, message_id)
);
CREATE INDEX ce_turns_tenant_idx ON ce_turns (tenant_id, session_id);

CREATE TABLE ce_usage (
  tenant_id     TEXT NOT NULL,
  session_id    TEXT NOT NULL,
  model         TEXT NOT NULL,
  input_tokens  BIGINT NOT NULL DEFAULT 0,
  output_tokens BIGINT NOT NULL DEFAULT 0,
  updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, session_id, model)
);

CREATE TABLE ce_bot_config (
  tenant_id  TEXT PRIMARY KEY,
  config     JSONB NOT NULL,
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
