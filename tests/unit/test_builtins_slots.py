"""Appointment slots from opening hours (pure): configuration checks, slot starts, daylight saving."""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest

from services.builtins.appointments import Schedule, normalise_opening_hours, service_from_body
from services.errors import InvalidInput


def test_opening_hours_accept_one_range_or_several_and_weekday_names():
    assert normalise_opening_hours({"Monday": ["09:00", "17:00"], "sat": [["13:00", "16:00"], ["09:00", "12:00"]],
                                    "sun": []}) == {
        "mon": [["09:00", "17:00"]], "sat": [["09:00", "12:00"], ["13:00", "16:00"]]}


@pytest.mark.parametrize(("hours", "message"), [
    ({"funday": ["09:00", "17:00"]}, r"'funday' is not a weekday; .* - at `\$.opening_hours.funday`"),
    ({"mon": ["9am", "17:00"]}, r"'9am' is not a time of day like \"09:00\" - at `\$.opening_hours.mon\[0\]`"),
    ({"mon": ["09:00", "24:30"]}, r"'24:30' is not a time of day"),
    ({"mon": ["17:00", "09:00"]}, r"closing time 09:00 is not after opening time 17:00"),
    ({"mon": [["09:00", "13:00"], ["12:00", "17:00"]]}, r"the opening ranges of mon overlap"),
    ({"mon": "09:00-17:00"}, r"opening hours of mon must be \[open, close\]"),
    ({"mon": ["09:00", "12:00"], "monday": ["13:00", "17:00"]}, r"'monday' is given twice"),
])
def test_malformed_opening_hours_name_the_day_and_the_problem(hours, message):
    with pytest.raises(InvalidInput, match=message):
        normalise_opening_hours(hours)


@pytest.mark.parametrize(("body", "message"), [
    ({"duration_minutes": 0, "opening_hours": {}}, r"duration_minutes must be a whole number of minutes from 5 to 1440"),
    ({"duration_minutes": 30, "timezone": "Mars/Base", "opening_hours": {}}, r"timezone 'Mars/Base' is not an IANA time zone"),
    ({"duration_minutes": 30}, r"opening_hours is required"),
    ({"duration_minutes": 30, "opening_hours": {}, "price": 3}, r"unknown field 'price'"),
])
def test_a_service_body_is_checked_field_by_field(body, message):
    with pytest.raises(InvalidInput, match=message):
        service_from_body("cut", body)


def schedule(hours: dict, minutes: int = 60, zone: str = "Europe/Berlin") -> Schedule:
    return Schedule(service_from_body("svc", {"duration_minutes": minutes, "timezone": zone, "opening_hours": hours}))


def test_slots_step_by_duration_and_end_by_closing_time():
    s = schedule({"wed": ["09:00", "11:45"]}, minutes=45)
    assert [t.astimezone(s.zone).strftime("%H:%M") for t in s.slots_on(date(2026, 7, 1))] == ["09:00", "09:45", "10:30"]
    assert s.slots_on(date(2026, 7, 2)) == []  # Thursday: closed


def test_a_day_that_skips_an_hour_has_no_slot_in_it_and_keeps_local_times():
    s = schedule({"sun": ["00:00", "24:00"]})
    spring = s.slots_on(date(2026, 3, 29))  # Berlin: 02:00 -> 03:00
    assert len(spring) == 23
    assert "02:00" not in [t.astimezone(s.zone).strftime("%H:%M") for t in spring]
    autumn = s.slots_on(date(2026, 10, 25))  # 03:00 -> 02:00: local 02:00 once, the first one
    assert len(autumn) == 24


def test_is_slot_start_checks_day_alignment_and_seconds():
    s = schedule({"wed": ["09:00", "12:00"]}, minutes=30)
    assert s.is_slot_start(datetime(2026, 7, 1, 7, 30, tzinfo=UTC))  # 09:30 Berlin
    assert not s.is_slot_start(datetime(2026, 7, 1, 7, 40, tzinfo=UTC))
    assert not s.is_slot_start(datetime(2026, 7, 1, 7, 30, 5, tzinfo=UTC))
    assert s.is_slot_start(datetime(2026, 7, 1, 9, 30, tzinfo=UTC))  # 11:30 local ends at closing
    assert not s.is_slot_start(datetime(2026, 7, 1, 10, 0, tzinfo=UTC))  # 12:00 local: closed


def test_free_slots_skip_busy_ranges_and_the_past():
    s = schedule({"wed": ["09:00", "12:00"]}, minutes=30)
    busy = [(datetime(2026, 7, 1, 8, 0, tzinfo=UTC), datetime(2026, 7, 1, 9, 0, tzinfo=UTC))]  # 10:00-11:00 local
    free = s.free_slots(busy, after=datetime(2026, 7, 1, 7, 15, tzinfo=UTC), first_day=date(2026, 7, 1), days=1, limit=10)
    assert [s.show(t) for t in free] == ["2026-07-01T09:30+02:00", "2026-07-01T11:00+02:00", "2026-07-01T11:30+02:00"]
