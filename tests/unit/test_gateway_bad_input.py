"""The gateway's checks of what a client sends that pure code can decide: whole numbers in query
strings and paths, a tool's session-variable name, and the status a turn that could not be saved
gets, in process or through Ray. The HTTP side of the same inputs is in
tests/integration/test_gateway_bad_input.py."""

from __future__ import annotations

import pytest

from actors.host import TurnNotSaved
from actors.placement import _host_exception
from actors.ray_host import to_host_error
from kernel.errors import InvalidInput
from services.gateway.bodies import MAX_VARIABLE_NAME, ToolCreate, definition_from_body
from services.gateway.common import OutOfRange, failure, whole_number


@pytest.mark.parametrize(("raw", "value"), [("1", 1), ("500", 500), ("007", 7), ("0" * 40 + "42", 42)])
def test_a_whole_number_in_range_is_read(raw, value):
    assert whole_number(raw, name="limit", low=1, high=500, at="?limit") == value


@pytest.mark.parametrize("raw", [
    "\u00b2",  # '²' passes str.isdigit(), int() refuses it
    "\u0663",  # Arabic-Indic 3: int() would read it as 3
    "", "-1", "+1", "1.5", " 1", "1 ", "1e3", "0x10", "1_000", "ten",
])
def test_anything_but_ascii_digits_is_not_a_whole_number(raw):
    with pytest.raises(InvalidInput, match=r"limit must be a whole number from 1 to 500, got .* - at `\?limit`") as info:
        whole_number(raw, name="limit", low=1, high=500, at="?limit")
    assert not isinstance(info.value, OutOfRange)


@pytest.mark.parametrize("raw", ["0", "501", "99999999999999", "9" * 5000])
def test_a_whole_number_out_of_range_is_refused_as_such_however_long(raw):
    # 5000 digits: past int()'s own limit (4300), which raises ValueError; never converted here
    with pytest.raises(OutOfRange, match=r"limit must be a whole number from 1 to 500") as info:
        whole_number(raw, name="limit", low=1, high=500, at="?limit")
    assert info.value.path == "?limit" and len(str(info.value)) < 200


def tool(**kw) -> ToolCreate:
    return ToolCreate(name="t", description="a tool", type="python", handler="h", **kw)


def test_a_completes_variable_up_to_the_limit_is_kept():
    name = "v" * MAX_VARIABLE_NAME
    assert definition_from_body(tool(completes_variable=name), encrypt=str).completes_variable == name


@pytest.mark.parametrize("name", ["x" * 8192, "v" * (MAX_VARIABLE_NAME + 1), ""])
def test_a_completes_variable_that_could_not_be_stored_is_refused_at_registration(name):
    with pytest.raises(InvalidInput, match=rf"completes_variable must be 1-{MAX_VARIABLE_NAME} characters, "
                                           rf"got {len(name)}; .* - at `\$.completes_variable`"):
        definition_from_body(tool(completes_variable=name), encrypt=str)


def test_a_turn_not_saved_is_answered_alike_in_process_and_through_ray():
    exc = TurnNotSaved("the last turn of session 's1' could not be saved and was not acknowledged; "
                       "send the message again (the session continues from its saved state)")
    in_process = failure(exc, "req-1", "/v1/sessions/s1/messages")
    through_ray = failure(_host_exception(to_host_error(exc)), "req-1", "/v1/sessions/s1/messages")
    assert through_ray == in_process
    assert in_process[0] == 400 and in_process[2] == str(exc)


@pytest.mark.parametrize("stored", [1e308, 1e12, -100.0, 0.0])
def test_an_approval_ttl_stored_before_it_was_checked_gives_way_to_the_default(stored):
    # a bot config PUT before the range was checked may still hold one: the engine's default is used
    from services.botconfig import BotConfig, approval_ttl

    assert approval_ttl(BotConfig(approval_ttl_s=stored), 900.0) == 900.0
    assert approval_ttl(BotConfig(approval_ttl_s=60.0), 900.0) == 60.0
    assert approval_ttl(BotConfig(), 900.0) == 900.0


@pytest.mark.parametrize(("ttl", "accepted"), [
    (1, True), (900.0, True), (30 * 86400, True),
    (1e308, False), (1e12, False), (30 * 86400 + 1, False), (0.5, False), (0.0, False), (-100.0, False),
    (float("nan"), False), (float("inf"), False),
])
def test_the_put_check_and_the_stored_config_apply_one_approval_ttl_rule(ttl, accepted):
    # what PUT /v1/bot-config refuses is exactly what a stored config gives way to the default for
    from services.botconfig import BotConfig, approval_ttl, check_approval_ttl

    if accepted:
        check_approval_ttl(ttl)
        assert approval_ttl(BotConfig(approval_ttl_s=ttl), 900.0) == ttl
    else:
        with pytest.raises(InvalidInput, match=r"^approval_ttl_s must be a number of seconds from 1 to 2592000 "
                                               r"\(30 days\), got .* - at `\$\.approval_ttl_s`$") as info:
            check_approval_ttl(ttl)
        assert info.value.path == "$.approval_ttl_s"
        assert approval_ttl(BotConfig(approval_ttl_s=ttl), 900.0) == 900.0
    check_approval_ttl(None)  # left out: the engine's default
