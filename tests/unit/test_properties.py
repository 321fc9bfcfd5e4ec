"""Properties of the tool boundary, checked with hypothesis over generated inputs.

- URL templating: no argument value, however hostile, changes the scheme, host or port of a
  webhook's URL or adds a path segment, a query parameter or a fragment; each value comes back
  intact from the one segment or query value it fills.
- Argument validation never raises for any JSON-ish input: it only returns problems, and the
  executor turns them into an in-band result.
- Protected keys (tenant_id, account_id, ...) never reach a handler or a backend from the model,
  at any depth of the arguments, and trusted values always win.
- The circuit breaker opens exactly at the third counted failure of a tool in a session, for any
  interleaving of successes, counted and uncounted failures, across turns and rounds.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import yarl
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from actors.session import TurnEnv, handle_message, new_state
from services.botconfig import BotConfig
from services.tools.errors import (
    InvalidArguments,
    PolicyDenied,
    QueueTimeout,
    UpstreamStatus,
    UpstreamTimeout,
)
from services.tools.executor import Executor, ToolCall, scoped_args
from services.tools.model import (
    PROTECTED_KEYS,
    BackendBindingTool,
    PythonTool,
    is_protected,
    protected_forms,
)
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.ssrf import DestinationPolicy, check_destination
from services.tools.templating import binding_arguments, render_request
from services.tools.toolset import BREAKER_THRESHOLD, SessionToolState
from services.tools.validation import ArgumentValidator
from tests.support.fakes import FakeHandler, make_catalog, python_tool
from tests.support.turns import ScriptedLLM

FAST = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
TURNS = settings(max_examples=60, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])

# -- strategies ----------------------------------------------------------------------------------

#: strings an attacker (or a confused model) would try to break out of a URL segment with
TRICKY = ["", ".", "..", "../", "../../admin", "/", "//evil.example", "?", "?x=1", "&x=1", "#", "#frag",
          "@evil.example", "evil.example:80@", "%2e%2e", "%2F", "%00", "\\", "\\\\evil", ":", "http://evil.example",
          " ", "\r\nHost: evil", "\t", "\u2028", "é", "\U0001f600", "a/b?c#d", "%", "%zz", "{order_id}", ";x=1",
          "[::1]", "~", "+", "=="]

texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(TRICKY),
    st.lists(st.sampled_from(TRICKY), min_size=1, max_size=4).map("".join),
)
scalars = st.one_of(texts, st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans())

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), texts,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(texts, st.sampled_from(sorted(PROTECTED_KEYS))), children, max_size=4),
    ),
    max_leaves=25,
)
json_objects = st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(["order_id", "q", "when", "n"])),
                               json_values, max_size=6)


# -- 1. URL templating ------------------------------------------------------------------------------

TEMPLATES = [
    # (template, path holes, {query key: hole})
    ("https://api.shop.example:8443/v1/orders/{order_id}/items/{item}?q={q}&fixed=1", ["order_id", "item"], {"q": "q"}),
    ("http://shop.example/api/{order_id}", ["order_id"], {}),
    ("https://shop.example/{a}.json?x={b}#section", ["a"], {"x": "b"}),
    ("http://93.184.216.34:8080/x/{a}/{b}/", ["a", "b"], {}),
]
EXTRA_NAMES = ["extra", "more", "q2"]


def _path_segments(path: str) -> list[str]:
    return path.split("/")


@FAST
@given(
    st.sampled_from(TEMPLATES),
    st.sampled_from(["GET", "POST", "DELETE", "PATCH"]),
    st.data(),
)
def test_no_argument_value_changes_scheme_host_port_or_adds_a_segment_query_or_fragment(spec, method, data):
    template, path_holes, query_holes = spec
    args = {name: data.draw(scalars, label=name) for name in path_holes + list(query_holes.values())}
    extras = data.draw(st.dictionaries(st.sampled_from(EXTRA_NAMES), scalars, max_size=2), label="extras")
    args.update(extras)

    def text(value: Any) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    path_texts = [text(args[h]) for h in path_holes]
    try:
        rendered = render_request(template, method, args)
    except InvalidArguments:
        # refused only for a value that would be an empty or dot path segment
        assert any(t in ("", ".", "..") for t in path_texts), (args, template)
        return
    assert not any(t in ("", ".", "..") for t in path_texts), rendered.url

    want = urlsplit(template.replace("{", "").replace("}", ""))
    got = urlsplit(rendered.url)
    assert (got.scheme, got.hostname, got.port) == (want.scheme, want.hostname, want.port)
    assert got.fragment == "" and "#" not in rendered.url
    # what the client really connects with: yarl on the encoded URL
    url = yarl.URL(rendered.url, encoded=True)
    assert (url.scheme, url.host, url.port) == (want.scheme, want.hostname, want.port or {"http": 80, "https": 443}[want.scheme])

    template_segments = _path_segments(urlsplit(template).path)
    segments = _path_segments(got.path)
    assert len(segments) == len(template_segments), (template, rendered.url)
    for tmpl, seg in zip(template_segments, segments, strict=True):
        holes = [h for h in path_holes if f"{{{h}}}" in tmpl]
        if not holes:
            assert seg == tmpl
        elif tmpl == f"{{{holes[0]}}}":
            assert unquote(seg) == text(args[holes[0]])  # the value, whole, in its own segment
        else:  # "{a}.json": the literal suffix stays a suffix
            suffix = tmpl.split("}", 1)[1]
            assert seg.endswith(suffix) and unquote(seg[: len(seg) - len(suffix)]) == text(args[holes[0]])

    pairs = parse_qsl(got.query, keep_blank_values=True)
    template_keys = [k for k, _ in parse_qsl(urlsplit(template).query, keep_blank_values=True)]
    extra_keys = [k for k, v in extras.items() if v is not None] if method in ("GET", "DELETE") else []
    assert [k for k, _ in pairs] == template_keys + extra_keys, (rendered.url, args)
    values = dict(pairs)
    for key, hole in query_holes.items():
        assert values[key] == text(args[hole])
    for key in extra_keys:
        assert values[key] == text(extras[key])
    if method in ("POST", "PATCH"):
        assert rendered.body == {k: v for k, v in extras.items() if v is not None}


class _PublicResolver:
    async def resolve(self, host: str, port: int) -> list[str]:
        return ["93.184.216.34"]


@FAST
@given(st.sampled_from(TEMPLATES), st.data())
def test_the_guard_checks_exactly_the_host_and_path_the_template_renders(spec, data):
    template, path_holes, query_holes = spec
    args = {name: data.draw(scalars.filter(lambda v: str(v) not in ("", ".", "..")), label=name)
            for name in path_holes + list(query_holes.values())}
    rendered = render_request(template, "GET", args)
    destination = asyncio.run(check_destination(rendered.url, _PublicResolver(), DestinationPolicy()))
    want = urlsplit(template)
    assert destination.host == want.hostname
    assert destination.port == (want.port or {"http": 80, "https": 443}[want.scheme])
    assert destination.url == rendered.url  # connects to what was checked, nothing re-parsed


# -- 2. argument validation never raises ---------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[0-9]+$", "maxLength": 12}},
     "required": ["order_id"], "additionalProperties": False},
    {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "day": {"type": "string", "format": "date"},
        "email": {"type": "string", "format": "email"}, "site": {"type": "string", "format": "uri"},
        "ip": {"type": "string", "format": "ipv4"}, "id": {"type": "string", "format": "uuid"},
        "re": {"type": "string", "format": "regex"}, "host": {"type": "string", "format": "hostname"},
    }},
    {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 20, "multipleOf": 1},
        "ratio": {"type": "number", "exclusiveMinimum": 0},
        "kind": {"enum": ["a", "b", 3, None]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3, "uniqueItems": True},
        "address": {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]},
        "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    }, "required": ["n"]},
    {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}, "maxProperties": 2},
    {"type": "object", "properties": {"q": {"type": "string"}}, "dependentRequired": {"q": ["n"]},
     "if": {"required": ["q"]}, "then": {"properties": {"n": {"const": 1}}}},
]


@FAST
@given(st.sampled_from(SCHEMAS), json_objects)
def test_argument_validation_returns_problems_and_never_raises(schema, arguments):
    problems = ArgumentValidator(schema).errors(arguments)
    assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)


@FAST
@given(st.sampled_from(SCHEMAS), st.one_of(json_objects, json_values))
def test_the_executor_turns_any_model_arguments_into_a_plan_without_raising(schema, arguments):
    handler = FakeHandler("t")
    catalog = make_catalog(python_tool("t", parameters=schema), handlers=(handler,))
    executor = Executor()
    # the model's arguments arrive as whatever JSON it produced: not always an object
    call = ToolCall(id="c1", name="t", arguments=arguments)  # type: ignore[arg-type]
    plan = asyncio.run(executor.prepare([call], catalog=catalog, config=BotConfig(), session=SessionToolState(),
                                        scope={}))
    [prepared] = plan.calls
    if prepared.error is not None:
        assert isinstance(prepared.error, InvalidArguments) and prepared.error.reason.startswith("invalid arguments")
    else:
        assert ArgumentValidator(schema).errors(prepared.arguments) == []
    [outcome] = asyncio.run(executor.execute(plan, _ctx()))
    assert outcome.success is (prepared.error is None)
    assert handler.count == (0 if prepared.error else 1)


# -- 3. protected keys never reach the handler; trusted values win --------------------------------------

def _protected_anywhere(value: Any, allowed_top: dict[str, Any] | None = None) -> list[str]:
    """Protected keys found in `value` at any depth, except top-level keys of `allowed_top`."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k in PROTECTED_KEYS and not (allowed_top is not None and k in allowed_top):
                found.append(k)
            found += _protected_anywhere(v)
    elif isinstance(value, list):
        for v in value:
            found += _protected_anywhere(v)
    return found


