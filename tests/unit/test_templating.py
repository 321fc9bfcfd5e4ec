"""URL templating and the binding contract: hostile values stay inside their hole; scope wins.

Pure functions only: nothing here opens a connection.
"""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from services.tools.errors import DestinationBlocked, InvalidArguments, PolicyDenied, ToolError
from services.tools.model import BackendBindingTool
from services.tools.templating import binding_arguments, render_request

TEMPLATE = "https://mystore.com/api/orders/{order_id}"

HOSTILE = [
    "../",
    "../../admin",
    "..%2f..%2fadmin",
    "?x=1",
    "@evil.com",
    "evil.com/",
    "#frag",
    "%2e%2e",
    "%2e%2e%2f",
    "a/b/c",
    "\\..\\admin",
    "x\r\nHost: evil.com",
    "日本語/../",
    "ü?#@:",
    " spaced value ",
    "//evil.com",
    ";jsessionid=1",
    "\x00",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_path_value_stays_inside_its_one_segment(value: str) -> None:
    rendered = render_request(TEMPLATE, "GET", {"order_id": value})
    parts = urlsplit(rendered.url)
    assert parts.scheme == "https"
    assert parts.netloc == "mystore.com"
    assert parts.query == "" and parts.fragment == ""
    segments = parts.path.split("/")
    assert segments[:-1] == ["", "api", "orders"]
    assert unquote(segments[-1]) == value  # the server sees exactly the value, as one segment
    assert all(ch not in segments[-1] for ch in "/?#@\\ \r\n")


@pytest.mark.parametrize("value", ["?x=1", "1&admin=true", "#frag", "a=b", "日本"])
def test_a_hostile_query_hole_value_stays_one_query_value(value: str) -> None:
    rendered = render_request(
        "https://mystore.com/api/orders?id={order_id}&v=2", "GET", {"order_id": value}
    )
    parts = urlsplit(rendered.url)
    assert parts.path == "/api/orders"
    assert parse_qs(parts.query) == {"id": [value], "v": ["2"]}
    assert parts.fragment == ""


def test_unicode_is_utf8_percent_encoded() -> None:
    rendered = render_request(TEMPLATE, "GET", {"order_id": "日本"})
    assert rendered.url == "https://mystore.com/api/orders/%E6%97%A5%E6%9C%AC"


@pytest.mark.parametrize("value", [".", ".."])
def test_a_dot_segment_value_is_rejected_naming_the_parameter(value: str) -> None:
    with pytest.raises(InvalidArguments, match=r"`order_id` must not be '\.' or '\.\.'"):
        render_request(TEMPLATE, "GET", {"order_id": value})


@pytest.mark.parametrize(
    "template", ["https://mystore.com/api/../admin/{a}", "https://mystore.com/api/%2E%2E/{a}"]
)
def test_a_template_whose_path_holds_a_dot_segment_is_refused(template: str) -> None:
    with pytest.raises(InvalidArguments, match="dot segments are not allowed"):
        render_request(template, "GET", {"a": "x"})


def test_an_empty_path_value_is_rejected_so_it_cannot_widen_the_resource() -> None:
    with pytest.raises(InvalidArguments, match="`order_id` must not be empty"):
        render_request(TEMPLATE, "GET", {"order_id": ""})


@pytest.mark.parametrize("args", [{}, {"order_id": None}, {"other": "1"}])
def test_a_missing_hole_value_is_invalid_arguments_naming_the_parameter(args: dict) -> None:
    with pytest.raises(InvalidArguments, match="missing value for `order_id`") as info:
        render_request(TEMPLATE, "GET", args)
    assert "order_id" in info.value.advice


@pytest.mark.parametrize(
    ("value", "text"), [(12345, "12345"), (True, "true"), (False, "false"), (1.5, "1.5")]
)
def test_scalar_values_are_written_as_text(value: object, text: str) -> None:
    assert render_request(TEMPLATE, "GET", {"order_id": value}).url.endswith(f"/orders/{text}")


@pytest.mark.parametrize("value", [{"a": 1}, [1, 2]])
def test_a_nested_value_cannot_fill_a_hole(value: object) -> None:
    with pytest.raises(InvalidArguments, match="`order_id` must be text or a number"):
        render_request(TEMPLATE, "GET", {"order_id": value})


@pytest.mark.parametrize("method", ["GET", "DELETE", "get"])
def test_arguments_not_in_the_template_go_to_the_query_for_get_and_delete(method: str) -> None:
    rendered = render_request(
        TEMPLATE, method, {"order_id": "7", "email": "a&b=c@x.com", "n": 3, "skip": None}
    )
    parts = urlsplit(rendered.url)
    assert parts.path == "/api/orders/7"
    assert parse_qs(parts.query) == {"email": ["a&b=c@x.com"], "n": ["3"]}
    assert rendered.body is None


def test_query_arguments_are_appended_to_the_template_query() -> None:
    rendered = render_request("https://mystore.com/s?lang=en", "GET", {"q": "red shoes"})
    assert rendered.url == "https://mystore.com/s?lang=en&q=red%20shoes"


def test_a_list_query_argument_repeats_the_key_and_an_object_is_rejected() -> None:
    rendered = render_request("https://mystore.com/s", "GET", {"tag": ["a", "b/c"]})
    assert parse_qs(urlsplit(rendered.url).query) == {"tag": ["a", "b/c"]}
    with pytest.raises(InvalidArguments, match="`filter` is nested"):
        render_request("https://mystore.com/s", "GET", {"filter": {"a": 1}})


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH"])
def test_arguments_not_in_the_template_go_to_a_json_body_for_writes(method: str) -> None:
    rendered = render_request(
        TEMPLATE, method, {"order_id": "7", "note": "leave at door", "items": [1, 2]}
    )
    assert rendered.url == "https://mystore.com/api/orders/7"
    assert rendered.body == {"note": "leave at door", "items": [1, 2]}


def test_a_fragment_in_the_template_is_never_sent() -> None:
    assert render_request("https://mystore.com/a#section", "GET", {}).url == "https://mystore.com/a"


def test_an_empty_path_becomes_slash() -> None:
    assert (
        render_request("https://mystore.com", "GET", {"q": "x"}).url == "https://mystore.com/?q=x"
    )


@pytest.mark.parametrize(
    "template",
    [
        "https://{host}/api",
        "https://{sub}.mystore.com/api",
        "https://mystore.com:{port}/api",
        "{scheme}://mystore.com/",
    ],
)
def test_a_hole_in_the_host_is_refused_so_the_model_cannot_pick_the_destination(
    template: str,
) -> None:
    with pytest.raises(DestinationBlocked, match="^destination not allowed$") as info:
        render_request(
            template, "GET", {"host": "169.254.169.254", "sub": "x", "port": "1", "scheme": "http"}
        )
    assert info.value.rule in ("parameter in host", "malformed url")


def test_an_unsupported_method_is_refused() -> None:
    with pytest.raises(ToolError, match="http method 'TRACE' is not supported"):
        render_request(TEMPLATE, "TRACE", {"order_id": "1"})


def test_literal_template_text_is_kept_and_unsafe_literals_are_encoded() -> None:
    rendered = render_request("https://mystore.com/api/v1:search/{q} x", "GET", {"q": "a"})
    assert rendered.url == "https://mystore.com/api/v1:search/a%20x"


# --------------------------------------------------------------------------- bindings

CATALOG = BackendBindingTool(
    name="example_catalog_search",
    description="Search the catalog.",
    parameters={"search": {"type": "string"}, "limit": {"type": "integer"}},
    method="GET",
    path="/example/catalog",
    parameter_map={"search": "q", "limit": "per_page"},
    scope=("account_id",),
)


def test_parameter_map_renames_model_names_to_backend_names() -> None:
    backend = binding_arguments(
        CATALOG, {"search": "red shoes", "limit": 5}, {"account_id": "account-a"}
    )
    assert backend == {"q": "red shoes", "per_page": 5, "account_id": "account-a"}
    assert "search" not in backend


def test_seed_001_scoped_args_trusted_scope_overwrites_the_model() -> None:
    tool = BackendBindingTool(
        name="get_listing",
        description="d",
        parameters={},
        path="/listings",
        scope=("account_id", "listing_id"),
    )
    backend = binding_arguments(
        tool,
        {"account_id": "other-account", "listing_id": "other-property"},
        {"account_id": "account-a", "listing_id": "property-a"},
    )
    assert backend["listing_id"] == "property-a"
    assert backend == {"account_id": "account-a", "listing_id": "property-a"}


@pytest.mark.parametrize("key", ["tenant_id", "tenantId", "account_id", "accountId"])
def test_protected_keys_from_the_model_never_reach_the_backend(key: str) -> None:
    tool = BackendBindingTool(name="t", description="d", parameters={}, path="/x")
    assert binding_arguments(tool, {key: "other", "q": "1"}, {}) == {"q": "1"}


def test_parameter_map_cannot_alias_a_model_argument_onto_a_protected_key() -> None:
    tool = BackendBindingTool(
        name="t", description="d", parameters={}, path="/x", parameter_map={"acct": "account_id"}
    )
    assert binding_arguments(tool, {"acct": "other-account"}, {"account_id": "account-a"}) == {}


def test_definition_protected_keys_are_dropped_too() -> None:
    tool = BackendBindingTool(
        name="t", description="d", parameters={}, path="/x", protected=("owner_id",)
    )
    assert binding_arguments(tool, {"owner_id": "x", "q": "1"}, {}) == {"q": "1"}


def test_a_scope_key_missing_from_trusted_context_refuses_the_call() -> None:
    with pytest.raises(PolicyDenied, match="trusted scope has no `account_id`"):
        binding_arguments(CATALOG, {"search": "x"}, {})
