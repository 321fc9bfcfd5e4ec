"""An appointment service on a new tenant, the day the appointment tests run on, and what a
refusal of a far-off day adds (tests/integration/test_builtins_appointments.py and
test_appointments_far_dates.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from services.builtins.appointments import service_from_body

NOW = datetime(2026, 7, 1, 8, 0, tzinfo=UTC)  # Wednesday, 10:00 in Berlin
HAIRCUT = {"duration_minutes": 30, "timezone": "Europe/Berlin",
           "opening_hours": {"mon": [["09:00", "12:00"], ["13:00", "17:00"]], "tue": ["09:00", "17:00"],
                             "wed": ["09:00", "17:00"], "thu": ["09:00", "17:00"], "fri": ["09:00", "12:00"]}}


async def tenant_with_services(make_tenant, svc, **extra):
    tenant, _ = await make_tenant("appt")
    await svc.repos.appointments.put_service(tenant.id, service_from_body("haircut", HAIRCUT))
    for name, body in extra.items():
        await svc.repos.appointments.put_service(tenant.id, service_from_body(name, body))
    return tenant


#: what a refusal of a far-off day or start adds: the days that can be booked
BOOKABLE = r"; the bookable days are 2026-07-01 to 2027-07-02 \(Europe/Berlin\)"
