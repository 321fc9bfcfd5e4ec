-- The trace id of the turn a tool call ran in, so analytics and OpenTelemetry traces join.
ALTER TABLE ce_tool_calls ADD COLUMN trace_id TEXT;
CREATE INDEX ce_tool_calls_trace_idx ON ce_tool_calls (trace_id) WHERE trace_id IS NOT NULL;
