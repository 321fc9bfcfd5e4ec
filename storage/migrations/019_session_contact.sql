-- A tenant's sessions of one verified contact (GET /v1/sessions?contact=SUB): the contact a session
-- is bound to lives in its snapshot (`contact_sub`, set by the first verified Contact-Token).
CREATE INDEX ce_sessions_contact_idx ON ce_sessions (tenant_id, (snapshot->>'contact_sub'))
    WHERE snapshot ? 'contact_sub' AND snapshot->>'contact_sub' IS NOT NULL;
