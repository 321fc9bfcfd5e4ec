"""Appointment slots from opening hours (pure): configuration checks, slot starts, daylight saving."""

from __future__ import annotations

import itertools
from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest

from kernel.errors import InvalidInput
from services.builtins.appointments import (
    Schedule,
    normalise_opening_hours,
    parse_start,
    service_from_body,
)
from services.tools.errors import InvalidArguments


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


# -- daylight saving in a zone with it: New York skips 02:00-03:00 on 2026-03-08, repeats 01:00-02:00
# on 2026-11-01 (both Sundays)
NEW_YORK = ZoneInfo("America/New_York")


def shown(s: Schedule, day: date) -> list[str]:
    return [s.show(t) for t in s.slots_on(day)]


def test_a_slot_before_the_spring_change_lasts_its_duration_of_real_time():
    s = schedule({"sun": ["00:00", "06:00"]}, minutes=90, zone="America/New_York")
    slots = s.slots_on(date(2026, 3, 8))
    assert [s.show(t) for t in slots] == ["2026-03-08T00:00-05:00", "2026-03-08T01:30-05:00",
                                          "2026-03-08T03:00-04:00", "2026-03-08T04:30-04:00"]
    # 01:30 EST + 90 min is 04:00 EDT: it overlaps the 03:00 slot, and booking one takes the other
    taken = [(slots[1], slots[1] + s.duration)]
    assert s.show(slots[1] + s.duration) == "2026-03-08T04:00-04:00"
    free = s.free_slots(taken, after=datetime(2026, 3, 1, tzinfo=UTC), first_day=date(2026, 3, 8), days=1, limit=10)
    assert [s.show(t) for t in free] == ["2026-03-08T00:00-05:00", "2026-03-08T04:30-04:00"]


def test_a_slot_that_would_run_past_closing_in_real_time_is_no_slot():
    # open 00:00-03:00 local is two real hours that day: 01:30 EST + 90 min is 04:00 EDT, after closing
    s = schedule({"sun": ["00:00", "03:00"]}, minutes=90, zone="America/New_York")
    assert shown(s, date(2026, 3, 8)) == ["2026-03-08T00:00-05:00"]
    assert shown(s, date(2026, 3, 15)) == ["2026-03-15T00:00-04:00", "2026-03-15T01:30-04:00"]
    # the day the clocks go back has an hour more: 01:30 EDT + 90 min is 02:00 EST, closing time
    assert shown(s, date(2026, 11, 1)) == ["2026-11-01T00:00-04:00", "2026-11-01T01:30-04:00"]


def test_a_slot_in_the_repeated_hour_is_its_first_occurrence_and_lasts_its_duration():
    s = schedule({"sun": ["00:00", "06:00"]}, minutes=30, zone="America/New_York")
    slots = s.slots_on(date(2026, 11, 1))
    assert "2026-11-01T01:30-04:00" in [s.show(t) for t in slots]
    assert "2026-11-01T01:30-05:00" not in [s.show(t) for t in slots]
    assert s.is_slot_start(datetime(2026, 11, 1, 5, 30, tzinfo=UTC))  # 01:30 EDT
    assert not s.is_slot_start(datetime(2026, 11, 1, 6, 30, tzinfo=UTC))  # 01:30 EST, the second one
    assert all(b - a >= s.duration for a, b in itertools.pairwise(slots))


def test_a_local_start_that_does_not_exist_is_refused_naming_the_field():
    with pytest.raises(InvalidArguments, match=r"'start' 2026-03-08T02:30 does not exist in America/New_York: the "
                                               r"clocks skip that hour for daylight saving") as caught:
        parse_start("2026-03-08T02:30", NEW_YORK)
    assert "pick another time" in caught.value.advice
    with pytest.raises(InvalidArguments, match=r"'day' 2026-03-08T02:00 does not exist"):
        parse_start("2026-03-08T02:00", NEW_YORK, "day")


@pytest.mark.parametrize(("raw", "instant"), [
    ("2026-11-01T01:30", datetime(2026, 11, 1, 5, 30, tzinfo=UTC)),  # occurs twice: the first (EDT)
    ("2026-11-01T01:30-05:00", datetime(2026, 11, 1, 6, 30, tzinfo=UTC)),  # an offset picks the second
    ("2026-03-08T01:30", datetime(2026, 3, 8, 6, 30, tzinfo=UTC)),
    ("2026-03-08T03:00", datetime(2026, 3, 8, 7, 0, tzinfo=UTC)),
])
def test_a_local_start_resolves_to_one_instant(raw, instant):
    assert parse_start(raw, NEW_YORK) == instant
