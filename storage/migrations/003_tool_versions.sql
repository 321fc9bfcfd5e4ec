-- Tools as versioned data (seed 001): every definition is a row of ce_tool_versions; the row in
-- ce_custom_tools is the published (live) one, with the seed's columns filled from it.

ALTER TABLE ce_custom_tools
  ADD COLUMN type       TEXT NOT NULL DEFAULT 'webhook',
  ADD COLUMN version    INTEGER NOT NULL DEFAULT 1,
  ADD COLUMN definition JSONB NOT NULL DEFAULT '{}',
  ADD COLUMN updated_at TIMESTAMPTZ NOT NULL DEFAULT now();
-- UNIQUE (tenant_id, name) already gives ce_custom_tools an index starting with tenant_id.

CREATE TABLE ce_tool_versions (
  tenant_id  TEXT NOT NULL,
  name       TEXT NOT NULL,
  version    INTEGER NOT NULL CHECK (version >= 1),
  definition JSONB NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, name, version)
);

-- Time spent waiting for a concurrency slot, apart from latency_ms (the executor measures both).
ALTER TABLE ce_tool_calls ADD COLUMN queue_ms INTEGER;
-- Per-tool analytics (GET /v1/analytics/tools) and a session's recent calls.
CREATE INDEX ce_tool_calls_tenant_tool_created_idx ON ce_tool_calls (tenant_id, tool_name, created_at);
CREATE INDEX ce_tool_calls_tenant_created_idx ON ce_tool_calls (tenant_id, created_at);
CREATE INDEX ce_tool_calls_tenant_session_idx ON ce_tool_calls (tenant_id, session_id, created_at);

CREATE INDEX ce_session_variables_tenant_session_idx ON ce_session_variables (tenant_id, session_id);
