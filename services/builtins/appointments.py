"""book_appointment and list_appointment_slots: tenant-configured services, free slots, bookings.

A service (ce_appointment_services) has a duration, a time zone and weekly opening hours
(`{"mon": [["09:00", "17:00"]], ...}`; "24:00" closes at midnight). Slots start at each opening
time and every `duration` after it, in the service's local time, while the slot still ends by
closing time. A booking must start exactly on a slot.

Daylight saving: slot starts are local clock times, but a slot lasts `duration` of real time, its
end (and "ends by closing time") reckoned in UTC, where listing and booking both reckon it. So on
a day the clocks skip an hour, a slot that starts before the change ends `duration` later on the
new clock (01:30-05:00 + 90 min is 04:00-04:00) and may overlap the next local slot (03:00): both
are listed while free, and booking either takes the other. A local time that does not exist
(02:30 that day in New York) is no slot, and a `start` naming it is refused in-band. A local time
that occurs twice (the hour repeated when the clocks go back) means its first occurrence (fold=0,
still on summer time) wherever it is given without an offset, and only that one is a slot.

Two sessions racing for one slot cannot both win: Postgres refuses the second insert through
the exclusion constraint on (tenant, service, time range) of ce_appointments, and the loser gets
an in-band "that slot was just taken" with the next free slots to offer.

book_appointment is a write tool, so the engine's approval flow asks before it runs. Because
that would also hold a mere listing for approval, listing has its own read tool,
list_appointment_slots; book_appointment without `start` (or with action "list") lists as well.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kernel.errors import InvalidInput
from services.builtins.base import Now, TenantConfigs, clip, utc_now
from services.builtins.memory import MemoryService
from services.builtins.notify import Notifier
from services.tools.context import TrustedContext
from services.tools.errors import InvalidArguments, PolicyDenied, ToolError
from services.tools.model import PythonTool
from storage.repos.builtins import ServiceRecord, SlotTaken

LIST_HANDLER = "builtin.list_appointment_slots"
BOOK_HANDLER = "builtin.book_appointment"
EVENT = "appointment.booked"
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
LIST_DAYS = 14  # how far ahead a listing looks
# how far ahead a booking may be: any slot on a local day up to today + MAX_AHEAD_DAYS (the last
# bookable day, whole), so that a listing and a booking of that day agree
MAX_AHEAD_DAYS = 366
LIST_LIMIT = 12
OFFER_LIMIT = 5
_HHMM_RE = re.compile(r"^([01]\d|2[0-4]):([0-5]\d)\Z")
_SERVICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}\Z")

_SERVICE_PROP = {"type": "string", "maxLength": 64,
                 "description": "the service to book, by name; may be left out when the business offers only one"}

BOOK_DEFINITION = PythonTool(
    name="book_appointment",
    description=(
        "Book an appointment for the customer: give the service and `start` (ISO 8601 date and "
        "time of one of the free slots, e.g. 2026-07-02T10:00). Without `start` it lists the free "
        "slots instead. The customer is asked to confirm before it is booked."
    ),
    parameters={
        "type": "object",
        "properties": {
            "service": _SERVICE_PROP,
            "start": {"type": "string", "maxLength": 40,
                      "description": "slot start, ISO 8601 date and time in the service's time zone unless an offset is given; a date alone lists that day"},
            "action": {"type": "string", "enum": ["book", "list"],
                       "description": "'list' to see free slots; default: book when start is given"},
        },
        "additionalProperties": False,
    },
    mutability="write",
    handler=BOOK_HANDLER,
)

LIST_DEFINITION = PythonTool(
    name="list_appointment_slots",
    description=(
        "List the free appointment slots of a service for the next days (or of one `day`). Use "
        "when the customer asks when they can come or what times are available."
    ),
    parameters={
        "type": "object",
        "properties": {
            "service": _SERVICE_PROP,
            "day": {"type": "string", "maxLength": 10, "description": "a date (YYYY-MM-DD) to list just that day"},
        },
        "additionalProperties": False,
    },
    mutability="read",
    handler=LIST_HANDLER,
)


# ------------------------------------------------------------------------ configuration (pure)

def _minutes(text: Any, path: str) -> int:
    match = _HHMM_RE.match(text) if isinstance(text, str) else None
    if match is None or (match.group(1) == "24" and match.group(2) != "00"):
        raise InvalidInput(f"{text!r} is not a time of day like \"09:00\" - at `{path}`", path=path)
    return int(match.group(1)) * 60 + int(match.group(2))


def normalise_opening_hours(raw: Any, *, path: str = "$.opening_hours") -> dict[str, list[list[str]]]:
    """`{"mon": ["09:00", "17:00"]}` or `{"mon": [["09:00", "12:00"], ["13:00", "17:00"]]}` (weekday
    names or three-letter keys) as {"mon": [["09:00", "17:00"], ...]}, ranges sorted.

    Raises InvalidInput naming the weekday and the problem (unknown day, bad time, closing not
    after opening, overlapping ranges)."""
    if not isinstance(raw, dict):
        raise InvalidInput(f"opening hours must be an object of weekday -> [open, close] - at `{path}`", path=path)
    out: dict[str, list[list[str]]] = {}
    for key, value in raw.items():
        day = str(key).strip().lower()[:3]
        where = f"{path}.{key}"
        if day not in WEEKDAYS or str(key).strip().lower() not in (day, _full_day(day)):
            raise InvalidInput(f"{key!r} is not a weekday; use mon, tue, wed, thu, fri, sat or sun - at `{where}`",
                               path=where)
        if day in out:
            raise InvalidInput(f"{key!r} is given twice - at `{where}`", path=where)
        if not isinstance(value, list):
            raise InvalidInput(f"opening hours of {day} must be [open, close] or a list of them - at `{where}`",
                               path=where)
        ranges = [value] if len(value) == 2 and all(isinstance(v, str) for v in value) else value
        parsed: list[tuple[int, int]] = []
        for i, pair in enumerate(ranges):
            at = f"{where}[{i}]" if ranges is value else where
            if not (isinstance(pair, list) and len(pair) == 2):
                raise InvalidInput(f"each range must be [open, close] like [\"09:00\", \"17:00\"] - at `{at}`", path=at)
            start, end = _minutes(pair[0], at + "[0]"), _minutes(pair[1], at + "[1]")
            if end <= start:
                raise InvalidInput(f"closing time {pair[1]} is not after opening time {pair[0]} - at `{at}`", path=at)
            parsed.append((start, end))
        parsed.sort()
        for (_, end_a), (start_b, _) in itertools.pairwise(parsed):
            if start_b < end_a:
                raise InvalidInput(f"the opening ranges of {day} overlap - at `{where}`", path=where)
        if parsed:
            out[day] = [[_hhmm(s), _hhmm(e)] for s, e in parsed]
    return {d: out[d] for d in WEEKDAYS if d in out}


def _full_day(day: str) -> str:
    return {"mon": "monday", "tue": "tuesday", "wed": "wednesday", "thu": "thursday", "fri": "friday",
            "sat": "saturday", "sun": "sunday"}[day]


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def service_from_body(name: str, body: dict[str, Any]) -> ServiceRecord:
    """A ServiceRecord from an admin body `{duration_minutes, timezone?, opening_hours}`.

    Raises InvalidInput naming the field: unknown fields, a duration outside 5..1440 minutes,
    an unknown IANA time zone, malformed opening hours, a name that is not 1-64 letters, digits,
    spaces or . _ -, or one that starts or ends with a space (the model's service names are
    trimmed, so "haircut " could never be named)."""
    if isinstance(name, str) and name != name.strip(" ") and _SERVICE_NAME_RE.match(name.strip(" ")):
        where = "starts and ends" if name[0] == name[-1] == " " else ("starts" if name[0] == " " else "ends")
        shown = name if len(name) <= 70 else clip(name, 70)  # clip would trim the very spaces at fault
        raise InvalidInput(f"service name {shown!r} {where} with a space; name it {name.strip(' ')!r} "
                           "(the assistant names services without surrounding spaces)")
    if not _SERVICE_NAME_RE.match(name or ""):
        raise InvalidInput(f"service name {clip(name, 70)!r} must be 1-64 letters, digits, spaces or . _ - "
                           "and start with a letter or digit")
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object", path="$")
    unknown = sorted(set(body) - {"duration_minutes", "timezone", "opening_hours", "name"})
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r}; allowed: duration_minutes, timezone, opening_hours - at `$.{unknown[0]}`",
                           path=f"$.{unknown[0]}")
    duration = body.get("duration_minutes")
    if not isinstance(duration, int) or isinstance(duration, bool) or not 5 <= duration <= 1440:
        raise InvalidInput("duration_minutes must be a whole number of minutes from 5 to 1440 - at `$.duration_minutes`",
                           path="$.duration_minutes")
    zone = body.get("timezone", "UTC")
    if not isinstance(zone, str) or not _zone_ok(zone):
        raise InvalidInput(f"timezone {clip(str(zone), 60)!r} is not an IANA time zone like Europe/Berlin - at `$.timezone`",
                           path="$.timezone")
    if "opening_hours" not in body:
        raise InvalidInput("opening_hours is required, e.g. {\"mon\": [\"09:00\", \"17:00\"]} - at `$.opening_hours`",
                           path="$.opening_hours")
    hours = normalise_opening_hours(body["opening_hours"])
    return ServiceRecord(name=name, duration_minutes=duration, timezone=zone, opening_hours=hours)


def _zone_ok(name: str) -> bool:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return False
    return True


# ------------------------------------------------------------------------------ slots (pure)

class Schedule:
    """A service's weekly slots in its time zone."""

    def __init__(self, service: ServiceRecord) -> None:
        self.service = service
        self.zone = ZoneInfo(service.timezone)
        self.duration = timedelta(minutes=service.duration_minutes)
        self._ranges: dict[int, list[tuple[int, int]]] = {
            WEEKDAYS.index(day): [(_minutes(a, day), _minutes(b, day)) for a, b in ranges]
            for day, ranges in service.opening_hours.items() if day in WEEKDAYS
        }

    def slots_on(self, day: date) -> list[datetime]:
        """The slot starts of one local day, as aware UTC datetimes, in order: every `duration` of
        local clock time from each opening time, each that exists and ends (`duration` of real
        time later) by the closing time."""
        out = []
        step = self.service.duration_minutes
        midnight = datetime.combine(day, time(0))
        for start, end in self._ranges.get(day.weekday(), ()):
            # a closing time the clocks skip that day is read as if they had not changed yet
            # (fold=0): 02:30 closes at 03:30 on the new clock, as many hours after opening as ever
            closes = (midnight + timedelta(minutes=end)).replace(tzinfo=self.zone).astimezone(UTC)
            m = start
            while m < end:
                slot = utc_instant(midnight + timedelta(minutes=m), self.zone)
                if slot is not None and slot + self.duration <= closes:
                    out.append(slot)
                m += step
        return out

    def is_slot_start(self, start: datetime) -> bool:
        """True when `start` (aware) is exactly one of the service's slot starts."""
        local = start.astimezone(self.zone)
        if local.second or local.microsecond:
            return False
        return start.astimezone(UTC) in self.slots_on(local.date())

    def local_day(self, moment: datetime) -> date:
        return moment.astimezone(self.zone).date()

    def free_slots(self, busy: Iterable[tuple[datetime, datetime]], *, after: datetime, first_day: date,
                   days: int, limit: int) -> list[datetime]:
        """Up to `limit` slot starts later than `after` on `days` local days from `first_day` that
        overlap no (start, end) in `busy`."""
        taken = sorted(busy)
        out: list[datetime] = []
        for offset in range(days):
            for slot in self.slots_on(first_day + timedelta(days=offset)):
                if slot <= after:
                    continue
                end = slot + self.duration
                if any(b0 < end and slot < b1 for b0, b1 in taken):
                    continue
                out.append(slot)
                if len(out) >= limit:
                    return out
        return out

    def show(self, slot: datetime) -> str:
        """A slot as ISO 8601 local time with offset, minutes precision (what `start` accepts)."""
        return slot.astimezone(self.zone).isoformat(timespec="minutes")

    def describe(self, slots: list[datetime]) -> str:
        """"Thu 02 Jul: 09:00, 09:30; Fri 03 Jul: 09:00" (local time)."""
        by_day: dict[str, list[str]] = {}
        for s in slots:
            local = s.astimezone(self.zone)
            by_day.setdefault(local.strftime("%a %d %b"), []).append(local.strftime("%H:%M"))
        return "; ".join(f"{d}: {', '.join(times)}" for d, times in by_day.items())


