-- Egress allowances one tenant alone was granted by an operator (`chat-engine tenant
-- allow-egress`): destinations its webhook tools and backend bindings may reach despite the SSRF
-- guard, a CIDR or a host name, on one port or any (0). CE_WEBHOOK_ALLOW stays the operator-wide
-- list for every tenant; a range one tenant's backend needs no longer opens it to all.
CREATE TABLE ce_tenant_egress (
  tenant_id  TEXT NOT NULL REFERENCES ce_tenants(id) ON DELETE CASCADE,
  entry      TEXT NOT NULL,
  port       INTEGER NOT NULL DEFAULT 0 CHECK (port BETWEEN 0 AND 65535),
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, entry, port)
);
