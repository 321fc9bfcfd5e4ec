"""How a streamed turn's error event from a session host becomes the error the gateway answers
(actors/placement.py): the same exception a JSON turn's HostResult error raises."""

from __future__ import annotations

import msgspec

from actors.placement import HostFailure, _host_error, _host_exception
from actors.ray_host import HostError
from kernel.errors import Overloaded


def raised(data) -> Exception:
    return _host_exception(_host_error(data))


def test_a_host_error_event_raises_what_the_json_turn_would():
    busy = raised(msgspec.to_builtins(HostError(kind="overloaded", message="too many", retry_after=2.0,
                                                reason="mailbox")))
    assert isinstance(busy, Overloaded) and (busy.status, busy.retry_after, str(busy)) == (429, 2.0, "too many")
    gone = raised(msgspec.to_builtins(HostError(kind="not_found", message="no pending approval 'ap-1'")))
    assert isinstance(gone, HostFailure) and gone.error.kind == "not_found"


def test_an_older_hosts_event_keeps_its_detail_and_its_retry():
    busy = raised({"title": "Overloaded", "detail": "this session host is at capacity", "retry_after": 1.5,
                   "reason": "host_busy"})
    assert isinstance(busy, Overloaded) and (busy.status, busy.retry_after) == (503, 1.5)
    assert str(busy) == "this session host is at capacity"
    failed = raised({"title": "turn failed", "detail": "KeyError"})
    assert isinstance(failed, HostFailure) and failed.error.kind == "internal" and str(failed) == "KeyError"
    assert raised("not even a dict").error.kind == "internal"
