"""Seed 000's `buildToolSet`: which tools the model is offered for this message.

The model never sees a tool it cannot use: disabled tools, tools outside the agent allowlist,
tools whose breaker is open, one-shot tools already completed this session and tools at their
per-message or per-conversation call limit are left out; when an intent is detected only its
tools are offered. Nor does it see a protected argument
(tenant/account keys, a tool's own `protected` names): the trusted scope supplies those.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from services.botconfig import BotConfig
from services.llm.port import ToolSpec
from services.tools.registry import Catalog, CompiledTool

BREAKER_THRESHOLD = 3  # seed 000: the third failure removes the tool for the rest of the session

_WORD_RE = re.compile(r"[\w']+")


class SessionToolState(msgspec.Struct, frozen=True, kw_only=True):
    """What gating needs to know about the session."""

    variables: Mapping[str, str] = {}
    breakers: Mapping[str, int] = {}  # tool name -> failures this session
    #: tool name -> calls this session that ran (limits); a call refused before its tool did
    #: anything (invalid arguments, not allowed, declined, never out of the queue) is not counted
    calls: Mapping[str, int] = {}
    turn_calls: Mapping[str, int] = {}  # tool name -> calls in the current turn that ran, as `calls`


def breaker_open(breakers: Mapping[str, int], tool_name: str) -> bool:
    return breakers.get(tool_name, 0) >= BREAKER_THRESHOLD


def is_completed(tool: CompiledTool, variables: Mapping[str, str]) -> bool:
    var = tool.definition.completes_variable
    return var is not None and variables.get(var, "") not in ("", "false")


def _words(text: str) -> str:
    return " ".join(_WORD_RE.findall(text.lower()))


def detect_intent(config: BotConfig, text: str) -> str | None:
    """The configured intent whose phrases best match `text` (most phrase hits), or None."""
    # Space-padded so a phrase matches whole words only: "hi" must not fire inside "this".
    lowered = f" {_words(text)} "
    best: tuple[int, str] | None = None
    for name, intent in sorted(config.intents.items()):
        hits = sum(1 for p in intent.phrases if _words(p) and f" {_words(p)} " in lowered)
        if hits and (best is None or hits > best[0]):
            best = (hits, name)
    return best[1] if best else None


def gate_reason(
    tool: CompiledTool, config: BotConfig, session: SessionToolState, intent: str | None = None
) -> str | None:
    """Why `tool` may not run in this session right now, or None when it may.

    The same rules gate the offer (build_tool_set) and the call (executor policy), so a model that
    names a tool it was not offered is refused for the same reason. `intent` is the turn's
    detected intent: given one that is configured, a tool that is neither named by it nor tagged
    with it is refused, as build_tool_set leaves it out of the offer (which filters by intent
    itself, with the intent's names as a set made once per turn, and calls this without one).
    """
    d = tool.definition
    if not d.enabled:
        return "this tool is disabled"
    if config.allowlist is not None and d.name not in config.allowlist:
        return "this tool is not in the agent's allowlist"
    if breaker_open(session.breakers, d.name):
        return "this tool failed too often in this conversation and is switched off for it"
    if d.mutability == "write" and not config.allow_writes:
        return "this assistant may not change records"
    if is_completed(tool, session.variables):
        return "this was already done in this conversation"
    if d.max_calls_per_turn is not None and session.turn_calls.get(d.name, 0) >= d.max_calls_per_turn:
        return (f"this tool was used as often as allowed for this message: at most {d.max_calls_per_turn} "
                "call(s) per message")
    if d.max_calls_per_session is not None and session.calls.get(d.name, 0) >= d.max_calls_per_session:
        return "this tool was used as often as allowed in this conversation"
    if intent is not None:
        wanted = config.intents.get(intent)
        if wanted is not None and d.name not in wanted.tools and intent not in d.intents:
            return f"this tool is not offered for what the customer asked ('{intent}')"
    return None


def build_tool_set(
    config: BotConfig, intent: str | None, session: SessionToolState, catalog: Catalog
) -> list[CompiledTool]:
    """The tools to offer for one message, in catalog order.

    With a detected intent: the tools the intent names plus tools tagged with that intent.
    With none detected (or no intents configured): every tool that passes gating.
    """
    wanted: set[str] | None = None
    if intent is not None and intent in config.intents:
        wanted = set(config.intents[intent].tools)
    offered = []
    for tool in catalog:
        if wanted is not None and tool.name not in wanted and intent not in tool.definition.intents:
            continue
        if gate_reason(tool, config, session) is None:
            offered.append(tool)
    return offered


def tool_specs(tools: list[CompiledTool]) -> list[ToolSpec]:
    """LLM tool definitions of the compiled tools: each made once, when its tool was compiled
    (`CompiledTool.spec`: its parameter schema without its protected keys)."""
    return [t.spec for t in tools]