trusted_scopes = st.dictionaries(
    st.one_of(st.sampled_from(sorted(PROTECTED_KEYS)), st.sampled_from(["store_id", "q"])),
    st.text(min_size=1, max_size=8).map(lambda s: f"trusted-{s}"), max_size=4,
)


@FAST
@given(st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(sorted(PROTECTED_KEYS))), json_values, max_size=6),
       trusted_scopes)
@example({"account_id": "other-account", "listing_id": "other-property"},
         {"account_id": "account-a", "listing_id": "property-a"})  # seed 001's own example
@example({"filter": {"accountId": "tn_B", "items": [{"tenant_id": "tn_B"}]}}, {"account_id": "tn_A"})
def test_scoped_args_strip_protected_keys_at_any_depth_and_trusted_values_win(model_args, trusted):
    result = scoped_args(model_args, trusted, protected=PROTECTED_KEYS)
    assert _protected_anywhere(result, allowed_top=trusted) == [], result
    for key, value in trusted.items():
        assert result[key] == value
    for key in model_args.keys() - trusted.keys():
        if not is_protected(key, protected_forms(PROTECTED_KEYS)):  # `TENANT_ID`, `account-id`: stripped too
            assert key in result


@TURNS
@given(st.dictionaries(st.one_of(st.sampled_from(["q", "filter", "items"]), st.sampled_from(sorted(PROTECTED_KEYS))),
                       json_values, max_size=5))
