-- Every process that caches tenants' catalogs (a session host, the in-process runtime) registers
-- here while its LISTEN ce_catalog connection is up. A writer of a catalog change commits, sends a
-- fence (NOTIFY ce_catalog, 'fence:<n>', n from ce_catalog_fence) and waits until every listener
-- that beat within the last seconds has acknowledged a fence >= n (`seen`): notifications reach a
-- listener in commit order, so by then it has dropped the changed tenant's catalog, and the next
-- message sees the change without a read of its own. A listener that does not acknowledge in time
-- is marked `lagging`; its next beat finds the mark and it drops every catalog it holds.
-- `backend_pid` is the server process of the listener's LISTEN connection: when that connection
-- ends (the process died, the network dropped it), writers stop waiting for it at once.
CREATE SEQUENCE ce_catalog_fence;

CREATE TABLE ce_catalog_listeners (
    listener_id TEXT PRIMARY KEY,
    seen BIGINT NOT NULL DEFAULT 0,
    lagging BOOLEAN NOT NULL DEFAULT false,
    backend_pid INTEGER,
    beat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    started_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
