"""Edges of the built-in tools where the model was told one thing and the engine did another: a
service name with a space around it (saved, but never nameable by the model), the last bookable
day (listed, then refused; offers past it), and a second submission of a form in one message
(dropped while the model heard "submitted")."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from services.builtins.appointments import service_from_body
from services.builtins.forms import check_form
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from services.tools.errors import InvalidArguments
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from tests.support.builtin_services import ctx, services, through_executor
from tests.support.gateways import FakeRouter, problem_of

NOW = datetime(2026, 7, 1, 8, 0, tzinfo=UTC)  # Wednesday, 10:00 in Berlin
EVERY_DAY = {"duration_minutes": 60, "timezone": "Europe/Berlin",
             "opening_hours": {d: ["09:00", "17:00"] for d in ("mon", "tue", "wed", "thu", "fri", "sat", "sun")}}


@pytest_asyncio.fixture
async def gateway(pool, make_tenant) -> AsyncIterator[tuple[TestClient, dict[str, str]]]:
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]))
    _, key = await make_tenant("edges")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, {"Authorization": f"Bearer {key.api_key}"}


# -- a service name with a space around it ----------------------------------------------------

@pytest.mark.parametrize(("path", "message"), [
    ("haircut%20", "service name 'haircut ' ends with a space; name it 'haircut'"),
    ("%20haircut", "service name ' haircut' starts with a space; name it 'haircut'"),
    ("%20haircut%20", "service name ' haircut ' starts and ends with a space; name it 'haircut'"),
])
async def test_a_service_name_with_a_space_around_it_is_refused_for_the_admin(gateway, path, message):
    client, headers = gateway
    r = await client.put(f"/v1/appointment-services/{path}", headers=headers,
                         json={"duration_minutes": 30, "opening_hours": {"mon": ["09:00", "17:00"]}})
    assert message in await problem_of(r, 422)
    listed = await client.get("/v1/appointment-services", headers=headers)
    assert (await listed.json())["services"] == []
    # the name inside may still hold spaces
    r = await client.put("/v1/appointment-services/hair%20cut", headers=headers,
                         json={"duration_minutes": 30, "opening_hours": {"mon": ["09:00", "17:00"]}})
    assert r.status == 200 and (await r.json())["name"] == "hair cut"


async def test_a_service_saved_earlier_with_a_trailing_space_is_listed_and_booked_by_its_name(pool, make_tenant):
    tenant, _ = await make_tenant("edges")
    async with services(pool, now=NOW) as (svc, _configs):
        # saved before the admin route refused such names (put_service itself does not check)
        await svc.repos.appointments.put_service(
            tenant.id, msgspec.structs.replace(service_from_body("haircut", EVERY_DAY), name="haircut "))
        await svc.repos.appointments.put_service(tenant.id, service_from_body("massage", EVERY_DAY))
        for name in ("haircut ", "haircut", "Haircut"):  # as the service list shows it, trimmed, or cased
            listing = await svc.appointments.list_slots({"service": name}, ctx(tenant.id))
            assert listing["service"] == "haircut " and listing["free_slots"][0] == "2026-07-01T11:00+02:00"
        booked = await svc.appointments.book({"service": "haircut ", "start": "2026-07-01T11:00"}, ctx(tenant.id))
        assert booked["status"] == "booked" and booked["service"] == "haircut "
        assert [r.service for r in await svc.repos.appointments.list(tenant.id)] == ["haircut "]


# -- the last bookable day ------------------------------------------------------------------------

async def test_every_slot_listed_on_the_last_bookable_day_can_be_booked_and_none_after_it(pool, make_tenant):
    tenant, _ = await make_tenant("edges")
    async with services(pool, now=NOW) as (svc, _configs):
        await svc.repos.appointments.put_service(tenant.id, service_from_body("consult", EVERY_DAY))
        last = await svc.appointments.list_slots({"day": "2027-07-02"}, ctx(tenant.id))  # today + 366 days
        assert last["free_slots"][-1] == "2027-07-02T16:00+02:00"  # later in the day than now (10:00)
        booked = await svc.appointments.book({"start": "2027-07-02T16:00"}, ctx(tenant.id))
        assert booked["status"] == "booked" and booked["start"] == "2027-07-02T16:00+02:00"
        # the day after is refused, naming the bookable days the listing kept to
        with pytest.raises(InvalidArguments, match=r"'start' 2027-07-03T09:00\+02:00 is more than 366 days ahead; "
                                                   r"the bookable days are 2026-07-01 to 2027-07-02"):
            await svc.appointments.book({"start": "2027-07-03T09:00"}, ctx(tenant.id))


THU_FRI = {"duration_minutes": 60, "timezone": "UTC",
           "opening_hours": {"thu": ["09:00", "10:00"], "fri": ["09:00", "10:00"]}}
FRIDAY = datetime(2026, 7, 3, 8, 0, tzinfo=UTC)  # + 366 days: Sunday 2027-07-04, the last bookable day


async def test_the_next_free_slots_a_listing_offers_stop_at_the_last_bookable_day(pool, make_tenant):
    tenant, _ = await make_tenant("edges")
    async with services(pool, now=FRIDAY) as (svc, _configs):
        await svc.repos.appointments.put_service(tenant.id, service_from_body("consult", THU_FRI))
        wednesday = await svc.appointments.list_slots({"day": "2027-06-30"}, ctx(tenant.id))  # closed
        assert wednesday["free_slots"] == []
        assert wednesday["next_free_slots"] == ["2027-07-01T09:00+00:00", "2027-07-02T09:00+00:00"]
        for start in wednesday["next_free_slots"]:
            assert (await svc.appointments.book({"start": start}, ctx(tenant.id)))["status"] == "booked"

        saturday = await svc.appointments.list_slots({"day": "2027-07-03"}, ctx(tenant.id))
        assert (saturday["free_slots"], saturday["next_free_slots"]) == ([], [])
        assert saturday["note"] == "no free slots that day nor on any day up to 2027-07-04, the last day that can be booked yet"
        sunday = await svc.appointments.list_slots({"day": "2027-07-04"}, ctx(tenant.id))
        assert (sunday["next_free_slots"], sunday["note"]) == ([], "no free slots that day, the last day that can be booked yet")


async def test_the_slots_a_refused_booking_offers_stop_at_the_last_bookable_day(pool, make_tenant):
    tenant, _ = await make_tenant("edges")
    async with services(pool, now=FRIDAY) as (svc, _configs):
        await svc.repos.appointments.put_service(tenant.id, service_from_body("consult", THU_FRI))
        with pytest.raises(InvalidArguments, match="is not a slot of consult") as caught:
            await svc.appointments.book({"start": "2027-07-01T09:30"}, ctx(tenant.id))
        assert caught.value.advice == ("Offer the customer a free slot instead: 2027-07-02T09:00+00:00 (UTC); "
                                       "book the one they choose.")
        with pytest.raises(InvalidArguments, match="is not a slot of consult") as caught:
            await svc.appointments.book({"start": "2027-07-02T09:30"}, ctx(tenant.id))
        assert caught.value.advice == ("Tell the customer there are no free slots for consult from 2027-07-02 "
                                       "to 2027-07-04, the last day that can be booked yet.")


# -- a second submission of a form in one message -------------------------------------------------

async def test_a_second_submission_of_a_form_with_other_answers_in_one_message_is_refused_in_band(pool, make_tenant):
    tenant, _ = await make_tenant("edges")
    async with services(pool) as (svc, _configs):
        await svc.repos.forms.put(tenant.id, "registration", check_form("registration", {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}))
        c = ctx(tenant.id, "s-edges", key="m1")
        first = await through_executor(svc, c, "submit_form", {"form": "registration", "data": {"name": "Ann"}}, "toolu_1")
        assert first.success, first.content
        # "me and my wife": the model submits the form again for the second person, in the same message
        second = await through_executor(svc, c, "submit_form", {"form": "registration", "data": {"name": "Bob"}}, "toolu_2")
        assert not second.success and second.error_kind == "policy_denied"
        assert "form 'registration' was already submitted in this message, with other answers; " \
               "these answers were not stored" in second.content
        assert "ask the customer to send them in a new message" in second.content
        assert "Bob" not in second.content  # the answers are the contact's: never quoted back
        assert [r.data for r in await svc.repos.forms.submissions(tenant.id, "registration")] == [{"name": "Ann"}]

        # the same answers again (the turn re-run after a crash): submitted, the first row
        again = await through_executor(svc, c, "submit_form", {"form": "registration", "data": {"name": "Ann"}}, "toolu_7")
        assert again.success and json.loads(again.content) == json.loads(first.content)
        # answers Postgres keeps only in part (a NUL, a lone surrogate) or in its own words (1e300
        # comes back as a 301-digit integer) are the same answers too
        odd = {"name": "Ann\x00 \udc80", "size": 1e300, "ratio": 0.1}
        c3 = ctx(tenant.id, "s-edges", key="m3")
        stored = await through_executor(svc, c3, "submit_form", {"form": "registration", "data": odd}, "toolu_1")
        rerun = await through_executor(svc, c3, "submit_form", {"form": "registration", "data": odd}, "toolu_7")
        assert stored.success and rerun.success and json.loads(rerun.content) == json.loads(stored.content)

        # sent in a new message, the second person's form is stored
        bob = await through_executor(svc, ctx(tenant.id, "s-edges", key="m2"), "submit_form",
                                     {"form": "registration", "data": {"name": "Bob"}}, "toolu_1")
        assert bob.success
        names = sorted(r.data["name"] for r in await svc.repos.forms.submissions(tenant.id, "registration"))
        assert names == ["Ann", "Ann\ufffd ?", "Bob"]
