"""The root of the engine's exceptions and the misuse/configuration errors shared by all packages.

Errors carry structured fields; messages say what failed and what to do next, lower-case.
Code never branches on message text.
"""

from __future__ import annotations


class ChatEngineError(Exception):
    """Root of every error the engine raises on purpose."""


class ConfigError(ChatEngineError):
    """The environment or a setting is wrong; the message names the variable and the fix."""

    def __init__(self, message: str, *, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable


class NotFound(ChatEngineError):
    """A tenant-scoped thing does not exist (or belongs to another tenant: same answer)."""

    def __init__(self, message: str, *, kind: str, key: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.key = key


class Conflict(ChatEngineError):
    """The request collides with existing state (a duplicate name, a stale version)."""


class LimitReached(Conflict):
    """A tenant already has as many of `kind` as it may register (`limit`); creating one more
    waits for it to delete one. Changing an existing one is never refused for this."""

    def __init__(self, message: str, *, kind: str, limit: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.limit = limit


class InvalidInput(ChatEngineError):
    """A caller sent something malformed; `path` says where (`$.parameters.order_id`)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class Unauthorized(ChatEngineError):
    """The caller did not prove who it is (a contact's token missing or refused): 401."""


class Forbidden(ChatEngineError):
    """The caller is known and may not do this (another contact's session): 403."""


class Overloaded(ChatEngineError):
    """Admission refused; retry after `retry_after` seconds.

    `reason` says who refused: the caller's own excess ("mailbox", "tenant_rate",
    "tenant_concurrency", "admin_rate", "tenant_actors": HTTP 429) or the engine's capacity or
    health ("host_busy", "gateway_connections", "dedicated_full", "shutting_down", "unsaved",
    "restarting", "storage_unavailable", "host_unresponsive": HTTP 503).
    """

    CALLER_REASONS = frozenset({"mailbox", "tenant_rate", "tenant_concurrency", "admin_rate", "tenant_actors"})

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: str = "host_busy") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason

    @property
    def status(self) -> int:
        return 429 if self.reason in self.CALLER_REASONS else 503
