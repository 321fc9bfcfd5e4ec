"""The tenant dashboard: the page at `/`, its static files, and the read-only JSON it needs.

    GET /                                      the page (services/gateway/static/index.html)
    GET /static/{file}                         app.js, app.css (shipped as package data)
    GET /v1/sessions?limit=                    recent sessions, most recently updated first
    GET /v1/sessions/{session_id}/calls?limit= the session's turns with their tool calls
                                               (parameters redacted)
    GET /v1/analytics/tools/timeseries?since=&bucket=
                                               tool calls per tool per time bucket

The page is plain HTML, CSS and JavaScript with no build step and no request leaving the
gateway's origin (a strict Content-Security-Policy says so to the browser). It signs in with the
tenant API key and talks to the same /v1 API as any client: the /v1 routes here are tenant-scoped
by the auth middleware (request[TENANT]) like every other, and only read.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from kernel.errors import InvalidInput, NotFound
from services.gateway.common import (
    DEPS,
    TENANT,
    json_response,
    parse_since,
    path_session_id,
    whole_number,
)
from services.tools.redaction import REDACTED, secret_name
from storage.repos.dashboard import DashboardRepo

STATIC_DIR = Path(__file__).parent / "static"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
#: the page may talk to its own origin only, run only its own script, and be framed by nobody
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_LIMIT_MAX = 500
#: bucket widths the timeseries picks from when none is asked for: ≤ 48 bars per chart
_AUTO_WIDTHS = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400)
_MAX_BUCKETS = 1000
#: the longest range a chart covers: as many of the widest auto buckets as a chart may have
#: (about 19 years); an earlier `since` ("since the year 1", "all of it") is read as this
_MAX_SPAN = timedelta(seconds=_MAX_BUCKETS * _AUTO_WIDTHS[-1])
#: the widest bucket asked for by name
_MAX_WIDTH_S = 366 * 86400

DASHBOARD_REPO = web.AppKey("dashboard_repo", DashboardRepo | None)


def add_dashboard_routes(app: web.Application) -> None:
    """Register the page, its static files and the dashboard's read routes on the gateway
    (after app[DEPS] is set)."""
    # GatewayDeps does not name the pool; the call log's repository holds the gateway's one.
    pool = getattr(app[DEPS].calls, "_pool", None)
    app[DASHBOARD_REPO] = DashboardRepo(pool) if pool is not None else None
    r = app.router
    r.add_get("/", index)
    r.add_get("/static/{file}", static_file)
    r.add_get("/v1/sessions", list_sessions)
    r.add_get("/v1/keys", list_keys)
    r.add_get("/v1/sessions/{session_id}/calls", session_calls)
    r.add_get("/v1/analytics/tools/timeseries", tool_timeseries)


# -- the page ---------------------------------------------------------------------------------

def _file_response(path: Path) -> web.Response:
    try:
        body = path.read_bytes()  # small files, read per request so a redeploy needs no restart
    except OSError:
        raise NotFound(f"there is no dashboard file {path.name!r}; the page loads only index.html, "
                       "app.js and app.css", kind="static", key=path.name) from None
    return web.Response(body=body, headers={"Content-Type": f"{_TYPES[path.suffix]}; charset=utf-8",
                                            **_PAGE_HEADERS})


async def index(request: web.Request) -> web.Response:
    return _file_response(STATIC_DIR / "index.html")


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["file"]
    # Only plain names of known types: no path separators, so nothing outside STATIC_DIR.
    if not re.fullmatch(r"[a-z0-9_-]+\.(js|css|svg|html)", name):
        raise NotFound(f"there is no dashboard file {name[:60]!r}", kind="static", key=name[:60])
    return _file_response(STATIC_DIR / name)


# -- helpers ----------------------------------------------------------------------------------

def _repo(request: web.Request) -> DashboardRepo:
    repo = request.app[DASHBOARD_REPO]
    if repo is None:
        raise NotFound("the dashboard routes are not available in this process (no database pool)",
                       kind="route", key=request.path)
    return repo


def _limit(request: web.Request, default: int) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    return whole_number(raw, name="limit", low=1, high=_LIMIT_MAX, at="?limit")


def redact(value: Any, sensitive: frozenset[str]) -> Any:
    """`value` with every value under a sensitive or secret-looking key replaced, at any depth.

    The executor already redacts the tool's `sensitive` parameters before storing a call; this
    applies the tool's current list as well (it may have grown since) and never shows values
    under names like password, token or api_key (services.tools.redaction.secret_name, the
    rule the executor applies when it records a call).
    """
    if isinstance(value, dict):
        return {k: REDACTED if (k in sensitive or secret_name(k)) else redact(v, sensitive)
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, sensitive) for v in value]
    return value


# -- sessions ---------------------------------------------------------------------------------

async def list_sessions(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    contact = request.query.get("contact")
    if contact is not None and not 0 < len(contact) <= 256:
        raise InvalidInput("contact must be a verified contact's sub (1-256 characters) - at ?contact")
    rows = await deps.sessions.list_sessions(request[TENANT], limit=_limit(request, 50), contact=contact)
    return json_response({"sessions": [
        {"session_id": s.session_id, "messages": s.message_count, "handoff": s.handoff,
         "created_at": s.created_at, "updated_at": s.updated_at}
        for s in rows
    ]})


async def list_keys(request: web.Request) -> web.Response:
    """The tenant's API keys, live and revoked, with their kind: ids and dates, never a key."""
    deps = request.app[DEPS]
    keys = await deps.tenants.list_keys(request[TENANT])
    return json_response({"keys": [
        {"key_id": k.key_id, "kind": k.kind, "created_at": k.created_at, "revoked_at": k.revoked_at} for k in keys
    ]})