def test_protected_keys_from_the_model_never_reach_the_handler_and_the_trusted_account_does(model_args):
    handler = FakeHandler("lookup")
    # the schema names account_id, so the trusted scope fills it; tenant_id it does not name
    schema = {"type": "object", "properties": {"q": {}, "filter": {}, "items": {}, "account_id": {"type": "string"}}}
    catalog = make_catalog(python_tool("lookup", parameters=schema), handlers=(handler,))
    executor = Executor()
    scope = {"tenant_id": "tn_A", "tenantId": "tn_A", "account_id": "tn_A", "accountId": "tn_A"}
    plan = asyncio.run(executor.prepare([ToolCall(id="c1", name="lookup", arguments=model_args)], catalog=catalog,
                                        config=BotConfig(), session=SessionToolState(), scope=scope))
    [outcome] = asyncio.run(executor.execute(plan, _ctx()))
    assert outcome.success, outcome.content
    [(received, ctx)] = handler.calls
    assert received["account_id"] == "tn_A" and ctx.tenant_id == "tn_A"
    assert _protected_anywhere(received, allowed_top={"account_id": None}) == [], received
    assert _protected_anywhere(outcome.record.parameters, allowed_top={"account_id": None}) == []


@FAST
@given(st.dictionaries(st.one_of(st.text(max_size=6), st.sampled_from(sorted(PROTECTED_KEYS))), json_scalars, max_size=5),
       st.dictionaries(st.text(max_size=6), st.one_of(st.text(max_size=6), st.sampled_from(sorted(PROTECTED_KEYS))),
                       max_size=4))
