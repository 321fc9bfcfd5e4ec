-- Seed 000 (Tool Registry — Architecture Reference, § Database), verbatim.
-- These three tables are the contract with the seed: never edit them here; add columns and
-- indexes in later migrations. `session_id` holds storage.records.session_uid(tenant_id, id).

CREATE TABLE ce_custom_tools (
  id          TEXT PRIMARY KEY,
  tenant_id   TEXT NOT NULL,
  name        TEXT NOT NULL,
  description TEXT NOT NULL,
  parameters  JSONB NOT NULL,
  webhook_url TEXT NOT NULL,
  auth_header TEXT,                        -- stored encrypted
  timeout_ms  INTEGER DEFAULT 5000,
  enabled     BOOLEAN DEFAULT true,
  created_at  TIMESTAMPTZ DEFAULT now(),
  UNIQUE (tenant_id, name)
);

CREATE TABLE ce_tool_calls (
  id          TEXT PRIMARY KEY,
  session_id  TEXT NOT NULL,
  tenant_id   TEXT NOT NULL,
  message_id  TEXT,
  tool_name   TEXT NOT NULL,
  parameters  JSONB,
  result      JSONB,
  success     BOOLEAN NOT NULL,
  latency_ms  INTEGER,
  error       TEXT,
  created_at  TIMESTAMPTZ DEFAULT now()
);

CREATE TABLE ce_session_variables (
  id         TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  tenant_id  TEXT NOT NULL,
  key        TEXT NOT NULL,
  value      TEXT NOT NULL,
  created_at TIMESTAMPTZ DEFAULT now(),
  UNIQUE (session_id, key)
);
