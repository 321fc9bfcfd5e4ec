"""structlog configuration, done once by the entrypoint (JSON in production, readable in a terminal).

Context (`tenant_id`, `session_id`, `request_id`) is bound with contextvars at the gateway and at
actor entry. Never log a body, a header value or a secret: `redact_secrets` is the last guard.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_SECRET_KEYS = frozenset(
    {"authorization", "auth_header", "api_key", "password", "secret", "token", "x-api-key"}
)


def redact_secrets(_logger, _name, event_dict: dict) -> dict:
    """Drop values of keys that look like credentials, whatever a caller passed."""
    for key in list(event_dict):
        if key.lower() in _SECRET_KEYS:
            event_dict[key] = "[redacted]"
    return event_dict


def configure_logging(*, fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger to write to `stream` (default: stdout, where
    a server's log collector reads; one-shot commands pass stderr so that stdout carries only their
    report, for `| jq`). Idempotent."""
    stream = sys.stdout if stream is None else stream
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    for name in QUIETED:
        logging.getLogger(name).setLevel(logging.CRITICAL)


#: libraries that log what a tenant's server sent: the MCP SDK logs an unparsable answer with its
#: body at ERROR, and a notification that fails validation with pydantic's error (the server's
#: payload as `input_value`) at WARNING with exc_info, under `mcp.*` loggers and under "client"
#: (mcp/client/session.py names its logger so). The engine logs such failures itself, without the
#: body (`mcp_call_failed`). "mcp" covers mcp.client, mcp.shared and the rest of the SDK.
QUIETED = ("mcp", "client")
