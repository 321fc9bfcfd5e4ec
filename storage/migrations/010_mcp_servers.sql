-- Remote MCP servers a tenant registers as a tool source (streamable HTTP). The tools are listed
-- from the server when a catalog loads, so only the registration is stored here. The auth header
-- is ciphertext (services.tools.crypto), never plaintext.
CREATE TABLE ce_mcp_servers (
  tenant_id       TEXT NOT NULL,
  name            TEXT NOT NULL,
  url             TEXT NOT NULL,
  auth_header_enc TEXT,
  enabled         BOOLEAN NOT NULL DEFAULT true,
  read_only_tools TEXT[] NOT NULL DEFAULT '{}',
  include_tools   TEXT[],
  intents         TEXT[] NOT NULL DEFAULT '{}',
  timeout_ms      INTEGER NOT NULL DEFAULT 10000 CHECK (timeout_ms > 0),
  created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, name)
);