async def session_calls(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    limit = _limit(request, 20)  # what was asked is checked before anything is looked up
    if await deps.sessions.current_epoch(tenant_id, session_id) is None:
        raise NotFound(f"session {session_id!r} does not exist for this tenant", kind="session", key=session_id)
    turns = await _repo(request).turns(tenant_id, session_id, limit=limit)
    calls = await deps.calls.recent(tenant_id, session_id, limit=limit * 10)
    sensitive: dict[str, frozenset[str]] = {
        row.name: frozenset(row.definition.get("sensitive") or ())
        for row in await deps.tools.list_published(tenant_id)
    }
    by_turn: dict[str | None, list[dict[str, Any]]] = {}
    for c in reversed(calls):  # oldest first within a turn: the order they ran in
        by_turn.setdefault(c.message_id, []).append({
            "id": c.id, "name": c.tool_name, "success": c.success, "latency_ms": c.latency_ms,
            "queue_ms": c.queue_ms, "error": c.error, "created_at": c.created_at,
            "parameters": redact(c.parameters or {}, sensitive.get(c.tool_name, frozenset())),
        })
    out = [{"message_id": t.message_id, "text": t.text, "reply": t.reply, "created_at": t.created_at,
            "calls": by_turn.pop(t.message_id, [])} for t in turns]
    # calls of turns older than the turns shown, or of a turn still held for approval
    for message_id, rest in by_turn.items():
        out.append({"message_id": message_id, "text": None, "reply": None,
                    "created_at": rest[0]["created_at"], "calls": rest})
    out.sort(key=lambda t: t["created_at"] or datetime.min.replace(tzinfo=UTC), reverse=True)
    return json_response({"session_id": session_id, "turns": out})


# -- analytics --------------------------------------------------------------------------------

def _bucket_width(raw: str | None, span_s: float) -> int:
    if raw is None or raw == "auto":
        return next((w for w in _AUTO_WIDTHS if span_s / w <= 48), _AUTO_WIDTHS[-1])
    refusal = InvalidInput(f"bucket must be a width like 5m, 1h or 1d, from 1m to {_MAX_WIDTH_S // 86400}d "
                           f"(or auto), got {raw[:20]!r} - at `?bucket`", path="?bucket")
    unit = {"m": 60, "h": 3600, "d": 86400}.get(raw[-1:])
    try:
        count = whole_number(raw[:-1], name="bucket", low=1, high=_MAX_WIDTH_S // 60, at="?bucket")
    except InvalidInput:
        raise refusal from None
    if unit is None or count * unit > _MAX_WIDTH_S:
        raise refusal
    width = count * unit
    if span_s / width > _MAX_BUCKETS:
        raise InvalidInput(f"bucket {raw} over this range makes more than {_MAX_BUCKETS} buckets; choose a wider "
                           "bucket or a later `since` - at `?bucket`", path="?bucket")
    return width


async def tool_timeseries(request: web.Request) -> web.Response:
    """Calls and successes per tool per bucket, zero-filled, aligned arrays (one per tool).

    A `since` earlier than the longest range a chart covers (_MAX_SPAN) is read as that range's
    start, which the answer's `since` says: "since the year 1" means "all of it" to whoever asks,
    no tool call is older, and a chart of buckets back to then could not even be dated."""
    since = parse_since(request.query.get("since"))
    now = datetime.now(UTC)
    if since >= now:
        raise InvalidInput("since must be in the past - at `?since`", path="?since")
    since = max(since, now - _MAX_SPAN)
    width = _bucket_width(request.query.get("bucket"), (now - since).total_seconds())
    rows = await _repo(request).call_buckets(request[TENANT], since, width)
    first = int(since.timestamp()) // width * width
    last = int(now.timestamp()) // width * width
    starts = list(range(first, last + width, width))
    index = {t: i for i, t in enumerate(starts)}
    tools: dict[str, dict[str, Any]] = {}
    total_calls = [0] * len(starts)
    total_ok = [0] * len(starts)
    for row in rows:
        i = index.get(int(row.bucket.timestamp()))
        if i is None:
            continue
        series = tools.setdefault(row.name, {"name": row.name, "total": 0,
                                             "calls": [0] * len(starts), "successes": [0] * len(starts)})
        series["calls"][i] += row.calls
        series["successes"][i] += row.successes
        series["total"] += row.calls
        total_calls[i] += row.calls
        total_ok[i] += row.successes
    return json_response({
        "since": since.isoformat(), "until": now.isoformat(), "bucket_seconds": width,
        "buckets": [datetime.fromtimestamp(t, UTC).isoformat() for t in starts],
        "tools": sorted(tools.values(), key=lambda s: (-s["total"], s["name"])),
        "total": {"calls": total_calls, "successes": total_ok},
    })


