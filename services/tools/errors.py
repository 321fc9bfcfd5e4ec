"""Tool errors: every way a tool call can fail, each with a reason and advice for the model.

The executor turns any of these into an in-band result:
    "Tool 'check_order' failed: upstream timeout. Inform the customer you cannot retrieve ..."
`reason` and `advice` never carry a credential, a stack trace or another tenant's data.
"""

from __future__ import annotations

from kernel.errors import ChatEngineError

DEFAULT_ADVICE = "Tell the customer you cannot complete this right now and offer another way to help."


class ToolError(ChatEngineError):
    """Root of tool failures. `reason` is short and lower-case ("upstream timeout")."""

    kind = "tool_error"
    retryable = False
    counts_for_breaker = True
    #: seconds the call waited for a slot and ran before this was raised, when it went through a
    #: services.tools.limiter.ResourceLimiter (which sets them on the way out); None: it did not
    queue_s: float | None = None
    run_s: float | None = None

    def __init__(self, reason: str, *, advice: str | None = None, tool_name: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.advice = advice or DEFAULT_ADVICE
        self.tool_name = tool_name


class UnknownTool(ToolError):
    kind = "unknown_tool"
    counts_for_breaker = False


class InvalidArguments(ToolError):
    """Arguments failed the tool's JSON schema; `reason` names the field and what is wrong."""

    kind = "invalid_arguments"
    counts_for_breaker = False


class PolicyDenied(ToolError):
    kind = "policy_denied"
    counts_for_breaker = False


class ApprovalDenied(ToolError):
    kind = "approval_denied"
    counts_for_breaker = False


class Interrupted(ToolError):
    """The call's turn was stopped (a host stopping, a bug) before its result came back: it may
    have run. Not the tool's fault, so not a breaker failure."""

    kind = "interrupted"
    counts_for_breaker = False


class DeadlineExceeded(ToolError):
    """The call's deadline (queue wait included) passed before or while it ran."""

    kind = "deadline_exceeded"
    retryable = True


class QueueTimeout(DeadlineExceeded):
    """The deadline passed while waiting for a slot: the tool is busy, not broken, so this does
    not count toward its circuit breaker."""

    kind = "queue_timeout"
    counts_for_breaker = False


class UpstreamTimeout(ToolError):
    kind = "upstream_timeout"
    retryable = True


class UpstreamStatus(ToolError):
    kind = "upstream_status"

    def __init__(self, reason: str, *, status: int, advice: str | None = None, tool_name: str | None = None) -> None:
        super().__init__(reason, advice=advice, tool_name=tool_name)
        self.status = status
        self.retryable = status >= 500 or status == 429


class UpstreamMalformed(ToolError):
    kind = "upstream_malformed"


class UpstreamTooLarge(ToolError):
    kind = "upstream_too_large"


class UpstreamUnreachable(ToolError):
    kind = "upstream_unreachable"
    retryable = True


class OutputContractBroken(ToolError):
    """The result does not match the tool's declared output schema (a contract failure)."""

    kind = "output_contract"


class DestinationBlocked(ToolError):
    """The SSRF guard refused the destination before any connection was made."""

    kind = "destination_blocked"


#: What the model is told; the rule that refused goes to `DestinationBlocked.rule` for operators.
BLOCKED_REASON = "destination not allowed"
BLOCKED_ADVICE = (
    "Tell the customer this action is unavailable right now; the business has to fix the tool's "
    "address before it can be used."
)


def blocked(rule: str, detail: str) -> DestinationBlocked:
    """A DestinationBlocked whose reason is only "destination not allowed".

    `rule` (which check refused) and `detail` (host and address, for operator logs) are attributes,
    never part of the text the model sees.
    """
    error = DestinationBlocked(BLOCKED_REASON, advice=BLOCKED_ADVICE)
    error.rule = rule  # type: ignore[attr-defined]
    error.detail = detail  # type: ignore[attr-defined]
    return error


class ToolCrashed(ToolError):
    """A handler raised something unexpected; details go to the log, not to the model."""

    kind = "tool_crashed"


#: the advice of a call no argument from the model could make valid (a protected URL hole or
#: required parameter nothing fills): the business's configuration, never the customer's to fix
#: a call that needs what only a verified contact's token gives the trusted scope (`account_id`,
#: a mapped claim such as `stay_id`), in a session without it
SIGN_IN_ADVICE = (
    "Ask the customer to sign in (their verified identity supplies it), then try again; never ask them for it."
)

MISCONFIGURED_ADVICE = (
    "This is a configuration problem of the business, not a detail the customer can give: tell them "
    "this action is unavailable right now and offer another way to help."
)
