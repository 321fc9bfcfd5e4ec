"""The local model's brain: a deterministic, rule-based stand-in for Claude. Pure: no I/O, no clock.

`respond(request, today=...)` takes an `LLMRequest` (system, messages, tools) and returns the
assistant's content blocks, a stop reason and a token estimate. `app.local_model` serves
it over the Anthropic Messages API; nothing here knows about HTTP or the SDK.

Rules, applied to the last user message:

* Tool results (the message holds `tool_result` blocks): a text reply that uses them. A success
  is summarised in one sentence from the JSON result, top-level scalar fields flattened as
  `key: value` ("Order 12345: status: shipped, eta: 2026-12-05."); a failure is relayed the way
  its advice asks ("Tool 'check_order' failed: upstream timeout. Inform the customer you cannot
  retrieve their order right now." -> "I'm sorry, I can't retrieve your order right now.").
  A tool result never leads to another tool call, so the engine's tool loop always ends, except
  under the `/loop` marker below.
* Text, markers (each on a line of its own, leading spaces ignored):
    - `/call <tool> <json object>`: emit exactly these tool calls, one `tool_use` block per line,
      in order, whether or not `<tool>` is offered (tests drive the unknown-tool path this way).
      `<json object>` may be omitted (`{}`). A line whose JSON does not parse, or is not an
      object, makes the whole reply a text saying which line could not be parsed.
    - `/loop` together with `/call` lines: after every round of tool results in this turn, emit
      the same calls again (fresh ids) instead of a reply. The engine's 5-round cap is what stops
      it; this exists to test that cap.
    - `[[HANDOFF]]` anywhere, or a line `/handoff`: reply with a text containing `[[HANDOFF]]`.
    - `/fault <name>` is read by the server (`app.local_model`), not here; the rules
      ignore the line.
* Text, natural language:
    - mentions a human, agent, person, representative or operator and `escalate_to_human` is
      offered: call it with `reason` = the message text;
    - otherwise pick the offered tool whose name (weight 2) and description (weight 1) share the
      most words with the text (ties: by name); it needs a name word or two description words in
      common. Its arguments are extracted from the text by parameter name, type, format and
      description (ids and numbers, emails, phone numbers, "my name is ...", ISO or relative
      dates and times, the message itself for `query`/`question`/`reason`/...). If a required one
      cannot be filled, the reply asks for it instead of calling the tool;
    - nothing matches: a short friendly reply, in the persona of a system prompt that says
      "You are X".
* `tool_choice == "none"`: never a tool call; the text rules above still apply.

Tool-use ids are `toolu_` + a hash of the conversation position (message count, block index,
last message), so a replayed conversation gets the same ids. They are not unique across sessions
that send identical messages: do not use them as global keys.

Relative dates ("tomorrow at 10", "on friday") are resolved against `today`, which the caller
passes (the server reads its clock); without it they count as missing. A bare hour from 1 to 7
without am/pm is taken as afternoon (business hours). Token counts are estimates: ceil(chars / 4).
"""

from __future__ import annotations

import hashlib
import re
from datetime import date, timedelta
from typing import Any, Literal

import msgspec

from services.llm.port import (
    ChatMessage,
    ContentBlock,
    LLMRequest,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
)

HANDOFF_MARKER = "[[HANDOFF]]"
LOOP_MARKER = "/loop"
CALL_PREFIX = "/call"
ESCALATE_TOOL = "escalate_to_human"

StopReason = Literal["end_turn", "tool_use"]

_json_encode = msgspec.json.Encoder(order="sorted").encode
_json_decode = msgspec.json.decode


class RuleReply(msgspec.Struct, frozen=True, kw_only=True):
    """What the model answers: content blocks, why it stopped, and a token estimate."""

    content: list[ContentBlock]
    stop_reason: StopReason
    usage: Usage


class CallLine(msgspec.Struct, frozen=True, kw_only=True):
    """One parsed `/call <tool> <json>` line."""

    name: str
    input: dict[str, Any]


class CallLineError(msgspec.Struct, frozen=True, kw_only=True):
    """A `/call` line that could not be parsed: the line and why."""

    line: str
    problem: str


