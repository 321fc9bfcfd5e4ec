-- A fact's contact_id is the verified contact (a Contact-Token's `sub`) whose session wrote it, and
-- recall_memory reaches other sessions' facts by it. Facts written before held whatever email the
-- contact had typed to collect_lead, which nobody verified: those tags are let go, so that no
-- verified `sub` that happens to equal a typed address can read them. The facts themselves stay
-- (their session still finds them), as do the leads that hold the email.
UPDATE ce_memories SET contact_id = NULL WHERE contact_id IS NOT NULL;
