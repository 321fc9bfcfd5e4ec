"""The executor pipeline of seed 001, pure of I/O frameworks:

resolve -> strip protected keys -> validate -> policy -> approval -> trusted context ->
execute under a per-resource limit and a deadline that includes queue wait -> normalise -> record.

Every failure becomes an in-band result the model can act on; nothing here raises to the session
except cancellation. `prepare` runs the checks for a whole batch before anything executes, so a
batch holding an approval-gated call runs nothing until the whole batch is approved (seed 001's
stronger guarantee). A required protected parameter that the trusted scope does not fill (one
spelled `AccountId`, which it never holds) is refused as the business's misconfiguration, never
as a detail to ask the customer for.

The record (ce_tool_calls) and the trace never keep a tool's `sensitive` values, nor values under
secret-looking names (services.tools.redaction): the parameters and the result are redacted at any
depth, with any string that repeats a sensitive argument's value, and a failure's text has each
sensitive value it quotes replaced (the model reads that text too; it sent the value itself). What
the model reads of a success is the result as the tool returned it (an upstream's body has had the
credentials the engine sent it taken out already: services.tools.webhook, services.tools.mcp_client);
a client tool's action goes to the client app whole (`ToolOutcome.client_action`), only its record
is redacted. An approver sees a held call's arguments redacted as its record would be
(`PreparedCall.shown_arguments`; the call runs with them whole), the contact is asked the tool's
`approval_prompt` filled from those (`PreparedCall.approval_prompt`: never a sensitive,
secret-looking or protected value, never the tool's description), and an output-contract failure
never quotes what the result holds under a sensitive or secret-looking name. A held batch prepared
again at the decision keeps the names each call's tool declared sensitive when it was held
(`prepare`'s `held_sensitive`): its records are redacted with those and the current definition's,
so a name dropped from `sensitive`, or a tool removed, while the approval was pending never puts the
value in clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog

from kernel.records import ToolCallRecord
from services.botconfig import BotConfig
from services.nesting import nests_deeper_than
from services.tools.approval_prompt import render_approval_prompt
from services.tools.context import TrustedContext
from services.tools.errors import (
    MISCONFIGURED_ADVICE,
    SIGN_IN_ADVICE,
    ApprovalDenied,
    Interrupted,
    InvalidArguments,
    OutputContractBroken,
    PolicyDenied,
    ToolCrashed,
    ToolError,
    UnknownTool,
)
from services.tools.limiter import Clock, ResourceLimiter, SystemClock
from services.tools.model import (
    ACCOUNT_KEYS,
    MAX_VALUE_DEPTH,
    PROTECTED_KEYS,
    is_protected,
    protected_forms,
)
from services.tools.redaction import redact, scrub_text, sensitive_values
from services.tools.registry import Catalog, ClientAction, CompiledTool, JobStarted, SetVariables
from services.tools.toolset import SessionToolState, gate_reason
from services.tracing import current_trace_id, tracer

log = structlog.get_logger(__name__)

DEFAULT_MAX_RESULT_CHARS = 16_000
DEFAULT_PROGRESS_AFTER_MS = 2_000
RETRY_BASE_S = 0.1
#: a call whose arguments nest deeper than this is refused in-band as it comes and its arguments
#: are not kept (recording them, redacted at every depth, would run out of stack)
MAX_ARGUMENT_DEPTH = MAX_VALUE_DEPTH
_TOO_DEEP = {"_": f"the arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep and were not kept"}

OnProgress = Callable[["PreparedCall", int, "str | None"], Awaitable[None]]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call as the model proposed it."""

    id: str
    name: str
    arguments: dict[str, Any]


class ToolOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """The normalised result of one call: what the model reads and what is recorded."""

    call_id: str
    name: str
    success: bool
    content: str  # the tool_result text for the model
    error: str | None = None  # in-band error text (also what the API reports)
    error_kind: str | None = None
    latency_ms: int = 0
    queue_ms: int = 0
    counts_for_breaker: bool = False
    client_action: ClientAction | None = None
    completes_variable: str | None = None
    #: session variables the handler set with a SetVariables result (applied on success only)
    variables: dict[str, str] = {}
    #: a workflow tool's job, whose result the session waits for
    job_id: str | None = None
    record: ToolCallRecord


