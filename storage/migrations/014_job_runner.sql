-- Who reports a workflow job's outcome: the engine itself (a `handler` workflow, run in the
-- session host), the tenant's system (a `start_url` workflow, over POST /v1/jobs/{id}/result), or
-- the client app (a client tool's answer, over the same route). A result posted for an engine-run
-- job is refused: before, a tenant key could finish it with an outcome of its own making.
ALTER TABLE ce_jobs ADD COLUMN runner TEXT NOT NULL DEFAULT 'tenant';
