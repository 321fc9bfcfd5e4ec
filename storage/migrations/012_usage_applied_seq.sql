-- A flush retried after a commit whose acknowledgement was lost must not add its tokens twice:
-- each usage row remembers the newest message seq whose tokens it holds, and a delta adds its
-- tokens only when its messages are newer (NULL: from a delta without messages, always added).
ALTER TABLE ce_usage ADD COLUMN applied_seq BIGINT;
