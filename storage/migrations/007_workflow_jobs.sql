-- Workflow jobs (seed 001's asynchronous workflows): what started them and how they ended.
-- session_key is the tenant's own session id (session_id keeps the global uid like seed 000's tables).
ALTER TABLE ce_jobs ADD COLUMN session_key TEXT;
ALTER TABLE ce_jobs ADD COLUMN arguments JSONB;
ALTER TABLE ce_jobs ADD COLUMN error TEXT;
