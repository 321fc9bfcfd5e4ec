"""services.tools.redaction: the one secret-looking-name rule (shared by the executor's record and
the dashboard), value redaction at any depth, and credentials scrubbed from response bodies, also
when a body arrives in chunks that split one."""

from __future__ import annotations

import json

import pytest

from services.gateway.dashboard import redact as dashboard_redact
from services.tools.redaction import (
    REDACTED,
    StreamScrubber,
    redact,
    scrub_bytes,
    scrub_text,
    secret_forms,
    secret_name,
    sensitive_values,
    url_secrets,
)

SECRET = "Bearer sk_live_TOPSECRET42"


@pytest.mark.parametrize("name", ["password", "passwd", "passphrase", "db_pass", "client_secret", "access_token", "api_key",
                                  "apiKey", "X-Api-Key", "private_key", "Authorization", "credentials", "cvv",
                                  "cvc", "card_number", "ssn", "pin", "card_pin", "pin_code", "pincode"])
def test_secret_looking_names(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["email", "shipping", "spinner", "opinion", "description", "order_id", "passengers",
                                  "Idempotency-Key", "Content-Type", "query"])
def test_ordinary_names(name):
    assert not secret_name(name)


#: caught: credentials by any common spelling, and every name the rule caught before it was
#: narrowed but the counts (a plural `tokens` that names a credential, `tokenizer`, `token_type`)
CAUGHT = ["token", "Token", "access_token", "refresh_token", "id_token", "session_token", "csrf_token", "auth_token",
          "authToken", "accessToken", "bearer_token", "x-csrf-token", "token_type", "tokenizer", "access_tokens",
          "refreshTokens", "api_key", "apikey", "x-api-key", "password", "passwd", "secret", "client_secret",
          "authorization", "Proxy-Authorization", "auth", "Auth", "basic_auth", "x-auth", "auth_header",
          "private_key", "credentials", "tokens", "tokenString", "jwtTokenStr", "tokenSignature", "sessionTokenStore",
          "deviceTokens", "push_tokens", "XCSRFToken", "basicAuth", "cardPin", "pinCode", "passCode", "customerSSN",
          "ssn_last4", "passcode", "device_passcode", "pwd", "security_code", "otp", "jwt", "cookie", "Set-Cookie",
          "access_key", "aws_access_key_id", "signing_key", "session_key", "social_security_number", "db_pass",
          "userPass", "PASSWORD", "password_hash",
          # joined into one lowercase word, or with a number: caught by the rule before it went word by word
          "newpassword", "oldpassword", "userpassword", "dbpassword", "USERPASSWORD", "privatekey", "PRIVATEKEY",
          "userpass", "dbpass", "adminpass", "pass1", "pass2", "cvv2", "pass_key", "pass_hash", "customerssn"]
#: kept: counts and limits of (LLM) tokens, and ordinary words that hold `auth` or `token`
KEPT = ["max_tokens", "maxTokens", "input_tokens", "output_tokens", "inputTokens", "total_tokens", "prompt_tokens",
        "completion_tokens", "cache_read_input_tokens", "token_count", "tokenCount", "num_tokens", "tokens_used",
        "token_counts", "token_limit", "token_budget", "token_usage", "max_output_tokens", "author", "authority", "oauth_provider",
        "business_name", "businessName", "classname", "passengers", "passport", "passThrough", "bypassCache",
        "compassHeading", "passRate", "PASSENGER_COUNT", "PASSPORT_NO", "tokencount", "tokenlimit", "n_tokens",
        "context_tokens", "thinking_tokens", "tokens_per_second", "key", "sort_key", "primary_key_column",
        "bypass", "compass", "overpass", "boarding_pass_count", "pass_through"]


@pytest.mark.parametrize("name", CAUGHT)
def test_credential_names_are_caught(name):
    assert secret_name(name)
    assert redact({name: "sk_live_1"}) == {name: REDACTED}


@pytest.mark.parametrize("name", KEPT)
def test_token_counts_and_ordinary_words_are_kept(name):
    # a call record's `max_tokens: 512` is a number the tenant needs, not a credential
    assert not secret_name(name)
    assert redact({name: 512}) == {name: 512}


def test_the_dashboard_uses_the_same_rule():
    # one definition: the dashboard hides on display what the executor keeps out of the record
    shown = dashboard_redact({"card_pin": "1234", "nested": [{"api_key": "k"}], "q": "x"}, frozenset())
    assert shown == {"card_pin": REDACTED, "nested": [{"api_key": REDACTED}], "q": "x"}  # `pin`: the shared rule's


def test_redact_replaces_named_values_and_repeated_sensitive_strings_at_any_depth():
    values = sensitive_values({"email": "ana@example.com", "form": {"iban": "DE89", "n": 3}, "q": "x"},
                              ("email", "form"))
    assert values == {"ana@example.com", "DE89"}
    out = redact({"email": "ana@example.com", "list": ["ana@example.com", {"token": 1}], "note": "mail ana@example.com",
                  "code": "DE89", "count": 3}, frozenset({"email"}), values)
    assert out == {"email": REDACTED, "list": [REDACTED, {"token": REDACTED}], "note": f"mail {REDACTED}",
                   "code": REDACTED, "count": 3}