# --------------------------------------------------------------------------------------------
# entry point


def respond(request: LLMRequest, *, today: date | None = None) -> RuleReply:
    """Answer `request` by the rules in the module docstring.

    Returns a RuleReply; never raises for any content of the conversation.
    """
    content, stop_reason = _decide(request, today)
    return RuleReply(
        content=content,
        stop_reason=stop_reason,
        usage=Usage(
            input_tokens=estimate_request_tokens(request),
            output_tokens=estimate_content_tokens(content),
        ),
    )


def _decide(request: LLMRequest, today: date | None) -> tuple[list[ContentBlock], StopReason]:
    messages = request.messages
    tools_allowed = request.tool_choice != "none"
    last_user = _last_user_index(messages)
    if last_user is None:
        return _text(_friendly(request.system, "")), "end_turn"
    message = messages[last_user]
    results = [b for b in message.content if isinstance(b, ToolResultBlock)]
    if results:
        if tools_allowed:
            repeat = _loop_calls(messages, last_user)
            if repeat:
                return _tool_uses(repeat, messages), "tool_use"
        uses = _tool_uses_before(messages, last_user)
        return _text(_reply_to_results(results, uses)), "end_turn"

    text = _text_of(message)
    if tools_allowed:
        calls = parse_call_lines(text)
        if isinstance(calls, CallLineError):
            return _text(
                f"I could not parse the line `{_clip(calls.line, 120)}`: {calls.problem}. "
                "Write it as /call <tool> <json object>."
            ), "end_turn"
        if calls:
            return _tool_uses(calls, messages), "tool_use"
    if _asks_handoff(text):
        return _text(f"Let me connect you with a member of our team. {HANDOFF_MARKER}"), "end_turn"
    natural = _natural_text(text)
    if tools_allowed and request.tools:
        decided = _decide_tool(natural, request.tools, today)
        if decided is not None:
            if isinstance(decided, CallLine):
                return _tool_uses([decided], messages), "tool_use"
            return _text(decided), "end_turn"
    return _text(_friendly(request.system, natural)), "end_turn"


# --------------------------------------------------------------------------------------------
# token estimates


def estimate_tokens(text: str) -> int:
    """About four characters per token, rounded up; at least 1 for any text."""
    return (len(text) + 3) // 4