class PreparedCall(msgspec.Struct, frozen=True, kw_only=True):
    call: ToolCall
    arguments: dict[str, Any]  # stripped of protected keys, trusted scope merged
    tool: CompiledTool | None = None
    error: ToolError | None = None
    needs_approval: bool = False
    #: the names the call's tool declared `sensitive` when the call was held for approval (a held
    #: batch prepared again at the decision; empty otherwise): still sensitive for this call, whatever
    #: the tool declares now, or if it is gone
    held_sensitive: frozenset[str] = frozenset()

    @property
    def mutability(self) -> str:
        return self.tool.definition.mutability if self.tool else "read"

    @property
    def sensitive(self) -> frozenset[str]:
        """The names whose values the call's record, trace, failure text and approver's copy never
        show (besides secret-looking ones): its tool's `sensitive` now and those it was held with."""
        return self.held_sensitive.union(self.tool.definition.sensitive) if self.tool else self.held_sensitive

    def shown_arguments(self) -> dict[str, Any]:
        """The arguments as an approver sees them: redacted as the call's record is (sensitive and
        secret-looking names at any depth, and their values wherever another string repeats one).
        A copy: the call itself runs with `arguments`."""
        return redact(self.arguments, self.sensitive, _sensitive_values(self))

    def approval_prompt(self) -> str:
        """The question the contact is asked before this call runs: its tool's `approval_prompt`
        filled from the arguments as an approver sees them (`shown_arguments`), or the default
        question from the tool's name and arguments; never a sensitive, secret-looking or
        protected value. A call with no tool has the default question of its name."""
        d = self.tool.definition if self.tool is not None else None
        return render_approval_prompt(
            d.approval_prompt if d is not None else None, tool_name=self.call.name,
            arguments=self.shown_arguments(), sensitive=self.sensitive,
            protected=d.protected_keys if d is not None else PROTECTED_KEYS,
        )


class BatchPlan(msgspec.Struct, frozen=True, kw_only=True):
    calls: list[PreparedCall]

    @property
    def needs_approval(self) -> bool:
        return any(p.needs_approval for p in self.calls)

    def summary(self) -> list[str]:
        """The question the contact is asked for each call that will run, in order
        (`PreparedCall.approval_prompt`)."""
        return [p.approval_prompt() for p in self.calls if p.error is None and p.tool is not None]


def failure_text(tool_name: str, error: ToolError, *, reason: str | None = None) -> str:
    """Seed 000's in-band text: what failed (`reason`, default the error's) and what to tell the contact."""
    return f"Tool '{tool_name}' failed: {error.reason if reason is None else reason}. {error.advice}"


@dataclass(frozen=True, slots=True)
class _Batch:
    """One `execute` call's own context. Never kept on the executor: one executor serves every
    session of a host at once, and a batch's progress must reach its own session's stream only."""

    ctx: TrustedContext
    deadline: float | None
    on_progress: OnProgress | None
    finished: dict[str, ToolOutcome]