def test_a_binding_sends_only_the_trusted_scope_whatever_the_model_or_its_parameter_map_says(model_args, parameter_map):
    tool = BackendBindingTool(name="search", description="d", parameters={"type": "object", "properties": {}},
                              path="/search", parameter_map=parameter_map, scope=("account_id",))
    sent = binding_arguments(tool, model_args, {"account_id": "tn_A", "tenant_id": "tn_A"})
    assert sent["account_id"] == "tn_A"
    assert [k for k in sent if k in PROTECTED_KEYS] == ["account_id"]


# -- 4. the breaker opens exactly at the third counted failure ---------------------------------------------

#: handler outcomes: (name, exception or None, counts for the breaker)
OUTCOMES: dict[str, tuple[BaseException | None, bool]] = {
    "ok": (None, False),
    "upstream_500": (UpstreamStatus("upstream error (500)", status=500), True),
    "upstream_404": (UpstreamStatus("not found (404)", status=404), True),
    "timeout": (UpstreamTimeout("upstream timeout"), True),
    "crash": (RuntimeError("boom"), True),  # becomes tool_crashed, which counts
    "busy": (QueueTimeout("waited too long for a slot"), False),
    "bad_args": (InvalidArguments("invalid arguments: 'q' is required"), False),
    "denied": (PolicyDenied("not now"), False),
}


@TURNS
@given(st.lists(st.lists(st.sampled_from(sorted(OUTCOMES)), min_size=1, max_size=4), min_size=1, max_size=6))
def test_the_breaker_opens_exactly_at_the_third_counted_failure_for_any_interleaving(turns):
    """Each inner list is one message whose rounds each call the tool once (the model calls it
    even when it is no longer offered, as a confused model would)."""
    with capture_logs():  # "crash" logs a traceback: captured, not rendered
        asyncio.run(_run_breaker_turns(turns))


async def _run_breaker_turns(turns: list[list[str]]) -> None:
    planned: list[str] = []
    ran: list[str] = []
    registry = HandlerRegistry()

    @registry.register("flaky")
    async def flaky(args, ctx):
        name = planned.pop(0)
        ran.append(name)
        error, _ = OUTCOMES[name]
        if error is not None:
            raise error
        return {"ok": True}

    tool = PythonTool(name="flaky", description="flaky lookup", handler="flaky",
                      parameters={"type": "object", "properties": {"q": {"type": "string"}}})
    catalog = build_catalog([], [(tool, 1)], registry=registry, backend=None)
    state = new_state("t1", "s1")
    counted = 0
    for index, rounds in enumerate(turns):
        llm = ScriptedLLM([[("flaky", {"q": "x"})] for _ in rounds] + ["done"])
        env = TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(),
                      main_model="main", cheap_model="cheap")
        planned[:] = list(rounds)
        reply = await handle_message(state, "check", f"m{index}", env)
        assert len(reply.tool_calls) == len(rounds)
        for round_no, (name, summary) in enumerate(zip(rounds, reply.tool_calls, strict=True)):
            offered = [t.name for t in llm.requests[round_no].tools]
            if counted >= BREAKER_THRESHOLD:
                # open: not offered (defined only for the history's calls, its use forbidden), not
                # run, refused in-band without counting again
                request = llm.requests[round_no]
                assert (offered == [] or request.tool_choice == "none") and not summary.success, (turns, index, round_no)
                assert "switched off" in (summary.error or "")
                continue
            assert offered == ["flaky"], (turns, index, round_no, counted)
            assert ran and ran.pop(0) == name
            assert summary.success is (name == "ok")
            counted += OUTCOMES[name][1]
        assert ran == []
        assert state.open_breakers() == (["flaky"] if counted >= BREAKER_THRESHOLD else []), (turns, counted)
        assert state.snapshot.breakers.get("flaky", 0) == counted  # refusals after it opened count no more


def _ctx():
    from services.tools.context import TrustedContext

    return TrustedContext(tenant_id="tn_A", session_id="s1", message_id="m1")