def estimate_request_tokens(request: LLMRequest) -> int:
    """The input-token estimate of a whole request (system, messages, tools); at least 1."""
    chars = len(request.system)
    for message in request.messages:
        chars += _content_chars(message.content)
    for tool in request.tools:
        chars += len(tool.name) + len(tool.description) + len(_json_encode(tool.input_schema))
    return max(1, (chars + 3) // 4)


def estimate_content_tokens(content: list[ContentBlock]) -> int:
    """The output-token estimate of content blocks; at least 1, as the real API reports."""
    return max(1, (_content_chars(content) + 3) // 4)


def _content_chars(content: list[ContentBlock]) -> int:
    chars = 0
    for block in content:
        if isinstance(block, TextBlock):
            chars += len(block.text)
        elif isinstance(block, ToolUseBlock):
            chars += len(block.name) + len(_json_encode(block.input))
        else:
            chars += len(block.content)
    return chars


# --------------------------------------------------------------------------------------------
# conversation helpers


def _last_user_index(messages: list[ChatMessage]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return i
    return None


def _text_of(message: ChatMessage) -> str:
    return "\n".join(b.text for b in message.content if isinstance(b, TextBlock))


def _text(text: str) -> list[ContentBlock]:
    return [TextBlock(text=text)]


def _tool_uses(calls: list[CallLine], messages: list[ChatMessage]) -> list[ContentBlock]:
    position = f"{len(messages)}|".encode() + (_json_encode(messages[-1]) if messages else b"")
    blocks: list[ContentBlock] = []
    for index, call in enumerate(calls):
        digest = hashlib.blake2b(position + f"|{index}".encode(), digest_size=12).hexdigest()
        blocks.append(ToolUseBlock(id=f"toolu_{digest}", name=call.name, input=call.input))
    return blocks


def _tool_uses_before(messages: list[ChatMessage], user_index: int) -> dict[str, ToolUseBlock]:
    """The tool_use blocks of the assistant message just before `user_index`, by id."""
    for i in range(user_index - 1, -1, -1):
        if messages[i].role == "assistant":
            return {b.id: b for b in messages[i].content if isinstance(b, ToolUseBlock)}
    return {}


def _loop_calls(messages: list[ChatMessage], user_index: int) -> list[CallLine]:
    """Under `/loop`, the /call lines of the message that opened this turn; else []."""
    for i in range(user_index - 1, -1, -1):
        message = messages[i]
        if message.role != "user":
            continue
        if any(isinstance(b, ToolResultBlock) for b in message.content):
            continue
        text = _text_of(message)
        if not any(line.strip() == LOOP_MARKER for line in text.splitlines()):
            return []
        calls = parse_call_lines(text)
        return calls if isinstance(calls, list) else []
    return []


def _natural_text(text: str) -> str:
    """The message without marker lines (lines starting with '/')."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("/")]
    return " ".join(" ".join(lines).split())


def _asks_handoff(text: str) -> bool:
    if HANDOFF_MARKER in text:
        return True
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "/handoff" or stripped.startswith("/handoff "):
            return True
    return False


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


# --------------------------------------------------------------------------------------------
# /call lines

_CALL_RE = re.compile(r"^/call(?:\s+(?P<name>\S+))?(?:\s+(?P<json>.*\S))?\s*$")


def parse_call_lines(text: str) -> list[CallLine] | CallLineError:
    """The `/call <tool> <json>` lines of `text`, in order ([] when there are none).

    Returns CallLineError for the first line that names no tool or whose JSON is not an object.
    """
    calls: list[CallLine] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not (line == CALL_PREFIX or line.startswith((CALL_PREFIX + " ", CALL_PREFIX + "\t"))):
            continue
        match = _CALL_RE.match(line)
        if match is None or not match.group("name"):
            return CallLineError(line=line, problem="it names no tool")
        payload = match.group("json")
        if payload is None:
            calls.append(CallLine(name=match.group("name"), input={}))
            continue
        try:
            value = _json_decode(payload)
        except msgspec.DecodeError as exc:
            return CallLineError(line=line, problem=f"the arguments are not valid JSON ({exc})")
        if not isinstance(value, dict):
            return CallLineError(line=line, problem="the arguments must be a JSON object")
        calls.append(CallLine(name=match.group("name"), input=value))
    return calls


# --------------------------------------------------------------------------------------------
# choosing a tool from natural text

_STOPWORD_TEXT = """a an the and or but if of to for from by with without in on at as is are was were be been
    being it its this that these those i me my mine you your yours we us our they them their he
    she his her what which who whom how when where why can could would should will shall may
    might must do does did done have has had please pls thanks thank hi hello hey want need like
    get got use used uses using when asks ask customer customers user users contact tool call
    called via some any all about up out into just also so not no yes ok okay there here than
    then now too very much more most one s t"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())

_HUMAN_WORDS = frozenset({"human", "agent", "person", "representative", "operator"})
_GREETINGS = frozenset({"hi", "hello", "hey", "hiya", "howdy", "greetings", "morning", "evening"})
_WORD_RE = re.compile(r"[a-z0-9]+")


def _stem(word: str) -> str:
    if len(word) > 5 and word.endswith("ing"):
        return word[:-3]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith("ed"):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _words(text: str) -> set[str]:
    return {
        _stem(w)
        for w in _WORD_RE.findall(text.lower())
        if len(w) > 1 and w not in _STOPWORDS and not any(c.isdigit() for c in w)
    }


def _score(tool: ToolSpec, words: set[str]) -> tuple[int, int]:
    """(name-word matches, description-word matches) between a tool and the text's words."""
    name_words = _words(tool.name.replace("_", " ").replace("-", " "))
    props = tool.input_schema.get("properties")
    param_words = _words(" ".join(props).replace("_", " ")) if isinstance(props, dict) else set()
    desc_words = _words(tool.description) | param_words
    return len(words & name_words), len(words & (desc_words - name_words))


def _decide_tool(text: str, tools: list[ToolSpec], today: date | None) -> CallLine | str | None:
    """A call, a question for a missing argument, or None when no offered tool fits."""
    words_raw = set(_WORD_RE.findall(text.lower()))
    words = _words(text)
    by_name = {t.name: t for t in tools}
    escalate = by_name.get(ESCALATE_TOOL)
    if escalate is not None and words_raw & (_HUMAN_WORDS | {w + "s" for w in _HUMAN_WORDS}):
        args, missing = extract_arguments(escalate.input_schema, text, today=today)
        props = escalate.input_schema.get("properties") or {}
        if "reason" in props or not props:
            args["reason"] = text
            missing = [m for m in missing if m != "reason"]
        if not missing:
            return CallLine(name=ESCALATE_TOOL, input=args)
        return _ask_for(escalate, missing)
    best: tuple[int, str] | None = None
    for tool in tools:
        name_hits, desc_hits = _score(tool, words)
        if name_hits == 0 and desc_hits < 2:
            continue
        score = 2 * name_hits + desc_hits
        if best is None or score > best[0] or (score == best[0] and tool.name < best[1]):
            best = (score, tool.name)
    if best is None:
        return None
    tool = by_name[best[1]]
    args, missing = extract_arguments(tool.input_schema, text, today=today)
    if missing:
        return _ask_for(tool, missing)
    return CallLine(name=tool.name, input=args)


def _ask_for(tool: ToolSpec, missing: list[str]) -> str:
    props = tool.input_schema.get("properties") or {}
    wanted = [_describe_param(name, props.get(name) or {}) for name in missing]
    listed = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " and " + wanted[-1]
    return f"I can help with that. Could you tell me {listed}?"


def _describe_param(name: str, prop: dict[str, Any]) -> str:
    description = prop.get("description")
    if isinstance(description, str) and 0 < len(description) <= 60:
        text = description.strip().rstrip(".")
        if text.split(" ", 1)[0].lower() in ("the", "a", "an", "your"):
            return text[0].lower() + text[1:]
    return "your " + name.replace("_", " ").replace("-", " ")


# --------------------------------------------------------------------------------------------
# argument extraction

_EMAIL_RE = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_ISO_RE = re.compile(
    r"\b(?P<date>\d{4}-\d{2}-\d{2})(?:(?:T|\s+(?:at\s+)?)(?P<h>\d{1,2}):(?P<m>\d{2})(?::\d{2})?)?\b"
)
_PHONE_RE = re.compile(r"(?<![\w+])(\+?\d[\d\s().-]{5,}\d)(?!\w)")
_NAME_RE = re.compile(
    r"(?i:\bmy name is|\bmy name's|\bname is|\bi am|\bi'm|\bthis is|\bcall me)\s+"
    r"(?P<name>[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*){0,3})"
)
_TIME_MERIDIEM_RE = re.compile(
    r"\b(?P<h>\d{1,2})(?::(?P<m>\d{2}))?\s*(?P<ap>am|pm|a\.m\.|p\.m\.)", re.IGNORECASE
)
_TIME_AT_RE = re.compile(
    r"\bat\s+(?P<h>\d{1,2})(?::(?P<m>\d{2}))?\b(?!\s*(?:-|/|\d))", re.IGNORECASE
)
_TIME_COLON_RE = re.compile(r"\b(?P<h>\d{1,2}):(?P<m>\d{2})\b")
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_RELATIVE_RE = re.compile(
    r"\b(?P<rel>day after tomorrow|tomorrow|today|tonight|"
    r"(?:on\s+|next\s+|this\s+)?(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday))\b",
    re.IGNORECASE,
)
_FREE_TEXT_NAMES = (
    "query",
    "question",
    "search",
    "reason",
    "message",
    "text",
    "notes",
    "note",
    "summary",
    "details",
    "detail",
    "topic",
    "comment",
    "comments",
    "request",
    "issue",
    "problem",
    "description",
    "content",
    "body",
    "prompt",
    "subject",
)
_ID_SUFFIXES = ("id", "number", "no", "num", "code", "ref", "reference")


def extract_arguments(
    schema: dict[str, Any], text: str, *, today: date | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Fill a tool's parameters from a user's text.

    Returns (arguments found, in schema order; names of required parameters not found).
    """
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = [r for r in schema.get("required") or () if isinstance(r, str)]
    args: dict[str, Any] = {}
    for name, prop in props.items():
        prop = prop if isinstance(prop, dict) else {}
        value = _extract_one(name, prop, text, today)
        if value is not None:
            args[name] = value
    return args, [r for r in required if r not in args]


def _extract_one(name: str, prop: dict[str, Any], text: str, today: date | None) -> Any:
    lowered = name.lower()
    parts = [p for p in re.split(r"[_\-\s]+|(?<=[a-z])(?=[A-Z])", name) if p]
    parts_l = [p.lower() for p in parts]
    kind = prop.get("type")
    fmt = prop.get("format")
    description = str(prop.get("description") or "").lower()
    enum = prop.get("enum")
    if isinstance(enum, list) and enum:
        lowered_text = text.lower()
        for option in enum:
            if isinstance(option, str) and re.search(
                rf"\b{re.escape(option.lower())}\b", lowered_text
            ):
                return option
        return None
    if kind == "boolean" or kind == "object" or kind == "array":
        return None
    if "email" in lowered or fmt == "email":
        match = _EMAIL_RE.search(text)
        return match.group(0) if match else None
    if any(p in ("phone", "mobile", "tel", "telephone", "cell") for p in parts_l):
        return _find_phone(text)
    temporal = _temporal_kind(parts_l, fmt, description)
    if temporal is not None:
        return _find_when(text, temporal, today)
    if "name" in parts_l and not any(p in _ID_SUFFIXES for p in parts_l):
        return _find_name(text, parts_l)
    if any(p in _FREE_TEXT_NAMES for p in parts_l):
        return text.strip() or None
    if parts_l and parts_l[-1] in _ID_SUFFIXES or kind in ("integer", "number"):
        token = _find_id(text, [p for p in parts_l if p not in _ID_SUFFIXES])
        return _as_type(token, kind)
    return _find_labelled(text, parts_l)


def _temporal_kind(parts: list[str], fmt: Any, description: str) -> str | None:
    """'datetime', 'date', 'time' or None (not a temporal parameter)."""
    if fmt == "date-time" or "datetime" in parts:
        return "datetime"
    if fmt in ("date", "time"):
        return fmt
    names = set(parts)
    has_date = bool(names & {"date", "day"})
    has_time = "time" in names
    if has_date and has_time:
        return "datetime"
    if has_date:
        return "date"
    if has_time:
        return "datetime" if any(k in description for k in ("date", "day", "iso")) else "time"
    if names and names <= {"when", "slot", "start", "starts", "at", "scheduled", "begin", "begins"}:
        return "datetime"
    return None


def _find_phone(text: str) -> str | None:
    cleaned = _ISO_RE.sub(" ", _EMAIL_RE.sub(" ", text))
    for match in _PHONE_RE.finditer(cleaned):
        candidate = match.group(1).strip()
        if sum(c.isdigit() for c in candidate) >= 7:
            return candidate
    return None


def _find_name(text: str, parts: list[str]) -> str | None:
    match = _NAME_RE.search(text)
    if match is None:
        return None
    words = match.group("name").split()
    if "first" in parts or "given" in parts:
        return words[0]
    if "last" in parts or "family" in parts or "surname" in parts:
        return words[-1] if len(words) > 1 else None
    return " ".join(words)


def _find_when(text: str, kind: str, today: date | None) -> str | None:
    day: date | None = None
    hour: int | None = None
    minute = 0
    iso = _ISO_RE.search(text)
    if iso is not None:
        try:
            day = date.fromisoformat(iso.group("date"))
        except ValueError:
            day = None
        if iso.group("h") is not None:
            hour, minute = int(iso.group("h")), int(iso.group("m"))
    if day is None and today is not None:
        day = _relative_day(text, today)
    if hour is None:
        hour, minute = _find_time(_ISO_RE.sub(" ", text))
    if hour is not None and not (0 <= hour <= 23 and 0 <= minute <= 59):
        hour = None
    if kind == "date":
        return day.isoformat() if day else None
    if kind == "time":
        return f"{hour:02d}:{minute:02d}" if hour is not None else None
    if day is None:
        return None
    if hour is None:
        return day.isoformat()
    return f"{day.isoformat()}T{hour:02d}:{minute:02d}:00"


def _relative_day(text: str, today: date) -> date | None:
    match = _RELATIVE_RE.search(text)
    if match is None:
        return None
    rel = match.group("rel").lower()
    if rel in ("today", "tonight"):
        return today
    if rel == "tomorrow":
        return today + timedelta(days=1)
    if rel == "day after tomorrow":
        return today + timedelta(days=2)
    weekday = _WEEKDAYS.index(rel.split()[-1])
    ahead = (weekday - today.weekday()) % 7 or 7
    return today + timedelta(days=ahead)


def _find_time(text: str) -> tuple[int | None, int]:
    match = _TIME_MERIDIEM_RE.search(text)
    if match is not None:
        hour, minute = int(match.group("h")), int(match.group("m") or 0)
        pm = match.group("ap").lower().startswith("p")
        if hour == 12:
            hour = 12 if pm else 0
        elif pm:
            hour += 12
        return hour, minute
    match = _TIME_COLON_RE.search(text) or _TIME_AT_RE.search(text)
    if match is not None:
        hour, minute = int(match.group("h")), int(match.group("m") or 0)
        if 1 <= hour <= 7:  # "at 3" in a shop means the afternoon
            hour += 12
        return hour, minute
    return None, 0


_TOKEN = r"#?\s*(?P<tok>[A-Za-z0-9][A-Za-z0-9_-]*)"


def _find_id(text: str, subject: list[str]) -> str | None:
    """A token with a digit, preferably right after the subject word ("order 12345")."""
    if subject:
        words = r"[\s_-]+".join(re.escape(w) for w in subject)
        pattern = re.compile(
            rf"\b{words}s?\b\s*(?:(?:{'|'.join(_ID_SUFFIXES)})\b\.?)?\s*(?:is\b|:|=)?\s*{_TOKEN}",
            re.IGNORECASE,
        )
        for match in pattern.finditer(text):
            if any(c.isdigit() for c in match.group("tok")):
                return match.group("tok")
    cleaned = _ISO_RE.sub(" ", _EMAIL_RE.sub(" ", text))
    cleaned = _TIME_COLON_RE.sub(" ", cleaned)
    match = re.search(r"#\s*(\w*\d\w*)", cleaned)
    if match is not None:
        return match.group(1)
    match = re.search(r"(?<![\w.+-])([A-Za-z]*\d[\w-]*)", cleaned)
    if match is not None and sum(c.isdigit() for c in match.group(1)) >= 3:
        return match.group(1)
    return None


def _as_type(token: str | None, kind: Any) -> Any:
    if token is None:
        return None
    if kind == "integer":
        return int(token) if token.isdigit() else None
    if kind == "number":
        try:
            return int(token) if token.isdigit() else float(token)
        except ValueError:
            return None
    return token


def _find_labelled(text: str, parts: list[str]) -> str | None:
    """A generic string parameter: `<name> is <value>` or `<name>: <value>` in the text."""
    if not parts:
        return None
    label = r"[\s_-]+".join(re.escape(p) for p in parts)
    match = re.search(rf"\b{label}\s*(?:is|:|=)\s*(\"[^\"]+\"|[^\s,;]+)", text, re.IGNORECASE)
    if match is None:
        return None
    return match.group(1).strip('"').rstrip(".") or None


# --------------------------------------------------------------------------------------------
# replies to tool results

_FAILURE_RE = re.compile(
    r"^Tool '(?P<name>[^']*)' failed: (?P<reason>.*?)(?:\.\s+(?P<advice>.*))?$", re.DOTALL
)
_TELL_RE = re.compile(
    r"\b(?:inform|tell|let)\s+the\s+(?:customer|contact|user)(?:\s+know)?\s+(?:that\s+)?(?P<what>.+)",
    re.IGNORECASE,
)
_ASK_RE = re.compile(
    r"\bask\s+(?:the\s+(?:customer|contact|user)\s+|them\s+)?(?P<how>for|to|whether|if|how|what|which|when)\s+(?P<what>.+)",
    re.IGNORECASE,
)
_OFFER_RE = re.compile(r"\boffer\b", re.IGNORECASE)
_TRANSIENT_RE = re.compile(
    r"time(?:d)?\s*out|timeout|unavailable|unreachable|temporar|overload|deadline", re.IGNORECASE
)
_PERSON_RE = re.compile(
    r"\b(you cannot|you can't|you can not|you could not|you couldn't|you are unable|you were unable|"
    r"you are|you were|you will|you|your|yours|the customer's|the customer|their|theirs|they are|"
    r"they were|they|them|themselves)\b",
    re.IGNORECASE,
)
_PERSON_MAP = {
    "you cannot": "I can't",
    "you can't": "I can't",
    "you can not": "I can't",
    "you could not": "I couldn't",
    "you couldn't": "I couldn't",
    "you are unable": "I'm unable",
    "you were unable": "I was unable",
    "you are": "I'm",
    "you were": "I was",
    "you will": "I'll",
    "you": "I",
    "your": "my",
    "yours": "mine",
    "the customer's": "your",
    "the customer": "you",
    "their": "your",
    "theirs": "yours",
    "they are": "you are",
    "they were": "you were",
    "they": "you",
    "them": "you",
    "themselves": "yourself",
}


def _to_customer(text: str) -> str:
    """Rewrite advice addressed to the bot about the customer as words to the customer."""
    return _PERSON_RE.sub(lambda m: _PERSON_MAP[m.group(0).lower()], text)


def _reply_to_results(results: list[ToolResultBlock], uses: dict[str, ToolUseBlock]) -> str:
    sentences: list[str] = []
    for result in results:
        use = uses.get(result.tool_use_id)
        name = use.name if use is not None else "the tool"
        tool_input = use.input if use is not None else {}
        if result.is_error:
            sentence = relay_error(name, result.content)
        else:
            sentence = summarise_result(name, tool_input, result.content)
        if sentence not in sentences:
            sentences.append(sentence)
    return " ".join(sentences)


def summarise_result(tool_name: str, tool_input: dict[str, Any], content: str) -> str:
    """One sentence from a successful tool result.

    A JSON object is flattened as `key: value` for its top-level scalar fields (lists counted,
    nested objects left out), headed by the id the tool was called with ("Order 12345: ...").
    """
    if tool_name == ESCALATE_TOOL:
        return "I've asked a member of our team to take over; they will be with you shortly."
    subject, subject_value = _subject(tool_name, tool_input)
    try:
        value = _json_decode(content) if content.strip() else None
    except msgspec.DecodeError:
        text = " ".join(content.split())
        return f"{subject}: {_clip(text, 300)}." if text else f"{subject}: done."
    if isinstance(value, dict):
        fields = _flatten(value, skip=subject_value)
        return f"{subject}: {', '.join(fields)}." if fields else f"{subject}: done."
    if isinstance(value, list):
        if not value:
            return f"{subject}: no results."
        items = []
        for item in value[:3]:
            if isinstance(item, dict):
                items.append("; ".join(_flatten(item, skip=None, limit=4)) or "(details)")
            else:
                items.append(_scalar(item))
        count = f"{len(value)} result" + ("" if len(value) == 1 else "s")
        return f"{subject}: {count} - " + " | ".join(items) + "."
    if value is None:
        return f"{subject}: done."
    return f"{subject}: {_clip(_scalar(value), 300)}."


def _subject(tool_name: str, tool_input: dict[str, Any]) -> tuple[str, str | None]:
    for key, value in tool_input.items():
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            continue
        parts = [p for p in re.split(r"[_\-\s]+", key.lower()) if p]
        if parts and parts[-1] in _ID_SUFFIXES:
            head = [p for p in parts if p not in _ID_SUFFIXES]
            label = " ".join(head) if head else tool_name.replace("_", " ")
            return f"{label[:1].upper()}{label[1:]} {value}", str(value)
    label = tool_name.replace("_", " ").replace("-", " ")
    return label[:1].upper() + label[1:], None


def _flatten(value: dict[str, Any], *, skip: str | None, limit: int = 8) -> list[str]:
    fields = []
    for key, item in value.items():
        if item is None or isinstance(item, dict):
            continue
        if isinstance(item, list):
            fields.append(f"{key}: {len(item)} item" + ("" if len(item) == 1 else "s"))
        else:
            rendered = _scalar(item)
            if skip is not None and rendered == skip:
                continue
            fields.append(f"{key}: {_clip(rendered, 120)}")
        if len(fields) >= limit:
            break
    return fields


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def relay_error(tool_name: str, content: str) -> str:
    """The failure of a tool told to the customer the way the error's advice asks.

    Understands the executor's "Tool '<name>' failed: <reason>. <advice>" and advice phrased as
    "Inform/Tell the customer ...", "Ask the customer for/to ...", "... offer another way to help".
    """
    match = _FAILURE_RE.match(content.strip())
    if match is not None:
        reason = match.group("reason").strip().rstrip(".")
        advice = (match.group("advice") or "").strip()
    else:
        reason, advice = " ".join(content.split()).rstrip("."), ""
    statement: str | None = None
    questions: list[str] = []
    for clause in re.split(r"(?<=[.;!?])\s+|;\s*|,?\s+then\s+", advice):
        clause = clause.strip().rstrip(".;")
        if not clause:
            continue
        tell = _TELL_RE.search(clause)
        if tell is not None and statement is None:
            what, rest = _split_and(tell.group("what"))
            statement = _to_customer(what)
            if rest:
                questions.extend(_follow_up(rest))
            continue
        questions.extend(_follow_up(clause))
    questions = list(dict.fromkeys(questions))
    if statement is None:
        reply = f"I'm sorry, I couldn't complete that ({_clip(reason, 160)})."
    elif statement.startswith(("I ", "I'")):
        reply = f"I'm sorry, {statement}."
    else:
        reply = f"I'm sorry, {statement[:1].lower()}{statement[1:]}."
    if _TRANSIENT_RE.search(reason):
        questions.append("Could you try again in a few minutes?")
    if questions:
        reply += " " + " ".join(questions)
    elif statement is None:
        reply += " Is there anything else I can help you with?"
    return reply


def _split_and(text: str) -> tuple[str, str]:
    """Split "you cannot do X and offer Y" into the statement and the follow-up instruction."""
    match = re.search(
        r",?\s+and\s+(?=(?:offer|ask|suggest|apologi[sz]e|invite)\b)", text, re.IGNORECASE
    )
    if match is None:
        return text, ""
    return text[: match.start()], text[match.end() :]


def _follow_up(clause: str) -> list[str]:
    ask = _ASK_RE.search(clause)
    if ask is not None:
        how, what = ask.group("how").lower(), _to_customer(ask.group("what").strip())
        if how == "for":
            return [f"Could you give me {what}?"]
        if how == "to":
            return [f"Could you {what}?"]
        return [f"Could you tell me {how} {what}?"]
    if _OFFER_RE.search(clause):
        return ["Is there anything else I can help you with?"]
    return []


# --------------------------------------------------------------------------------------------
# small talk

_PERSONA_RE = re.compile(r"\byou are\s+(?P<who>[^.!\n]+)", re.IGNORECASE)


def persona_of(system: str) -> str | None:
    """Who the system prompt says the model is ("You are Mia from Acme" -> "Mia from Acme")."""
    match = _PERSONA_RE.search(system)
    return match.group("who").strip() if match else None


def _friendly(system: str, text: str) -> str:
    who = persona_of(system)
    intro = f"Hi, I'm {who}." if who else "Hi!"
    words = set(_WORD_RE.findall(text.lower()))
    if not text or words & _GREETINGS:
        return f"{intro} How can I help you today?"
    return f"{intro} I'm not sure I can help with that yet. Could you tell me a bit more about what you need?"