def utc_instant(local: datetime, zone: ZoneInfo) -> datetime | None:
    """The UTC instant of the naive local time `local` in `zone`: its first occurrence (fold=0)
    when the clocks go back, None when it does not exist (the hour skipped when they go forward)."""
    instant = local.replace(tzinfo=zone, fold=0).astimezone(UTC)
    return instant if instant.astimezone(zone).replace(tzinfo=None) == local else None


def parse_start(raw: Any, zone: ZoneInfo, field: str = "start") -> datetime | date:
    """A booking start (an aware UTC datetime; naive input is local time in `zone`, a time that
    occurs twice meaning its first occurrence) or a day (date alone). Raises InvalidArguments
    naming `field`, also for a local time that does not exist in `zone` (skipped by a daylight
    saving change). The value may lie anywhere in the calendar: the service checks it against
    the bookable days (AppointmentService._day, ._local)."""
    text = str(raw).strip() if raw is not None else ""
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        try:
            return date.fromisoformat(text)
        except ValueError:
            pass
    else:
        try:
            value = datetime.fromisoformat(text)
        except ValueError:
            value = None
        if value is not None and value.tzinfo is not None:
            return value
        if value is not None:
            try:
                instant = utc_instant(value, zone)
            except OverflowError:  # 0001-01-01T00:00 in a zone east of UTC: the service says how far off
                return value.replace(tzinfo=zone)
            if instant is None:
                raise InvalidArguments(
                    f"'{field}' {value.isoformat(timespec='minutes')} does not exist in {zone.key}: the clocks "
                    "skip that hour for daylight saving",
                    advice="Ask the customer to pick another time, or list the free slots of that day.",
                )
            return instant
    raise InvalidArguments(
        f"'{field}' is not a date and time: {clip(text, 40)!r} - use ISO 8601 like 2026-07-02T10:00",
        advice="Ask the customer which day and time they want, or list the free slots first.",
    )


