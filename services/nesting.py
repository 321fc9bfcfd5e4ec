"""How deeply JSON may nest, counted explicitly. Pure: no I/O.

The engine never relies on the interpreter running out of stack to refuse deep JSON: where that
happens moved between Python versions (3.12 inlined comprehensions, 3.13 changed the C recursion
limit msgspec's decoder follows), so the same body was refused on one and accepted on another.
Instead every place that reads untrusted JSON counts levels (objects and arrays) first:

- `raw_nests_deeper_than`: undecoded bytes, before they reach a decoder (request bodies at the
  gateway, a webhook's answer, the model's answer), against `MAX_JSON_DEPTH`;
- `nests_deeper_than`: a decoded value (a tool's arguments or result, against the tools' own
  tighter `services.tools.model.MAX_VALUE_DEPTH`), before anything walks it recursively.

Both walk without recursion, so a value deep enough to matter cannot exhaust the stack of the
check itself.
"""

from __future__ import annotations

import re
from typing import Any

#: the deepest JSON the engine decodes anywhere (levels of objects and arrays). Far above what
#: it keeps (a tool schema, arguments or result nest at most 64 levels: services.tools), so a
#: notification receiver's odd answer is still read; below where msgspec's decoder gives up on
#: Python 3.11 (1,000 levels less the caller's stack), so every supported version answers alike.
MAX_JSON_DEPTH = 800

#: a JSON string (escapes skipped whole, an unterminated one runs to the end) or one bracket:
#: brackets inside strings are not levels
_TOKEN_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')
_OPENERS = frozenset(b"[{")


def raw_nests_deeper_than(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `raw` opens more than `limit` objects and arrays inside one another.

    Malformed text is measured as far as it goes (the decoder then says what is wrong with it).
    Cost: one pass of `bytes.count` when the text holds at most `limit` brackets in all (nearly
    every body), otherwise one regex pass over its strings and brackets."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for match in _TOKEN_RE.finditer(raw):
        first = match.group()[0]
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif first != 0x22:  # a closer; a string is no level
            depth -= 1
    return False


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` (a decoded JSON value) nests more than `limit` levels of objects (dicts)
    and arrays (lists), found level by level rather than by recursion."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())]
        if not level:
            return False
    return True
