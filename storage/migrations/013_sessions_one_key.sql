-- Racing first activations of one session (two hosts during a rescale, or a retry beside the first
-- try) failed: INSERT ... ON CONFLICT (id) arbitrates on the primary key only, and the second
-- unique key on the same row made concurrent first inserts fail with a unique violation or a
-- deadlock between their speculative insertions. The id is derived from (tenant_id, session_key)
-- (a uuid5 of both), so the second key added nothing; a plain index keeps the lookups fast.
ALTER TABLE ce_sessions DROP CONSTRAINT ce_sessions_tenant_id_session_key_key;
CREATE INDEX ce_sessions_tenant_key_idx ON ce_sessions (tenant_id, session_key);