class Executor:
    def __init__(
        self,
        *,
        limiter: ResourceLimiter | None = None,
        clock: Clock | None = None,
        new_id: Callable[[], str] | None = None,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        progress_after_ms: int = DEFAULT_PROGRESS_AFTER_MS,
    ) -> None:
        self._progress_after_ms = progress_after_ms
        self._clock = clock or SystemClock()
        # Deadlines are computed on self._clock; the limiter must compare them on the same clock.
        self._limiter = limiter or ResourceLimiter(clock=self._clock)
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self._max_result_chars = max_result_chars

    # -- stages 1-5: resolve, strip, validate, policy, approval -------------------------------

    async def prepare(
        self,
        calls: list[ToolCall],
        *,
        catalog: Catalog,
        config: BotConfig,
        session: SessionToolState,
        scope: dict[str, Any],
        intent: str | None = None,
        held_sensitive: list[list[str]] | None = None,
    ) -> BatchPlan:
        """Check every call of a batch before any runs. Never raises for bad calls: each
        carries its error, to be returned in-band. Calls of one tool in the batch count toward
        its per-turn and per-session limits in order, and a one-shot tool (`completes_variable`)
        runs once per batch: a later call of it is refused. `intent`: the turn's detected intent;
        a call of a tool its offer left out is refused (toolset.gate_reason). A batch prepared
        again on resuming an approval passes the intent the turn was held with, and in
        `held_sensitive` (call order) the `sensitive` names of each call's tool when held
        (`PreparedCall.sensitive`): the tool may have dropped one, or gone, since."""
        in_batch: dict[str, int] = {}
        prepared = []
        for i, c in enumerate(calls):
            if nests_deeper_than(c.arguments, MAX_ARGUMENT_DEPTH):
                p = PreparedCall(call=msgspec.structs.replace(c, arguments=_TOO_DEEP), arguments=dict(_TOO_DEEP),
                                 tool=catalog.get(c.name), error=InvalidArguments(
                                     f"the arguments nest more than {MAX_ARGUMENT_DEPTH} levels deep",
                                     advice="Call the tool again with the arguments its schema describes."))
            else:
                p = await self._prepare_one(c, catalog, config, session, scope, intent)
            if held_sensitive and i < len(held_sensitive) and held_sensitive[i]:
                p = msgspec.structs.replace(p, held_sensitive=frozenset(held_sensitive[i]))
            if p.error is None and p.tool is not None:
                limit_error = _limit_error(p.tool, session, in_batch.get(p.tool.name, 0))
                if limit_error is not None:
                    p = msgspec.structs.replace(p, error=limit_error, needs_approval=False)
                else:
                    in_batch[p.tool.name] = in_batch.get(p.tool.name, 0) + 1
            prepared.append(p)
        return BatchPlan(calls=prepared)

    async def _prepare_one(
        self, call: ToolCall, catalog: Catalog, config: BotConfig, session: SessionToolState, scope: dict[str, Any],
        intent: str | None,
    ) -> PreparedCall:
        tool = catalog.get(call.name)
        if tool is None:
            # Never discovered from anywhere else: an unknown name is the model's mistake.
            return PreparedCall(
                call=call, arguments={}, error=UnknownTool(
                    f"there is no tool named '{_short(call.name, 64)}'",
                    advice="Do not call it again; answer with what you know or ask a clarifying question.",
                ),
            )
        d = tool.definition
        try:
            args = declared_only(scoped_args(
                call.arguments if isinstance(call.arguments, dict) else {},
                {k: v for k, v in scope.items() if k in d.parameters.get("properties", {})},
                protected=d.protected_keys,
            ), d.parameters)
            problems = await tool.validator.problems(args)
        except RecursionError:
            args, problems = {}, ["the arguments nest too deeply"]
        unfilled = _unfilled_protected(d.parameters, d.protected_keys, scope)
        if unfilled in ACCOUNT_KEYS:
            return PreparedCall(call=call, tool=tool, arguments=args, error=PolicyDenied(
                f"the tool requires '{unfilled}', the customer's account, which only a signed-in customer's verified "
                "identity gives, and this conversation has none", advice=SIGN_IN_ADVICE,
            ))
        if unfilled is not None:
            return PreparedCall(call=call, tool=tool, arguments=args, error=PolicyDenied(
                f"the tool requires '{_short(unfilled, 64)}', which only the business's trusted context may fill, "
                "and it holds no value for it: the tool is misconfigured", advice=MISCONFIGURED_ADVICE,
            ))
        if problems:
            return PreparedCall(call=call, tool=tool, arguments=args, error=InvalidArguments(
                "invalid arguments: " + "; ".join(problems[:3]),
                advice="Ask the customer for the missing or corrected details, then call the tool again.",
            ))
        reason = gate_reason(tool, config, session, intent)
        if reason is not None:
            return PreparedCall(call=call, tool=tool, arguments=args, error=PolicyDenied(
                reason, advice="Do not call this tool again now; use only the tools you were offered, "
                               "or help the customer another way.",
            ))
        return PreparedCall(call=call, tool=tool, arguments=args, needs_approval=d.needs_approval)

    # -- stages 6-9: context, execute, normalise, record --------------------------------------

    async def execute(
        self, plan: BatchPlan, ctx: TrustedContext, *, approved: bool = False, deadline: float | None = None,
        on_progress: OnProgress | None = None, finished: dict[str, ToolOutcome] | None = None,
    ) -> list[ToolOutcome]:
        """Run a prepared batch; outcomes are in call order.

        Consecutive reads run concurrently (at most `max_parallel` of one tool at once); a write
        runs alone, in order. A batch that needs approval runs only with `approved=True`.
        `deadline` (clock time) caps every call. A call's own deadline starts before it waits for
        its `max_parallel` turn or its resource's slot: a call still waiting when it passes is
        refused as a queue timeout, and the wait is its `queue_ms`, failed or not.
        `on_progress(call, elapsed_ms, message)` is awaited once for each call still running (or
        waiting) after its progress threshold. `finished`, when given, gets each call's outcome by
        call id as soon as it has one: what a caller keeps of a batch cancelled half way (see
        `interrupted`).
        """
        if plan.needs_approval and not approved:
            raise ValueError("this batch needs approval before it runs")
        batch = _Batch(ctx=ctx, deadline=deadline, on_progress=on_progress, finished=finished if finished is not None else {})
        outcomes: list[ToolOutcome] = []
        group: list[PreparedCall] = []
        for prepared in plan.calls:
            if prepared.mutability == "read" or prepared.error is not None:
                group.append(prepared)
                continue
            outcomes += await self._run_group(group, batch)
            group = []
            outcomes += await self._run_group([prepared], batch)
        outcomes += await self._run_group(group, batch)
        return outcomes

    def interrupted(self, plan: BatchPlan, ctx: TrustedContext, finished: dict[str, ToolOutcome]) -> list[ToolOutcome]:
        """Every call of a batch that was stopped half way, in call order: the outcome of each
        call that finished (from `execute`'s `finished`), and for each other call a failure saying
        it was stopped and may have run (recorded like any call; not a breaker failure)."""
        error = Interrupted(
            "the call was stopped before its result came back (the turn was interrupted); it may have run",
            advice="Check whether it took effect before calling it again.",
        )
        return [
            finished.get(p.call.id) or self._failed(p, ctx, p.error or error, 0, 0)
            for p in plan.calls
        ]

    def deny(self, plan: BatchPlan, ctx: TrustedContext, *, reason: str) -> list[ToolOutcome]:
        """In-band results for a batch the approver declined: nothing ran."""
        outcomes = []
        for p in plan.calls:
            if p.error is not None:
                outcomes.append(self._failed(p, ctx, p.error, 0, 0))
                continue
            error = ApprovalDenied(
                reason if p.needs_approval else "not run because the other actions in this step were declined",
                advice="Tell the customer it was not done and ask how they would like to proceed.",
            )
            outcomes.append(self._failed(p, ctx, error, 0, 0))
        return outcomes

    def refuse_changed(
        self, plan: BatchPlan, ctx: TrustedContext, *, held_versions: list[int | None],
    ) -> list[ToolOutcome] | None:
        """In-band results for an approved batch whose tools changed while the approval was pending,
        or None when each call resolves to the tool version it was held with (`held_versions`, in
        call order: `CompiledTool.version` when held, None for a name no tool had then). `plan` is
        the held batch prepared against the catalog current now.

        The approver said yes to the definitions they were shown: a call whose tool has another
        version now, was removed, or exists now but did not then, does not run, and neither does
        the rest of the batch (seed 001: a batch runs whole, as approved, or not at all); a call
        whose tool is unchanged but which fails its checks keeps its own error. The refusals are
        policy refusals: the tool is not at fault (no breaker failure) and nothing ran (nothing
        counts toward its limits)."""
        changed: dict[int, str] = {}
        for i, p in enumerate(plan.calls):
            held = held_versions[i] if i < len(held_versions) else None
            now = p.tool.version if p.tool is not None else None
            if held == now:
                continue
            if held is None:
                what = "it did not exist when the approval was asked for and was added since"
            elif now is None:
                what = f"version {held} was shown for approval and the tool was removed since"
            else:
                what = f"version {held} was shown for approval and version {now} is published now"
            changed[i] = f"this tool changed while the approval was pending ({what}); not run"
            log.warning("approved_tool_changed", tool_name=_short(p.call.name, 64), held_version=held,
                        current_version=now)
        if not changed:
            return None
        advice = ("Tell the customer it was not done because the action changed, and ask the customer to confirm "
                  "again; call it again only once they have, which asks for a new approval.")
        outcomes = []
        for i, p in enumerate(plan.calls):
            if i in changed:
                error: ToolError = PolicyDenied(changed[i], advice=advice)
            elif p.error is not None:
                error = p.error
            else:
                error = PolicyDenied("not run because another action in this step changed while the approval "
                                     "was pending", advice=advice)
            outcomes.append(self._failed(p, ctx, error, 0, 0))
        return outcomes

    async def _run_group(self, group: list[PreparedCall], batch: _Batch) -> list[ToolOutcome]:
        if not group:
            return []
        if len(group) == 1:
            return [await self._run_one(group[0], batch)]
        gates: dict[str, asyncio.Semaphore] = {}
        for p in group:
            if p.tool is not None and p.tool.definition.max_parallel and p.tool.name not in gates:
                gates[p.tool.name] = asyncio.Semaphore(p.tool.definition.max_parallel)

        # The gate is waited on inside the limiter: under the call's deadline, as queue time.
        return list(await asyncio.gather(*(
            self._run_one(p, batch, gates.get(p.tool.name) if gates and p.tool is not None else None)
            for p in group
        )))

    async def _run_one(self, prepared: PreparedCall, batch: _Batch, gate: asyncio.Semaphore | None = None) -> ToolOutcome:
        with tracer().start_as_current_span("tool_call", attributes={"ce.tool": prepared.call.name[:64]}) as span:
            outcome = await self._run_one_traced(prepared, batch, gate)
            batch.finished[prepared.call.id] = outcome
            span.set_attribute("ce.outcome", "success" if outcome.success else (outcome.error_kind or "failure"))
            span.set_attribute("ce.latency_ms", outcome.latency_ms)
            span.set_attribute("ce.queue_ms", outcome.queue_ms)
            span.set_attribute("ce.arguments", msgspec.json.encode(outcome.record.parameters or {}).decode()[:2000])
            return outcome

    async def _run_one_traced(self, prepared: PreparedCall, batch: _Batch, gate: asyncio.Semaphore | None) -> ToolOutcome:
        ctx, deadline = batch.ctx, batch.deadline
        if prepared.error is not None or prepared.tool is None:
            return self._failed(prepared, ctx, prepared.error or UnknownTool("unknown tool"), 0, 0)
        tool = prepared.tool
        d = tool.definition
        call_deadline = self._clock.monotonic() + d.timeout_ms / 1000
        if deadline is not None:
            call_deadline = min(call_deadline, deadline)
        call_ctx = msgspec.structs.replace(ctx, idempotency_key=idempotency_key(ctx, prepared))
        started = time.perf_counter()
        progress = self._watch_progress(prepared, started, batch.on_progress)
        timed = None
        try:
            timed = await self._limiter.run(
                d.resource or d.name, call_deadline,
                lambda: self._attempts(tool, prepared.arguments, call_ctx, call_deadline),
                owner=ctx.tenant_id, gate=gate,
            )
            await _check_output(tool, timed.value, prepared.sensitive)
        except ToolError as exc:
            # Measured as a success is: by the limiter (on the error, or the run whose output
            # broke its contract); the wall clock only for an error that never went through it.
            if timed is not None:
                return self._failed(prepared, ctx, exc, _ms(timed.run_s), _ms(timed.queue_s))
            if exc.queue_s is not None:
                return self._failed(prepared, ctx, exc, _ms(exc.run_s or 0.0), _ms(exc.queue_s))
            return self._failed(prepared, ctx, exc, _ms(time.perf_counter() - started), 0)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug outside the handler (a handler's own is a ToolCrashed from `_attempts`).
            log.exception("tool_crashed", tool_name=d.name)
            run_ms, queue_ms = (_ms(timed.run_s), _ms(timed.queue_s)) if timed is not None else (
                _ms(time.perf_counter() - started), 0)
            return self._failed(prepared, ctx, ToolCrashed("internal error in the tool"), run_ms, queue_ms)
        finally:
            if progress is not None:
                progress.cancel()
        run_ms, queue_ms = _ms(timed.run_s), _ms(timed.queue_s)
        try:
            return self._succeeded(prepared, ctx, timed.value, run_ms, queue_ms)
        except (TypeError, msgspec.EncodeError):
            # A handler returned something that cannot be JSON-encoded: a bug in the tool, in-band.
            log.exception("tool_result_unencodable", tool_name=d.name)
            return self._failed(prepared, ctx, ToolCrashed("internal error in the tool"), run_ms, queue_ms)
        except (ResultTooDeep, RecursionError):
            # A result nested more than MAX_VALUE_DEPTH levels (the webhook and MCP clients refuse
            # those as they decode them; a handler in code may still return one). RecursionError:
            # one so deep that converting it to JSON values ran out of stack first, the same answer.
            # No traceback: it would be a thousand frames of the same line.
            log.warning("tool_result_too_deep", tool_name=d.name, limit=MAX_VALUE_DEPTH)
            return self._failed(prepared, ctx, ToolCrashed("the result nests too deeply to be read"), run_ms, queue_ms)
        except Exception:
            # Anything else building the outcome or its record: the call ran, so its turn must go on
            # with an in-band failure (raised, it would end the turn, be recorded as interrupted
            # and be met again on every retry of the message).
            log.exception("tool_result_unrecordable", tool_name=d.name)
            return self._failed(prepared, ctx, ToolCrashed("internal error in the tool"), run_ms, queue_ms)

    async def _attempts(self, tool: CompiledTool, args: dict[str, Any], ctx: TrustedContext, deadline: float) -> Any:
        """Call the handler; an idempotent read retries a retryable failure with exponential
        backoff and full jitter while its deadline leaves room. Writes never retry here.

        Anything but a ToolError the handler raises is logged and raised as an opaque
        ToolCrashed, so the limiter measures a crash as any other failure (a TimeoutError passes
        as it is: the limiter reports it as the deadline's, as it always has)."""
        d = tool.definition
        retries = d.retries if d.mutability == "read" else 0
        attempt = 0
        while True:
            try:
                return await tool.handler(args, ctx)
            except ToolError as exc:
                if attempt >= retries or not exc.retryable:
                    raise
                pause = random.uniform(0, RETRY_BASE_S * 2**attempt)
                if self._clock.monotonic() + pause >= deadline:
                    raise
                attempt += 1
                log.info("tool_retry", tool_name=d.name, attempt=attempt, error_kind=exc.kind)
                await asyncio.sleep(pause)
            except TimeoutError:
                raise
            except Exception:
                log.exception("tool_crashed", tool_name=d.name)
                raise ToolCrashed("internal error in the tool") from None

    def _watch_progress(self, p: PreparedCall, started: float, on_progress: OnProgress | None) -> asyncio.Task | None:
        if on_progress is None or p.tool is None:
            return None
        d = p.tool.definition
        after_ms = d.progress_after_ms if d.progress_after_ms is not None else self._progress_after_ms

        async def report() -> None:
            await asyncio.sleep(after_ms / 1000)
            elapsed = int((time.perf_counter() - started) * 1000)
            await on_progress(p, elapsed, d.progress_message)

        return asyncio.create_task(report())

    def _succeeded(self, p: PreparedCall, ctx: TrustedContext, value: Any, run_ms: int, queue_ms: int) -> ToolOutcome:
        d = p.tool.definition  # type: ignore[union-attr]
        variables: dict[str, str] = {}
        if isinstance(value, SetVariables):
            variables = {str(k): str(v) for k, v in value.variables.items()}
            value = value.result
        client_action = value if isinstance(value, ClientAction) else None
        data = msgspec.to_builtins(value) if value is not None else None
        if nests_deeper_than(data, MAX_VALUE_DEPTH):
            raise ResultTooDeep  # its record is redacted by a recursive walk: counted before, not left to the stack
        if client_action is not None:
            content = f"Shown to the customer in the app: {d.name}. Continue the conversation."
        else:
            content = msgspec.json.encode(data).decode() if data is not None else "done (no content)"
            cap = d.max_result_chars or self._max_result_chars
            if len(content) > cap:
                content = content[:cap] + f" [result truncated: {cap} of {len(content)} characters shown]"
        return ToolOutcome(
            call_id=p.call.id, name=d.name, success=True, content=content,
            latency_ms=run_ms, queue_ms=queue_ms, client_action=client_action,
            completes_variable=d.completes_variable, variables=variables,
            job_id=value.job_id if isinstance(value, (JobStarted, ClientAction)) else None,
            record=self._record(p, ctx, success=True, result=data, error=None, latency_ms=run_ms, queue_ms=queue_ms),
        )

    def _failed(self, p: PreparedCall, ctx: TrustedContext, error: ToolError, run_ms: int, queue_ms: int) -> ToolOutcome:
        name = p.tool.name if p.tool else _short(p.call.name, 64)
        # A backstop: validators and handlers are asked to name the field and the rule, never the
        # value; a reason that quotes one anyway (a tenant's handler, a new check) reaches the API,
        # SSE, ce_turns and the dashboard with it replaced.
        values = _sensitive_values(p)
        text = failure_text(name, error, reason=scrub_text(error.reason, values) if values else None)
        return ToolOutcome(
            call_id=p.call.id, name=name, success=False, content=text, error=text,
            error_kind=error.kind, latency_ms=run_ms, queue_ms=queue_ms,
            counts_for_breaker=error.counts_for_breaker and p.tool is not None,
            record=self._record(p, ctx, success=False, result=None, error=text, latency_ms=run_ms, queue_ms=queue_ms,
                                values=values),
        )

    def _record(
        self, p: PreparedCall, ctx: TrustedContext, *, success: bool, result: Any, error: str | None,
        latency_ms: int, queue_ms: int, values: frozenset[str] | None = None,
    ) -> ToolCallRecord:
        """The call's ce_tool_calls row, redacted; `values`: `_sensitive_values(p)` if known."""
        sensitive = p.sensitive
        source = p.arguments if p.tool else (p.call.arguments if isinstance(p.call.arguments, dict) else {})
        values = _sensitive_values(p) if values is None else values
        params = redact(source, sensitive, values)
        return ToolCallRecord(
            id=self._new_id(), tenant_id=ctx.tenant_id, session_id=ctx.session_id,
            message_id=ctx.message_id, tool_name=p.tool.name if p.tool else _short(p.call.name, 64),
            parameters=params, result=redact(result, sensitive, values), success=success, latency_ms=latency_ms,
            queue_ms=queue_ms, error=error, created_at=datetime.now(UTC), trace_id=current_trace_id(),
        )


def _sensitive_values(p: PreparedCall) -> frozenset[str]:
    """The strings a record or failure text of `p` must not repeat: those of its sensitive (or
    secret-looking) arguments, as checked and as the model sent them."""
    sensitive = p.sensitive
    sent = p.call.arguments if isinstance(p.call.arguments, dict) else {}
    return sensitive_values(p.arguments, sensitive) | sensitive_values(sent, sensitive)


def idempotency_key(ctx: TrustedContext, p: PreparedCall) -> str:
    """Stable for the same call of the same message, also when a retried message re-runs the
    turn and the model names its call differently: the client's message id, the tool and its
    arguments (canonical JSON), or only those its definition's `idempotency_arguments` names (a
    re-run's model may word a free-text argument differently). The tenant and session are in the
    digest: a message id is the client's, unique within its session only, and two contacts'
    first messages may both be "1"."""
    named = p.tool.definition.idempotency_arguments if p.tool is not None else None
    arguments = p.arguments if named is None else {k: v for k, v in p.arguments.items() if k in named}
    digest = hashlib.sha256(b"\0".join((
        ctx.tenant_id.encode(), ctx.session_id.encode(), p.call.name.encode(),
        msgspec.json.encode(arguments, order="sorted"),
    ))).hexdigest()[:24]
    return f"{ctx.idempotency_key or ctx.message_id or ''}:{digest}"


def _limit_error(tool: CompiledTool, session: SessionToolState, earlier_in_batch: int) -> ToolError | None:
    d = tool.definition
    if earlier_in_batch and d.completes_variable is not None:
        # One-shot (seed 000's dedup): the session state cannot know yet that the earlier call of
        # this batch will complete it, so the batch itself refuses the second.
        return PolicyDenied(
            "already called for this in this step: it is done once per conversation",
            advice="Use the result of the first call; do not call it again.",
        )
    in_turn = session.turn_calls.get(d.name, 0) + earlier_in_batch
    in_session = session.calls.get(d.name, 0) + earlier_in_batch
    if d.max_calls_per_turn is not None and in_turn >= d.max_calls_per_turn:
        return PolicyDenied(
            f"called too often: at most {d.max_calls_per_turn} call(s) per message",
            advice="Use the results you already have; do not call it again for this message.",
        )
    if d.max_calls_per_session is not None and in_session >= d.max_calls_per_session:
        return PolicyDenied(
            f"called too often: at most {d.max_calls_per_session} call(s) per conversation",
            advice="Do not call it again in this conversation; help the customer another way.",
        )
    return None


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


async def _check_output(tool: CompiledTool, value: Any, sensitive: frozenset[str]) -> None:
    """A declared output schema is a contract: a result that breaks it is a failure, in-band.
    The problems never quote a value of the result under a sensitive or secret-looking name (the
    validator describes those by their rule; a string that still appears, in a sibling field or
    a rule on the whole result, is scrubbed as a failure text's argument values are in `_failed`).
    `sensitive`: the call's names (`PreparedCall.sensitive`: the tool's, and those it was held with)."""
    validator = tool.output_validator
    if validator is None or isinstance(value, (ClientAction, JobStarted)):
        return
    result = msgspec.to_builtins(value.result if isinstance(value, SetVariables) else value)
    if nests_deeper_than(result, MAX_VALUE_DEPTH):
        return  # not walked by the validator: `Executor._succeeded` refuses it, whatever its schema
    problems = await validator.problems(result)
    if problems:
        values = sensitive_values(result, sensitive)
        raise OutputContractBroken(
            scrub_text("result does not match its declared output schema: " + "; ".join(problems[:3]), values),
            advice="Do not rely on this result; tell the customer you cannot confirm this right now.",
        )


class ResultTooDeep(Exception):
    """A handler's result nests more than MAX_VALUE_DEPTH levels: `execute` makes it an in-band
    ToolCrashed, as for a result that cannot be encoded."""


def scoped_args(model_args: dict[str, Any], trusted_scope: dict[str, Any], *, protected: frozenset[str]) -> dict[str, Any]:
    """Seed 001's overwrite semantics: protected keys never come from the model; trusted wins.

    Stripped at every depth: a nested `{"filter": {"account_id": ...}}` would otherwise reach a
    JSON body, and a backend may read it there; and in every spelling (`Account_ID`, `ACCOUNTID`,
    `account-id`: services.tools.model.is_protected), which a case-insensitive backend reads as the
    same key. Raises RecursionError for absurdly deep input."""
    clean = _without_keys(model_args, protected)
    return {**clean, **trusted_scope}


def _unfilled_protected(schema: dict[str, Any], protected: frozenset[str], scope: dict[str, Any]) -> str | None:
    """The first top-level required parameter that is protected (in any spelling `is_protected`
    accepts, so the model's value is stripped) and that the trusted scope holds no value for under
    its exact name, as a declared property (the only way it is merged): no call of the tool can be
    valid. Such a schema is refused on save (services.gateway.bodies: `AccountId` for
    `account_id`) but may be a row stored before that, an MCP server's tool, or a tool's own
    `protected` name. Without this the validator reports it missing and the model is told to ask
    the customer for it, who cannot give it (the engine would drop it again). None when every such
    name is filled."""
    required = schema.get("required")
    if not isinstance(required, list):
        return None
    forms = protected_forms(protected)
    properties = schema.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    for name in required:
        if is_protected(name, forms) and (name not in declared or scope.get(name) is None):
            return name
    return None


def declared_only(args: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The arguments the schema declares, when it says nothing of others: the model may send
    more (a binding's backend names directly, past the checks on the declared names; a second
    `api_key` for a webhook's query; `role` into a JSON body), and a tool gets only what its
    owner described. A schema that says `additionalProperties` decides for itself (false: the
    model is told of an unknown argument; true or a schema: they are passed on)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or "additionalProperties" in schema:
        return args
    return {k: v for k, v in args.items() if k in properties}


def _without_keys(value: Any, keys: frozenset[str]) -> Any:
    """`value` without the `keys` at any depth, in every spelling of them `is_protected` accepts
    (`Account_ID`, `TENANTID`, `account-id`): a backend that binds names case-insensitively reads
    those as the protected key itself."""
    return _without_forms(value, protected_forms(keys))


def _without_forms(value: Any, forms: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: _without_forms(v, forms) for k, v in value.items() if not is_protected(k, forms)}
    if isinstance(value, list):
        return [_without_forms(v, forms) for v in value]
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode() if _encodable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _encodable(value: Any) -> bool:
    try:
        msgspec.json.encode(value)
        return True
    except (TypeError, msgspec.EncodeError):
        return False
