-- Two kinds of API key: `admin` (every route; every key made before this) and `chat`, which a
-- public web page may embed: it may only send messages and approvals to sessions, read a
-- session's view and watch its events (services.gateway.common.CHAT_ROUTES).
ALTER TABLE ce_api_keys ADD COLUMN kind TEXT NOT NULL DEFAULT 'admin' CHECK (kind IN ('admin', 'chat'));
