-- The session-host shard count that every gateway and every session host agrees on (issue 10).
-- One row per host group: '' is the engine's own hosts (ce-host-<i>); a placement with a name
-- prefix (the benchmark's gate-off hosts, say) keeps its own row under that prefix.
--
-- `pending` is set while a rescale is in progress: a host then owns a session only if it wins
-- it under both `shards` and `pending`, so a session that moves has no owner for the moment
-- its old host flushes and drops it, and can never be live on two hosts. `generation` grows by
-- one on every change; hosts and gateways ignore a view older than the one they hold.
-- Changes are announced with NOTIFY ce_cluster, '<host_group>' (storage.repos.cluster).

CREATE TABLE ce_cluster (
  host_group  TEXT PRIMARY KEY DEFAULT '',
  shards      INTEGER NOT NULL CHECK (shards >= 1),
  pending     INTEGER CHECK (pending >= 1),
  generation  BIGINT NOT NULL DEFAULT 1,
  updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
