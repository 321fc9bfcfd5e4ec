"""Which built-ins a tenant is offered: never one that could only answer "not set up"."""

from __future__ import annotations

import pytest

from services.builtins import DEFINITIONS, offered

ALWAYS = {"recall_memory", "collect_lead", "escalate_to_human"}
BOOKING = {"list_appointment_slots", "book_appointment"}


@pytest.mark.parametrize(("has_forms", "has_services", "expected"), [
    (False, False, ALWAYS),
    (True, False, ALWAYS | {"submit_form"}),
    (False, True, ALWAYS | BOOKING),
    (True, True, ALWAYS | BOOKING | {"submit_form"}),
])
def test_form_and_booking_tools_wait_for_a_form_and_a_service(has_forms, has_services, expected):
    names = [d.name for d in offered(DEFINITIONS, has_forms=has_forms, has_services=has_services)]
    assert set(names) == expected
    assert names == [d.name for d in DEFINITIONS if d.name in expected]  # order kept