def test_sensitive_values_are_found_under_a_secret_or_sensitive_name_at_any_depth_as_redact_finds_them():
    # a result (or an argument) that nests its credential: an error text quoting it must lose it
    value = {"session": {"access_token": "tok_abc"}, "items": [{"password": "pw-1", "n": "kept"}],
             "contact": {"email": "ana@example.com"}, "max_tokens": "512", "q": "x"}
    assert sensitive_values(value, ("email",)) == {"tok_abc", "pw-1", "ana@example.com"}
    assert sensitive_values([{"api_key": "k-123"}], ()) == {"k-123"}  # a result need not be an object


def test_scrub_text_replaces_values_as_given_as_repr_or_json_shows_them_but_not_tiny_ones():
    values = ["Ana\tSmith-Brown", "ok"]
    text = f"name {values[0]!r} / {json.dumps(values[0])} / ok"
    assert scrub_text(text, values) == f"name '{REDACTED}' / \"{REDACTED}\" / ok"


def test_secret_forms_cover_the_value_the_credential_alone_and_its_json_escapes():
    forms = secret_forms(['Bearer tok"en/é-1234', ""])
    assert b'Bearer tok"en/\xc3\xa9-1234' in forms and b'tok"en/\xc3\xa9-1234' in forms
    assert b'tok\\"en/\\u00e9-1234' in forms  # as json.dumps (ASCII) writes it
    assert list(forms) == sorted(forms, key=len, reverse=True)  # the whole header before the token
    body = b'{"a": "Bearer tok\\"en/\\u00e9-1234", "b": "tok\\"en/\\u00e9-1234"}'
    assert json.loads(scrub_bytes(body, forms)) == {"a": REDACTED, "b": REDACTED}


def test_a_short_credential_is_not_searched_for_it_would_break_every_body():
    # "k" or "123" would be found in every key and number: the body would no longer decode
    assert secret_forms(["Basic abc"]) == (b"Basic abc",)
    assert secret_forms(["k", "1234567", ""]) == ()
    assert scrub_bytes(b'{"ok": 1234567}', secret_forms(["k", "1234567"])) == b'{"ok": 1234567}'


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_the_stream_scrubber_finds_a_secret_split_across_any_chunks(size):
    body = f'data: {{"echo": "{SECRET}", "again": "{SECRET}"}}\n\n'.encode()
    scrubber = StreamScrubber(secret_forms([SECRET]))
    out = b"".join(scrubber.feed(body[i:i + size]) for i in range(0, len(body), size)) + scrubber.flush()
    assert out == f'data: {{"echo": "{REDACTED}", "again": "{REDACTED}"}}\n\n'.encode()


def test_the_stream_scrubber_holds_back_only_what_could_start_a_secret():
    scrubber = StreamScrubber(secret_forms([SECRET]))
    # an SSE event that ends a chunk is passed on at once: nothing waits for the next chunk
    assert scrubber.feed(b'data: {"ok": 1}\n\n') == b'data: {"ok": 1}\n\n'
    assert scrubber.feed(b'data: "Bear') == b'data: "'
    assert scrubber.feed(b"ded\n") == b"Bearded\n"
    assert scrubber.flush() == b""


def test_long_names_are_judged_but_not_remembered():
    # a result's keys come from the upstream: the verdict cache must not hold 4,096 huge names
    from services.tools import redaction

    redaction._cached_judge.cache_clear()
    assert secret_name("x" * 100_000 + "_password") and not secret_name("y" * 100_000)
    assert secret_name("api_key") and redaction._cached_judge.cache_info().currsize == 1


@pytest.mark.parametrize(("url", "secrets"), [
    ("https://api.test/o/{id}?api_key=sk_live_123", {"sk_live_123"}),
    ("https://api.test/o?key=AIzaSyA-1234&expand=customer", {"AIzaSyA-1234"}),  # `key`, `code`, `sig` by convention
    ("https://fn.test/api/run?code=abc%2Fdef", {"abc%2Fdef", "abc/def"}),
    ("https://api.test/o?x=Zm9vYmFyYmF6cXV4MTIz", {"Zm9vYmFyYmF6cXV4MTIz"}),  # random-looking under any name
    ("https://api.test/o?expand=customer&status=delivered&api-version=2024-10-21", set()),
    ("https://api.test/o?api_key={key}&q={q}", set()),  # holes: the call's arguments
    ("https://api.test/o", set()),
])
def test_url_query_secrets_are_the_credential_looking_literals(url, secrets):
    found = set(url_secrets(url))
    assert found >= secrets
    if not secrets:
        assert found == set()


def test_a_slash_escaped_credential_is_a_form_scrubbed_from_a_body():
    forms = secret_forms(["Bearer tok/SECRET/0123456789"])
    body = b'{"auth": "Bearer tok\\/SECRET\\/0123456789"}'
    assert b"SECRET" not in scrub_bytes(body, forms)
