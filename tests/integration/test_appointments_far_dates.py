"""Far-off days for listing appointment slots (far-off starts: test_builtins_appointments): an in-band InvalidArguments naming the field
and the bookable days, never a crash (before: OverflowError, logged as tool_crashed, and the
contact heard a generic "cannot complete this right now")."""

from __future__ import annotations

import pytest

from services.tools.errors import InvalidArguments
from tests.support.appointments import BOOKABLE, NOW, tenant_with_services
from tests.support.builtin_services import ctx, services


@pytest.mark.parametrize(("args", "message"), [
    ({"day": "9999-12-31"}, r"'day' 9999-12-31 is more than 366 days ahead" + BOOKABLE),
    ({"day": "2027-07-03"}, r"'day' 2027-07-03 is more than 366 days ahead" + BOOKABLE),
    ({"day": "9999-12-31T23:30-12:00"}, r"'day' 9999-12-31T23:30-12:00 is too far off to book" + BOOKABLE),
    ({"day": "0001-01-01T00:00+14:00"}, r"'day' 0001-01-01T00:00\+14:00 is too far off to book" + BOOKABLE),
    ({"day": "next tuesday"}, r"'day' is not a date and time: 'next tuesday'"),
])
async def test_listing_a_far_off_day_names_the_field_and_the_bookable_days(pool, make_tenant, args, message):
    async with services(pool, now=NOW) as (svc, _configs):
        tenant = await tenant_with_services(make_tenant, svc)
        with pytest.raises(InvalidArguments, match=message) as caught:
            await svc.appointments.list_slots(args, ctx(tenant.id))
        if "bookable" in message:
            assert "from 2026-07-01 to 2027-07-02" in caught.value.advice


async def test_the_last_bookable_day_and_a_day_long_past_still_list(pool, make_tenant):
    async with services(pool, now=NOW) as (svc, _configs):
        tenant = await tenant_with_services(make_tenant, svc)
        last = await svc.appointments.list_slots({"day": "2027-07-02"}, ctx(tenant.id))
        assert last["day"] == "2027-07-02" and last["free_slots"]
        ancient = await svc.appointments.list_slots({"day": "0001-01-01"}, ctx(tenant.id))
        assert ancient["note"] == "0001-01-01 is in the past; these are the next free slots"
        assert ancient["free_slots"][0] == "2026-07-01T10:30+02:00"
