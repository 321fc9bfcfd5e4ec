-- Tenants and their API keys. A key is stored only as the sha256 hex of its plaintext
-- (storage.repos.tenants explains why a fast hash is right for these keys).

CREATE TABLE ce_tenants (
  id         TEXT PRIMARY KEY,
  name       TEXT NOT NULL UNIQUE,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE ce_api_keys (
  id         TEXT PRIMARY KEY,
  tenant_id  TEXT NOT NULL REFERENCES ce_tenants (id) ON DELETE CASCADE,
  key_hash   TEXT NOT NULL UNIQUE,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  revoked_at TIMESTAMPTZ
);
CREATE INDEX ce_api_keys_tenant_idx ON ce_api_keys (tenant_id);