class SlotUnavailable(ToolError):
    """The slot was taken (by a concurrent booking or earlier); `reason` says so, advice offers others."""

    kind = "slot_taken"
    counts_for_breaker = False


# ------------------------------------------------------------------------------------ service

class AppointmentStore(Protocol):
    async def get_service(self, tenant_id: str, name: str) -> ServiceRecord | None: ...
    async def list_services(self, tenant_id: str) -> list[ServiceRecord]: ...
    async def busy(self, tenant_id: str, service: str, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]: ...
    async def book(self, tenant_id: str, service: str, starts_at: datetime, ends_at: datetime, *,
                   session_id: str | None, contact_name: str | None = None, contact_email: str | None = None,
                   idempotency_key: str | None = None, announce: Any = None) -> tuple[Any, bool]: ...
    async def booked_by(self, tenant_id: str, service: str, starts_at: datetime, session_id: str) -> Any: ...


class LeadLookup(Protocol):
    async def for_session(self, tenant_id: str, session_id: str) -> Any: ...


class AppointmentService:
    def __init__(self, store: AppointmentStore, *, configs: TenantConfigs, notifier: Notifier,
                 memory: MemoryService | None = None, leads: LeadLookup | None = None, now: Now = utc_now) -> None:
        self._store = store
        self._configs = configs
        self._notifier = notifier
        self._memory = memory
        self._leads = leads
        self._now = now

    async def _service(self, tenant_id: str, name: Any) -> Schedule:
        wanted = str(name).strip() if isinstance(name, str) and name.strip() else None
        if wanted is not None:
            found = await self._store.get_service(tenant_id, wanted)
            if found is not None:
                return Schedule(found)
        services = await self._store.list_services(tenant_id)
        if not services:
            raise PolicyDenied(
                "this business has no bookable services set up",
                advice="Tell the customer you cannot book appointments here and offer another way to help.",
            )
        if wanted is not None:
            # trimmed on both sides: the admin routes refuse a name with surrounding spaces, but a
            # service saved before they did ("haircut ") must still be found by its name
            folded = [s for s in services if s.name.strip().lower() == wanted.lower()]
            if len(folded) == 1:
                return Schedule(folded[0])
        if wanted is None and len(services) == 1:
            return Schedule(services[0])
        names = ", ".join(s.name for s in services[:20])
        what = f"there is no service named {clip(wanted, 40)!r}" if wanted else "'service' is required"
        raise InvalidArguments(
            f"{what}; the services are: {names}",
            advice="Ask the customer which of these services they want, then call the tool again with it.",
        )

    async def _free(self, tenant_id: str, schedule: Schedule, *, first_day: date, days: int, limit: int,
                    after: datetime | None = None) -> list[datetime]:
        """Free slots on `days` days from `first_day`, but none after the last bookable day (every
        slot offered can be booked), later than now (and than `after`)."""
        days = min(days, (self._bookable_days(schedule)[1] - first_day).days + 1)
        if days <= 0:
            return []
        after = max(self._now(), after) if after is not None else self._now()
        window_start = max(after, datetime.combine(first_day - timedelta(days=1), time(0), tzinfo=schedule.zone))
        window_end = datetime.combine(first_day + timedelta(days=days + 1), time(0), tzinfo=schedule.zone)
        window_start, window_end = window_start.astimezone(UTC), window_end.astimezone(UTC)
        busy = await self._store.busy(tenant_id, schedule.service.name, window_start - schedule.duration, window_end)
        return schedule.free_slots(busy, after=after, first_day=first_day, days=days, limit=limit)

    def _bookable_days(self, schedule: Schedule) -> tuple[date, date]:
        """The first and the last local day a booking may fall on (today to MAX_AHEAD_DAYS ahead):
        every slot of the last one is bookable, whatever the time of day now."""
        now = self._now()
        return schedule.local_day(now), schedule.local_day(now + timedelta(days=MAX_AHEAD_DAYS))

    def _far_off(self, schedule: Schedule, field: str, shown: str, what: str) -> InvalidArguments:
        first, last = self._bookable_days(schedule)
        return InvalidArguments(
            f"'{field}' {shown} {what}; the bookable days are {first} to {last} ({schedule.service.timezone})",
            advice=f"Ask the customer for a day from {first} to {last}, or list the free slots of the next days.",
        )

    def _local(self, schedule: Schedule, field: str, moment: datetime) -> datetime:
        """`moment` (aware) in the service's time zone.

        Raises InvalidArguments naming `field` and the bookable days when `moment` is so far off
        that the calendar cannot hold it in UTC or in that zone (0001-01-01T00:00+14:00)."""
        try:
            moment.astimezone(UTC)
            return moment.astimezone(schedule.zone)
        except OverflowError:  # datetime's range ends at years 1 and 9999
            raise self._far_off(schedule, field, moment.isoformat(timespec="minutes"), "is too far off to book") from None

    def _day(self, schedule: Schedule, field: str, value: datetime | date) -> date:
        """The local day of `value` (a day, or an aware moment on it) to list.

        Raises InvalidArguments naming `field` and the bookable days when it is more than
        MAX_AHEAD_DAYS ahead or too far off for the calendar; a day in the past passes (the listing
        says so and shows the next free slots)."""
        day = self._local(schedule, field, value).date() if isinstance(value, datetime) else value
        if day > self._bookable_days(schedule)[1]:
            raise self._far_off(schedule, field, day.isoformat(), f"is more than {MAX_AHEAD_DAYS} days ahead")
        return day

    async def list_slots(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of list_appointment_slots: free slots of the next days, or of `day`.

        Raises InvalidArguments (unknown service, malformed `day`, a day beyond the bookable
        days), PolicyDenied (no services)."""
        schedule = await self._service(ctx.tenant_id, args.get("service"))
        day = args.get("day")
        if day:
            return await self._listing(ctx, schedule, self._day(schedule, "day", parse_start(day, schedule.zone, "day")))
        return await self._listing(ctx, schedule, None)

    async def _listing(self, ctx: TrustedContext, schedule: Schedule, day: date | None) -> dict[str, Any]:
        today = schedule.local_day(self._now())
        result: dict[str, Any] = {"service": schedule.service.name, "timezone": schedule.service.timezone,
                                  "duration_minutes": schedule.service.duration_minutes}
        if day is not None and day >= today:
            slots = await self._free(ctx.tenant_id, schedule, first_day=day, days=1, limit=LIST_LIMIT * 4)
            result["day"] = day.isoformat()
            if not slots:
                later = await self._free(ctx.tenant_id, schedule, first_day=day + timedelta(days=1),
                                         days=LIST_DAYS, limit=OFFER_LIMIT)
                last = self._bookable_days(schedule)[1]
                if later:
                    result["note"] = "no free slots that day; offer the next free slots"
                    result["summary"] = "next free: " + schedule.describe(later)
                elif day >= last:
                    result["note"] = "no free slots that day, the last day that can be booked yet"
                elif day + timedelta(days=LIST_DAYS) > last:  # the search stopped at the last bookable day
                    result["note"] = f"no free slots that day nor on any day up to {last}, the last day that can be booked yet"
                else:
                    result["note"] = "no free slots that day"
                result["free_slots"] = []
                result["next_free_slots"] = [schedule.show(s) for s in later]
                return result
        else:
            if day is not None:
                result["note"] = f"{day.isoformat()} is in the past; these are the next free slots"
            slots = await self._free(ctx.tenant_id, schedule, first_day=today, days=LIST_DAYS, limit=LIST_LIMIT)
            if not slots:
                result["note"] = f"no free slots in the next {LIST_DAYS} days"
        if slots:
            result["summary"] = schedule.describe(slots)
        result["free_slots"] = [schedule.show(s) for s in slots]
        return result

    async def book(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of book_appointment: books `start`, or lists when it is absent or a date.

        Raises InvalidArguments (unknown service, malformed/past/misaligned start, a start beyond
        the bookable days), SlotUnavailable (taken, with the next free slots as advice),
        PolicyDenied (no services)."""
        schedule = await self._service(ctx.tenant_id, args.get("service"))
        raw_start = args.get("start")
        if args.get("action") == "list" or raw_start in (None, ""):
            day = self._day(schedule, "start", parse_start(raw_start, schedule.zone)) if raw_start else None
            return await self._listing(ctx, schedule, day)
        start = parse_start(raw_start, schedule.zone)
        if not isinstance(start, datetime):
            return await self._listing(ctx, schedule, self._day(schedule, "start", start))
        self._local(schedule, "start", start)  # showing it (in the errors below too) must not overflow
        start = start.astimezone(UTC)  # its end is `duration` of real time later, not of clock time
        now = self._now()
        if start <= now:
            raise InvalidArguments(
                f"'start' {schedule.show(start)} is in the past",
                advice=await self._offer(ctx, schedule, "Ask the customer for a later time"),
            )
        if schedule.local_day(start) > self._bookable_days(schedule)[1]:
            raise self._far_off(schedule, "start", schedule.show(start), f"is more than {MAX_AHEAD_DAYS} days ahead")
        if not schedule.is_slot_start(start):
            raise InvalidArguments(
                f"'start' {schedule.show(start)} is not a slot of {schedule.service.name} "
                f"({schedule.service.duration_minutes}-minute slots within opening hours, {schedule.service.timezone})",
                advice=await self._offer(ctx, schedule, "Offer the customer a free slot instead", near=start),
            )
        lead = await self._leads.for_session(ctx.tenant_id, ctx.session_id) if self._leads else None
        config = await self._configs.config_for(ctx.tenant_id)
        announce = self._notifier.announcer(config, EVENT, tenant_id=ctx.tenant_id, about=lambda row: (row.id, {
            "appointment_id": row.id, "session_id": ctx.session_id, "service": row.service,
            "starts_at": row.starts_at.isoformat(), "ends_at": row.ends_at.isoformat(),
            "timezone": schedule.service.timezone, "contact_name": row.contact_name,
            "contact_email": row.contact_email,
        }))
        try:
            booking, created = await self._store.book(
                ctx.tenant_id, schedule.service.name, start, start + schedule.duration,
                session_id=ctx.session_id, contact_name=getattr(lead, "name", None),
                contact_email=getattr(lead, "email", None), idempotency_key=ctx.idempotency_key,
                announce=announce,
            )
            announce.done()
        except SlotTaken:
            mine = await self._store.booked_by(ctx.tenant_id, schedule.service.name, start, ctx.session_id)
            if mine is not None:  # this conversation already holds exactly this slot
                return {**self._booked(schedule, mine), "status": "already booked in this conversation"}
            raise SlotUnavailable(
                "that slot was just taken",
                advice=await self._offer(ctx, schedule, "Offer the customer the next free slots", near=start),
            ) from None
        if created and self._memory is not None:
            await self._memory.remember_quietly(ctx, (
                f"Booked appointment: {schedule.service.name} on {schedule.show(booking.starts_at)} "
                f"({schedule.service.timezone})"
            ))
        return self._booked(schedule, booking)

    @staticmethod
    def _booked(schedule: Schedule, booking: Any) -> dict[str, Any]:
        return {
            "appointment_id": booking.id, "status": "booked", "service": booking.service,
            "start": schedule.show(booking.starts_at), "end": schedule.show(booking.ends_at),
            "timezone": schedule.service.timezone,
        }

    async def _offer(self, ctx: TrustedContext, schedule: Schedule, lead_in: str, *, near: datetime | None = None) -> str:
        """Advice naming the next free slots after `near` (or after now)."""
        first = max(schedule.local_day(near or self._now()), schedule.local_day(self._now()))
        slots = await self._free(ctx.tenant_id, schedule, first_day=first, days=LIST_DAYS, limit=OFFER_LIMIT,
                                 after=near)
        if not slots:
            last = self._bookable_days(schedule)[1]
            if first + timedelta(days=LIST_DAYS) > last:  # the search stopped at the last bookable day
                return (f"Tell the customer there are no free slots for {schedule.service.name} from {first} "
                        f"to {last}, the last day that can be booked yet.")
            return f"Tell the customer there are no free slots for {schedule.service.name} in the next {LIST_DAYS} days."
        shown = ", ".join(schedule.show(s) for s in slots)
        return f"{lead_in}: {shown} ({schedule.service.timezone}); book the one they choose."
