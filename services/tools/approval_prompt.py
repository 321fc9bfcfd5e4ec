"""The question a contact is asked before a held call runs (its approval prompt). Pure: no I/O.

Owns
- `render_approval_prompt`: a tool's `approval_prompt` template (`"Book {service} on {start}?"`)
  filled from a call's arguments, or, without one, a short question built from the tool's name and
  arguments (`"Run book appointment with service=cut, start=2026-12-08T10:00?"`), never from its
  description, which is written for the model. It never raises: an argument the call lacks
  leaves a readable placeholder (`(start not given)`); a value under a `sensitive`,
  secret-looking (services.tools.redaction.secret_name) or protected name, in any spelling, is
  never shown, nor is a sensitive value another argument repeats; values are clipped, and the
  question is one line of printable text, clipped as a whole;
- `placeholders` / `template_problems`: what a template names, and each brace in it that is no
  placeholder, for the checks at registration (services.gateway.bodies).

A placeholder is `{name}`, `name` being any parameter's name (no braces); `{{` and `}}` are
literal braces. Only top-level arguments can be named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from services.tools.model import is_protected, protected_forms
from services.tools.redaction import REDACTED, redact, secret_name, sensitive_values

#: the longest template a tool may declare (checked at registration)
MAX_TEMPLATE_CHARS = 300
#: how much of one argument's value a prompt shows
MAX_VALUE_CHARS = 80
#: how long a whole prompt may be
MAX_PROMPT_CHARS = 400
#: how many arguments the default question lists before saying there are more
MAX_DEFAULT_ARGUMENTS = 6

_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_CLIP = "…"


class PlaceholderProblem(msgspec.Struct, frozen=True, kw_only=True):
    """A brace of a template that is no placeholder: `{` or `}` alone, or `{}`."""

    kind: Literal["stray_brace", "empty"]
    text: str


def placeholders(template: str) -> list[str]:
    """The names a template's placeholders name, in order, each once."""
    names: list[str] = []
    for token in _TOKEN_RE.finditer(template):
        name = token.group(1)
        if name and name not in names:
            names.append(name)
    return names


def template_problems(template: str) -> list[PlaceholderProblem]:
    """Each brace of `template` that opens or closes no placeholder and is not doubled, in order."""
    problems = []
    for token in _TOKEN_RE.finditer(template):
        text = token.group(0)
        if text in ("{", "}"):
            problems.append(PlaceholderProblem(kind="stray_brace", text=text))
        elif text == "{}":
            problems.append(PlaceholderProblem(kind="empty", text=text))
    return problems


def render_approval_prompt(
    template: str | None, *, tool_name: str, arguments: Mapping[str, Any], sensitive: frozenset[str],
    protected: frozenset[str],
) -> str:
    """The question for one call of tool `tool_name` with `arguments`: `template` filled, or the
    default question when it is None or blank. `sensitive`: the names whose values are never
    shown (besides secret-looking ones); `protected`: the names only the trusted scope fills
    (services.tools.model.ToolBase.protected_keys), never shown either. Never raises."""
    shown = redact(dict(arguments), sensitive, sensitive_values(arguments, sensitive))
    forms = protected_forms(protected)
    if template is None or not _one_line(template):
        return _default(tool_name, shown, sensitive, forms)
    pieces: list[str] = []
    position = 0
    for token in _TOKEN_RE.finditer(template):
        pieces.append(template[position:token.start()])
        position = token.end()
        text, name = token.group(0), token.group(1)
        if text in ("{{", "}}"):
            pieces.append(text[0])
        elif not name:  # a stray brace or `{}` (refused at registration): shown as written
            pieces.append(text)
        elif name in sensitive or secret_name(name) or is_protected(name, forms):
            pieces.append(REDACTED)
        elif shown.get(name) is None:
            pieces.append(f"({_spoken(name)} not given)")
        else:
            pieces.append(_value(shown[name]))
    pieces.append(template[position:])
    return _clip(_one_line("".join(pieces)), MAX_PROMPT_CHARS)


def _default(tool_name: str, shown: dict[str, Any], sensitive: frozenset[str], forms: frozenset[str]) -> str:
    """`Run <name> with k=v, ...?`: the protected arguments (the engine's, not the contact's)
    left out, the sensitive and secret-looking ones redacted."""
    listed = [f"{_one_line(str(k))}={REDACTED if k in sensitive or secret_name(k) else _value(v)}"
              for k, v in shown.items() if not is_protected(k, forms)]
    if len(listed) > MAX_DEFAULT_ARGUMENTS:
        listed = [*listed[:MAX_DEFAULT_ARGUMENTS], _CLIP]
    question = f"Run {_spoken(tool_name)}" + (f" with {', '.join(listed)}" if listed else "") + "?"
    return _clip(_one_line(question), MAX_PROMPT_CHARS)


def _spoken(name: str) -> str:
    """A name as a contact reads it: `book_appointment` -> `book appointment`."""
    return _one_line(name.replace("_", " ").replace("-", " "))


def _value(value: Any) -> str:
    """One argument's value as shown: a text as it is, anything else as JSON, one line, clipped."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = msgspec.json.encode(value).decode()
        except (TypeError, msgspec.EncodeError):
            text = repr(value)
    return _clip(_one_line(text), MAX_VALUE_CHARS)


def _one_line(text: str) -> str:
    """`text` as one line of printable text: each run of whitespace (line breaks included) one
    space, other control characters left out, so a value cannot add a line to the question."""
    return "".join(ch for ch in " ".join(text.split()) if ch.isprintable())


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + _CLIP
