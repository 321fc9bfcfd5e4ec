"""What a tool call's record, its trace, an error text and the dashboard never show. Pure: no I/O.

Owns
- `secret_name`, the one definition of a secret-looking name (`password`, `api_key`, `token`,
  `cvv`, ...; not a count such as `max_tokens`): whatever a tool declares, values under such names
  are `[redacted]` in the call record, its trace, the approver's copy of a held call (the
  executor), an output-contract error (services.tools.validation) and on the dashboard
  (services.gateway.dashboard);
- `redact`: a value (a call's parameters or result) with the values under a tool's `sensitive`
  names or secret-looking names replaced at any depth, and every string that repeats a sensitive
  argument's value replaced too (a handler that echoes the email it saved, a client tool's action
  that carries its arguments);
- `scrub_text`: a text (an in-band error) with each sensitive value it quotes replaced;
- `secret_forms` / `scrub_bytes` / `StreamScrubber`: a response body with a credential the engine
  sent (a decrypted auth header) replaced before it is decoded, so an upstream that echoes its
  request headers cannot hand the credential to the model, the call record or the logs;
- `url_secrets`: the credentials a tool's URL carries itself (userinfo, a token-like path
  segment, a key in the query), scrubbed from the answer the same way.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote, unquote_plus

REDACTED = "[redacted]"
_REDACTED_BYTES = REDACTED.encode()

#: names whose values are never stored or shown, whatever the tool declares, wherever the name
#: holds them (`client_secret`, `apiKey`, `Proxy-Authorization`, `credentials`, `newpassword`,
#: `privatekey`). Short words that are in ordinary words (`pass`, `auth`, `pin`, `ssn`, `key`) and
#: `token` are judged word by word instead: see `secret_name`.
SECRET_NAME_RE = re.compile(
    r"secret|api[_-]?key|authori[sz]ation|credential|cvv|cvc|card[_-]?number|cookie"
    r"|passw(?:or)?d|passphrase|private[_-]?key",
    re.IGNORECASE,
)
#: a name's words: snake, kebab, dotted or camel case (`XCSRFToken` is `xcsrf` + `token`)
_WORD_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
#: secrets as words of their own (`card_pin`, `basicAuth`, `customerSSN`, `user_pwd`), not inside
#: one (`spinner`, `author`, `oauth_provider`, `business_name`)
_SECRET_WORDS = frozenset({"auth", "pin", "pincode", "pwd", "passcode", "otp", "jwt"})
#: words that start a secret's name whatever follows (`password_hash`, `passphrase`)
_SECRET_PREFIXES = ("password", "passphrase")
#: `access_key`, `signingKey`: a `key` after one of these is a credential (a plain `key`, `sort_key`
#: or `idempotency_key` is not)
_KEY_QUALIFIERS = frozenset({"api", "access", "secret", "private", "signing", "session", "encryption", "master",
                             "client", "auth", "license", "webhook", "sign", "hmac"})
#: `security_code`, `social_security_number`, `pass_code`, `passWord`, `pass_key`
_SECRET_PAIRS = frozenset({("security", "code"), ("security", "number"), ("pass", "code"), ("pass", "word"),
                           ("pass", "phrase"), ("pass", "key"), ("pass", "hash")})
#: `userpass`, `dbpass`, `adminpass` written as one word (not `bypass`, `compass`, `overpass`)
_PASS_OWNERS = frozenset({"user", "db", "admin", "root", "my", "new", "old", "wifi", "app", "mail", "smtp", "ftp",
                          "sql", "login", "account", "master", "web", "sys", "ssh", "api", "auth", "proxy", "vpn"})
#: `token_count`, `tokenLimit`, `tokencount`: what makes a singular `token` a number
_COUNTS = frozenset({"count", "counts", "limit", "limits", "budget", "budgets", "usage", "total", "totals", "num"})
#: `max_tokens`, `inputTokens`, `tokens_used`, `n_tokens`: a word that makes a plural `tokens` a count
_COUNT_QUALIFIERS = _COUNTS | frozenset({
    "max", "min", "input", "output", "prompt", "completion", "cache", "cached", "read", "creation",
    "reasoning", "used", "remaining", "reserved", "estimated", "n", "context", "thinking", "per", "billed",
    "generated", "window", "spent", "left",
})
#: names longer than this are judged but not remembered (a result's keys come from the upstream)
_CACHED_NAME_CHARS = 64
#: shorter sensitive values are not searched for inside longer texts: "no" or "12" would take
#: pieces out of every sentence (a value equal to a whole string is still replaced)
MIN_SCRUB_CHARS = 3
#: credentials shorter than this are not searched for in a body: "k" or "123" would be found in
#: every key and number, and the body would no longer decode (nor are they worth much as secrets)
MIN_SECRET_CHARS = 8


def secret_name(name: Any) -> bool:
    """True when `name` looks like it holds a credential or card data: the one definition the
    record, the trace, the approver's copy, error texts and the dashboard share.

    `pass` is a secret as the last word of a name (`db_pass`, `userPass`, `pass1`, `dbpass`; not
    `passThrough`, `bypassCache`, `bypass`, `passengers`) and before `key`/`hash`/`code`;
    `password`/`passwd`/`passphrase`/`privatekey` anywhere, `ssn` at a word's end (`customerssn`). `token` is a credential
    (`access_token`, `idToken`, `tokenString`, `deviceTokens`, a bare `tokens`) except when it
    counts: a singular `token` with a count word (`token_count`, `tokenLimit`, `tokencount`) or a
    plural `tokens` with a count qualifier (`max_tokens`, `input_tokens`, `tokens_used`). A call
    record keeps those numbers."""
    text = name if isinstance(name, str) else str(name)
    if len(text) > _CACHED_NAME_CHARS:
        return _judge(text)
    return _cached_judge(text)


def _judge(text: str) -> bool:
    if SECRET_NAME_RE.search(text):
        return True
    # a number ends the word before it (`pass1` is `pass`, `cvv2` is `cvv`)
    words = [word.lower() for word in _WORD_RE.findall(text) if not word.isdigit()]
    last = len(words) - 1
    for i, word in enumerate(words):
        if word in _SECRET_WORDS or word.startswith(_SECRET_PREFIXES) or word.endswith("ssn"):
            return True
        if word.endswith("pass") and i == last and (word == "pass" or word[:-len("pass")] in _PASS_OWNERS):
            return True
        before = words[i - 1] if i else ""
        if word in ("key", "keys") and before in _KEY_QUALIFIERS or (before, word) in _SECRET_PAIRS:
            return True
        if "token" in word and not _counts_tokens(word, words[i + 1] if i < last else "", words):
            return True
    return False


#: names repeat call after call (a tool's parameters, its result's keys)
_cached_judge = functools.lru_cache(maxsize=4096)(_judge)


def _counts_tokens(word: str, following: str, words: list[str]) -> bool:
    """True when `word` (holding `token`) names a number of tokens, not a credential."""
    if word.endswith("tokens"):
        qualifier = word[:-len("tokens")]
        return qualifier in _COUNT_QUALIFIERS or (not qualifier and bool(_COUNT_QUALIFIERS.intersection(words)))
    if word == "token":
        return following in _COUNTS
    return word.startswith("token") and word[len("token"):] in _COUNTS


def sensitive_values(arguments: Any, sensitive: Iterable[str]) -> frozenset[str]:
    """Every non-empty string held under one of the `sensitive` names or a secret-looking name,
    that name at any depth as `redact` finds it (`{"session": {"token": ...}}`): the values a
    record or an error text must not repeat (a form's `data` holds several). `arguments` may be a
    call's arguments or its result (any JSON value)."""
    found: set[str] = set()
    _named_strings(arguments, frozenset(sensitive), found)
    return frozenset(found)


def _named_strings(value: Any, names: frozenset[str], into: set[str]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key in names or secret_name(key):
                _strings(item, into)
            else:
                _named_strings(item, names, into)
    elif isinstance(value, list | tuple):
        for item in value:
            _named_strings(item, names, into)


def _strings(value: Any, into: set[str]) -> None:
    if isinstance(value, str):
        if value.strip():
            into.add(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _strings(item, into)
    elif isinstance(value, list | tuple):
        for item in value:
            _strings(item, into)


def redact(value: Any, names: frozenset[str] = frozenset(), values: frozenset[str] = frozenset()) -> Any:
    """`value` with what is under a name in `names` or a secret-looking name replaced by
    [redacted] at any depth, and each string in `values` replaced wherever it appears (a whole
    string equal to one, or quoted inside a longer text; see `scrub_text`). Returns a copy."""
    if isinstance(value, Mapping):
        return {k: REDACTED if (k in names or secret_name(k)) else redact(v, names, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, names, values) for v in value]
    if isinstance(value, str) and values:
        return REDACTED if value in values else scrub_text(value, values)
    return value


def scrub_text(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of each value of at least MIN_SCRUB_CHARS characters (as
    given, or as Python's repr or JSON would escape it) replaced by [redacted], longest first."""
    forms: set[str] = set()
    for value in values:
        if len(value.strip()) >= MIN_SCRUB_CHARS:
            forms.update(f for f in _text_forms(value) if f)
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, REDACTED)
    return text


def _text_forms(value: str) -> tuple[str, ...]:
    return (value, value.strip(), repr(value)[1:-1], json.dumps(value)[1:-1],
            json.dumps(value, ensure_ascii=False)[1:-1])


def secret_forms(secrets: Iterable[str]) -> tuple[bytes, ...]:
    """The byte strings a body may carry each secret as: the value itself, the credential after
    its scheme ("Bearer <token>": the token alone), each also as JSON escapes it; longest first.
    Texts shorter than MIN_SECRET_CHARS are left out."""
    forms: set[bytes] = set()
    for secret in secrets:
        _scheme, space, credential = secret.strip().partition(" ")
        texts = [secret, credential.strip()] if space else [secret]
        for text in (t for t in texts if len(t) >= MIN_SECRET_CHARS):
            escaped = (json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1])
            # `\/`: JSON may escape a slash (PHP's json_encode does), and base64 keys hold them
            forms.update(f.encode() for f in (text, *escaped, *(e.replace("/", "\\/") for e in escaped)))
    return tuple(sorted((f for f in forms if f), key=len, reverse=True))


#: query parameters that carry a credential by convention, beyond secret-looking names
#: (`?key=` of many public APIs, Azure Functions' `?code=`, signed URLs' `?sig=`)
_QUERY_CREDENTIAL_NAMES = frozenset({"key", "code", "sig", "signature", "hash", "hmac", "access", "auth", "k"})
_HOLE_RE = re.compile(r"\{[a-zA-Z_][a-zA-Z0-9_]*\}")
#: a URL's authority, path and query (RFC 3986, appendix B; the fragment is never sent). It
#: matches any text, a URL template's too, where `urlsplit` raises on a bad port or bracket
_URL_PARTS_RE = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?")
#: what a URL's literal text keeps as is when sent; the rest goes out percent-encoded
_URL_SAFE = "/:@!$&'()*+,;=-._~"
#: what looks random (`_looks_random`): as long as a short API key, letters and digits mixed
_RANDOM_MIN_CHARS = 16


def url_secrets(url: str) -> list[str]:
    """The credentials a URL (or URL template) carries itself, each as written, decoded and
    encoded as sent: what a body echoing the request URL, or quoting the secret alone, must not
    hand back (`secret_forms` makes the byte forms a body is scrubbed of). They are
    - its userinfo's password (`https://user:s3cretpass@shop.example/...`), and its user when
      that looks random (a token as the user: `https://ghp_...@host`). The SSRF guard refuses a
      URL with userinfo before anything is sent, so none can be echoed today; it is listed so
      that a client that ever sends one cannot have it handed back;
    - a path segment that looks random: the token of a Slack- or Discord-style webhook URL
      (`/services/T000/B000/<token>`), a hosted MCP server's `/s/<key>/mcp`, `/api/<40 hex>/`;
      `orders`, `v1`, `2024-10-21` or a Slack `T000` id do not;
    - a query value under a secret-looking name (`api_key`, `access_token`) or a credential's
      conventional one (`key`, `code`, `sig`), or one that looks random; `expand=customer` or
      `api-version=2024-10-21` do not. A query's `+` is read as `+` and as a space.
    Looks random: `_RANDOM_MIN_CHARS` characters or more, letters and digits mixed. Nothing with a
    `{hole}` in it counts: a hole's value comes from the call's arguments, not from the tenant."""
    parts = _URL_PARTS_RE.match(url)  # every text matches: each part may be empty
    authority, path, query = (part or "" for part in parts.groups()) if parts else ("", "", "")
    found: list[str] = []
    user, _, password = authority.rpartition("@")[0].partition(":")
    if password and not _HOLE_RE.search(password):
        found.extend(_sent_forms(password))
    if user and not _HOLE_RE.search(user) and _looks_random(unquote(user)):
        found.extend(_sent_forms(user))
    for segment in path.split("/"):
        if segment and not _HOLE_RE.search(segment) and _looks_random(unquote(segment)):
            found.extend(_sent_forms(segment))
    for pair in query.split("&") if query else ():
        name, _, value = pair.partition("=")
        if not value or _HOLE_RE.search(value):
            continue
        if not (secret_name(unquote_plus(name)) or unquote_plus(name).lower() in _QUERY_CREDENTIAL_NAMES
                or _looks_random(unquote_plus(value))):
            continue
        found.extend(_sent_forms(value, plus=True))
    return found


def _sent_forms(value: str, *, plus: bool = False) -> set[str]:
    """`value` from a URL as written, decoded (with `plus`, a query's `+` as a space too) and
    encoded as the request sends it."""
    decoded = unquote(value)
    forms = {value, decoded, quote(decoded, safe=_URL_SAFE)}
    if plus:
        forms.add(unquote_plus(value))
    return forms


def _looks_random(value: str) -> bool:
    return len(value) >= _RANDOM_MIN_CHARS and any(c.isalpha() for c in value) and any(c.isdigit() for c in value)


def scrub_bytes(raw: bytes, forms: tuple[bytes, ...]) -> bytes:
    """`raw` with every occurrence of each form replaced by [redacted] (forms longest first, as
    `secret_forms` returns them)."""
    for form in forms:
        raw = raw.replace(form, _REDACTED_BYTES)
    return raw


class StreamScrubber:
    """`scrub_bytes` over a body that arrives in chunks: a secret split across two chunks is still
    found. `feed` returns what is safe to pass on now: all but the longest tail that could be the
    start of a form (never more), so an event that ends a chunk is passed on at once; `flush`
    returns the rest when the body ends."""

    __slots__ = ("_forms", "_tail")

    def __init__(self, forms: tuple[bytes, ...]) -> None:
        self._forms = forms
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        buffer = scrub_bytes(self._tail + chunk, self._forms)
        hold = self._partial(buffer)
        self._tail = buffer[len(buffer) - hold:] if hold else b""
        return buffer[: len(buffer) - hold]

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail

    def _partial(self, buffer: bytes) -> int:
        """The length of the longest end of `buffer` that a form starts with (0: none)."""
        longest = 0
        for form in self._forms:
            for size in range(min(len(form) - 1, len(buffer)), longest, -1):
                if buffer.endswith(form[:size]):
                    longest = size
                    break
        return longest
