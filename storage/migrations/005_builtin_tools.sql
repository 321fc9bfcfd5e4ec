-- Tables behind the built-in tools (recall_memory, collect_lead, book_appointment, submit_form,
-- escalate_to_human) and workflow jobs. As everywhere, `session_id` holds
-- storage.records.session_uid(tenant_id, the tenant's session id), and every row is read and
-- written together with its tenant_id.

CREATE TABLE ce_memories (
  id         TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id  TEXT NOT NULL,
  contact_id TEXT,
  session_id TEXT,
  kind       TEXT NOT NULL CHECK (kind IN ('fact', 'message')),
  content    TEXT NOT NULL,
  language   REGCONFIG NOT NULL DEFAULT 'english',
  -- to_tsvector(regconfig, text) is immutable, so a stored generated column works (no trigger)
  tsv        TSVECTOR GENERATED ALWAYS AS (to_tsvector(language, content)) STORED,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- GIN cannot lead with tenant_id without btree_gin (absent from pgserver's build): the btree index
-- narrows by tenant, the GIN index serves the text match.
CREATE INDEX ce_memories_tenant_contact_idx ON ce_memories (tenant_id, contact_id, created_at);
CREATE INDEX ce_memories_tsv_idx ON ce_memories USING gin (tsv);

CREATE TABLE ce_leads (
  id         TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id  TEXT NOT NULL,
  session_id TEXT NOT NULL,
  name       TEXT,
  email      TEXT,
  phone      TEXT,
  notes      TEXT,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  UNIQUE (tenant_id, session_id)
);

CREATE TABLE ce_forms (
  tenant_id  TEXT NOT NULL,
  name       TEXT NOT NULL,
  schema     JSONB NOT NULL,             -- JSON schema of the form's fields
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, name)
);

CREATE TABLE ce_form_submissions (
  id         TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id  TEXT NOT NULL,
  session_id TEXT,
  form_name  TEXT NOT NULL,
  data       JSONB NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX ce_form_submissions_tenant_form_idx ON ce_form_submissions (tenant_id, form_name, created_at);

CREATE TABLE ce_appointment_services (
  tenant_id        TEXT NOT NULL,
  name             TEXT NOT NULL,
  duration_minutes INTEGER NOT NULL CHECK (duration_minutes > 0),
  timezone         TEXT NOT NULL DEFAULT 'UTC',
  opening_hours    JSONB NOT NULL DEFAULT '{}',  -- weekday -> [["09:00","17:00"], ...]
  PRIMARY KEY (tenant_id, name)
);

-- Overlapping bookings of one tenant's service are impossible, enforced by an exclusion
-- constraint. Equality on text inside a GiST exclusion needs btree_gist, which pgserver's
-- Postgres does not ship; a text range type has built-in GiST support for `=`, so each key is
-- wrapped as the one-point range [x,x]. Same guarantee, no extension, same schema everywhere.
CREATE TYPE ce_textrange AS RANGE (subtype = text, collation = "C");

CREATE TABLE ce_appointments (
  id            TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id     TEXT NOT NULL,
  service       TEXT NOT NULL,
  starts_at     TIMESTAMPTZ NOT NULL,
  ends_at       TIMESTAMPTZ NOT NULL,
  session_id    TEXT,
  contact_name  TEXT,
  contact_email TEXT,
  created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  CONSTRAINT ce_appointments_ends_after_start CHECK (ends_at > starts_at),
  CONSTRAINT ce_appointments_no_overlap EXCLUDE USING gist (
    ce_textrange(tenant_id, tenant_id, '[]') WITH =,
    ce_textrange(service, service, '[]') WITH =,
    tstzrange(starts_at, ends_at) WITH &&
  )
);
CREATE INDEX ce_appointments_tenant_service_idx ON ce_appointments (tenant_id, service, starts_at);

CREATE TABLE ce_handoffs (
  id         TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id  TEXT NOT NULL,
  session_id TEXT NOT NULL,
  reason     TEXT,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX ce_handoffs_tenant_idx ON ce_handoffs (tenant_id, created_at);

-- Long-running workflow tool runs: the model gets the job id now, the session the result later.
CREATE TABLE ce_jobs (
  id         TEXT PRIMARY KEY DEFAULT gen_random_uuid()::text,
  tenant_id  TEXT NOT NULL,
  session_id TEXT NOT NULL,
  tool_name  TEXT NOT NULL,
  status     TEXT NOT NULL DEFAULT 'pending',  -- pending | running | succeeded | failed
  result     JSONB,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX ce_jobs_tenant_session_idx ON ce_jobs (tenant_id, session_id, created_at);
CREATE INDEX ce_jobs_open_idx ON ce_jobs (status, updated_at) WHERE status IN ('pending', 'running');
