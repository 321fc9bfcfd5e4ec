"""services.nesting: JSON depth is counted, never left to the interpreter's stack (which moved
between Python 3.11 and 3.13), so the same input gets the same answer on every supported Python."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.llm.anthropic_client import _tool_input
from services.llm.port import LLMError
from services.nesting import MAX_JSON_DEPTH, nests_deeper_than, raw_nests_deeper_than


def arrays(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def objects(levels: int) -> bytes:
    return b'{"a":' * levels + b"1" + b"}" * levels


@pytest.mark.parametrize("make", [arrays, objects])
def test_raw_depth_is_refused_exactly_past_the_limit(make) -> None:
    assert not raw_nests_deeper_than(make(10), 10)
    assert raw_nests_deeper_than(make(11), 10)
    assert not raw_nests_deeper_than(make(MAX_JSON_DEPTH))
    assert raw_nests_deeper_than(make(MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_are_not_levels() -> None:
    text = json.dumps({"note": "[[[[{{{{" * 50 + '\\"]]]' * 40, "list": [[["ok"]]]}).encode()
    assert not raw_nests_deeper_than(text, 4)
    assert raw_nests_deeper_than(text, 3)


def test_escaped_quotes_do_not_end_a_string_early() -> None:
    text = b'["a \\" [[[[[[", ["b"]]'
    assert not raw_nests_deeper_than(text, 2)
    assert raw_nests_deeper_than(text, 1)


def test_many_siblings_are_wide_not_deep() -> None:
    text = json.dumps([{"id": i, "tags": [i]} for i in range(2000)]).encode()
    assert not raw_nests_deeper_than(text, 3)
    assert raw_nests_deeper_than(text, 2)


def test_malformed_text_is_measured_as_far_as_it_goes() -> None:
    assert raw_nests_deeper_than(b"[" * 20, 10)
    assert not raw_nests_deeper_than(b"]" * 20 + b"[[", 10)
    assert not raw_nests_deeper_than(b'"unterminated [[[[[[[[[[[[', 3)


def test_past_where_the_decoder_would_give_up_is_found_without_recursion() -> None:
    assert raw_nests_deeper_than(arrays(100_000))
    assert nests_deeper_than(msgspec.json.decode(arrays(MAX_JSON_DEPTH)), 64)


@pytest.mark.parametrize(("value", "levels"), [
    (1, 0), ({}, 0), ([], 0), ({"a": [1]}, 2), ([[[{"x": 1}]]], 4), ([[[{"x": {}}]]], 4), ({"a": 1, "b": [[2]]}, 3),
])
def test_decoded_depth_counts_the_objects_and_arrays_that_hold_something(value, levels: int) -> None:
    assert not nests_deeper_than(value, levels)
    if levels:
        assert nests_deeper_than(value, levels - 1)


def test_decoded_and_raw_depth_agree() -> None:
    for levels in (1, 7, 64, 65):
        raw = objects(levels)
        assert raw_nests_deeper_than(raw, 64) == nests_deeper_than(msgspec.json.decode(raw), 64)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 5000])
def test_the_models_tool_input_nested_past_the_limit_is_an_llm_error_on_every_python(levels: int) -> None:
    deep = '{"a":' * levels + "1" + "}" * levels
    with pytest.raises(LLMError, match=f"nested more than {MAX_JSON_DEPTH} levels deep; try again") as info:
        _tool_input(['{"order": ', deep, "}"], "check_order")
    assert info.value.retryable


def test_the_models_tool_input_within_the_limit_is_decoded() -> None:
    deep = '{"a":' * 100 + "1" + "}" * 100
    assert nests_deeper_than(_tool_input(['{"order": ', deep, "}"], "check_order"), 100)
