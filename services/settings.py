"""Settings: one frozen object read from the environment once, at start-up, by the entrypoint.

No other module reads `os.environ`. Every variable, the CE_* tuning knobs included, is listed in
README.md § Configuration. Its repr (a log line, a traceback with
locals, a debugger) shows the API key, the encryption keys and any URL's password as [redacted].
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from kernel.errors import ConfigError, InvalidInput
from services.botconfig import APPROVAL_TTL_MAX_S, APPROVAL_TTL_MIN_S, check_approval_ttl

Placement = Literal["sharded", "dedicated"]
#: how a turn knows its cached catalog is current (CE_CATALOG_CHECK; see actors.catalogs)
CatalogCheck = Literal["notify", "read"]

#: CE_LOG_LEVEL's accepted values (structlog's filtering levels)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: a session idle longer than a day only holds a host's memory (Postgres keeps it anyway), and a
#: dedicated session actor lives as long: past this, an idle time is a typo
IDLE_SECONDS_MAX = 86_400.0
#: the group-commit window is a wait added to turns on a busy host: a second is already far too long
FLUSH_INTERVAL_MS_MAX = 1_000.0
#: CE_HOST_MAX_UNWRITTEN_PER_SESSION's bounds. At most the turn cache (actors.session.TURN_CACHE):
#: the cache keeps every unwritten answer beyond its latest TURN_CACHE, so it stays at most twice
#: that size. At least a session's mailbox and the turn running (actors.host.HostSettings.mailbox
#: + 1): a turn waits at the gate with its session's lock released, so the messages queued behind
#: it run one after another while one slow flush is still in flight, each unwritten until it
#: commits, on a host whose Postgres is healthy.
UNWRITTEN_PER_SESSION_MAX = 64
UNWRITTEN_PER_SESSION_MIN = 17

_REDACTED = "[redacted]"
_URL_FIELDS = frozenset({"database_url", "anthropic_base_url", "otlp_endpoint"})
_QUERY_PASSWORD_RE = re.compile(r"(?i)((?:^|&)(?:ssl)?password=)[^&]*")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    database_url: str | None = None
    ray_address: str | None = None
    anthropic_api_key: str | None = None
    anthropic_base_url: str | None = None
    secret_keys: tuple[str, ...] = ()
    placement: Placement = "sharded"
    shards: int = 4
    host: str = "127.0.0.1"
    port: int = 8080
    webhook_allow: tuple[str, ...] = ()
    data_dir: str = ".data"
    main_model: str = "claude-sonnet-4-5"
    cheap_model: str = "claude-haiku-4-5"
    idle_seconds: float = 300.0
    output_gate: bool = True
    flush_interval_ms: float = 5.0
    approval_ttl_s: float = 900.0
    otlp_endpoint: str | None = None
    #: the bearer token GET /metrics asks of a scraper; unset: it answers loopback peers only
    metrics_token: str | None = None
    tenant_rate: float = 100.0  # messages/s per tenant per gateway (0: unlimited)
    tenant_burst: float = 200.0
    tenant_concurrency: int = 256  # turns in flight per tenant per gateway (0: unlimited)
    admin_write_rate: float = 10.0  # configuration writes/s per tenant per gateway (0: unlimited)
    admin_write_burst: float = 100.0
    host_max_inflight: int = 256  # turns admitted at once per session host; beyond: 503
    #: connections a gateway holds at once; beyond, 503 + Retry-After; 0: its file limit less a reserve
    gateway_max_connections: int = 0
    #: turns run but not yet written (Postgres away) a host holds before it refuses new ones (503
    #: storage_unavailable); 0: twice host_max_inflight (actors.host)
    host_max_unwritten: int = 0
    host_max_unwritten_per_session: int = UNWRITTEN_PER_SESSION_MAX  # likewise, of one session
    host_max_sessions: int = 10_000  # live sessions per host; beyond, the least recently used passivate
    #: turns computing at once on a host, shared fairly among tenants (services.fairshare); 0: no bound
    host_cpu_slots: int = 8
    #: sessions a host writes per transaction, every tenant in turn; 0: every dirty one at once
    host_flush_batch: int = 64
    #: dedicated placement: session actors a gateway keeps alive, in all and of one tenant (0: no bound)
    dedicated_max_actors: int = 1_000
    dedicated_max_actors_per_tenant: int = 250
    host_lane: bool = True  # gateways send turns to shard hosts over their lane, not Ray's task path
    catalog_check: CatalogCheck = "notify"  # "read": every turn reads its tenant's catalog stamp
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{name}={value!r}" for name, value in self._shown()) + ")"

    def __rich_repr__(self) -> Iterator[tuple[str, Any]]:
        yield from self._shown()

    def _shown(self) -> Iterator[tuple[str, Any]]:
        """Every field as a repr may show it: secrets replaced, a URL's password too."""
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name in ("anthropic_api_key", "metrics_token") and value:
                value = _REDACTED
            elif name == "secret_keys":
                value = tuple(_REDACTED for _ in value)
            elif name in _URL_FIELDS and value:
                value = _without_password(value)
            yield name, value

    @property
    def secret_key(self) -> str | None:
        """The current encryption key (the first one); older keys only decrypt."""
        return self.secret_keys[0] if self.secret_keys else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and validate the environment.

        Raises ConfigError with one sentence naming the variable and what to set.
        """
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        database_url = get("DATABASE_URL")
        if database_url is not None:
            _check_database_url(database_url)

        placement = get("CE_PLACEMENT") or "sharded"
        if placement not in ("sharded", "dedicated"):
            raise ConfigError(
                f"CE_PLACEMENT must be 'sharded' or 'dedicated', got {placement!r}",
                variable="CE_PLACEMENT",
            )
        allow = tuple(p.strip() for p in (get("CE_WEBHOOK_ALLOW") or "").split(",") if p.strip())
        for entry in allow:
            _check_allow_entry(entry)
        keys = tuple(k.strip() for k in (get("CE_SECRET_KEY") or "").split(",") if k.strip())
        log_format = get("CE_LOG_FORMAT") or ("json" if get("CI") is None and not _is_tty() else "console")
        if log_format not in ("console", "json"):
            raise ConfigError(
                f"CE_LOG_FORMAT must be 'console' or 'json', got {log_format!r}",
                variable="CE_LOG_FORMAT",
            )
        log_level = (get("CE_LOG_LEVEL") or "info").lower()
        if log_level not in LOG_LEVELS:
            raise ConfigError(
                f"CE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {get('CE_LOG_LEVEL')!r}",
                variable="CE_LOG_LEVEL",
            )
        max_inflight = _int(get, "CE_HOST_MAX_INFLIGHT", 256, minimum=1)
        return cls(
            database_url=database_url,
            ray_address=get("RAY_ADDRESS"),
            anthropic_api_key=get("ANTHROPIC_API_KEY"),
            anthropic_base_url=get("ANTHROPIC_BASE_URL"),
            secret_keys=keys,
            placement=placement,  # type: ignore[arg-type]
            shards=_int(get, "CE_SHARDS", 4, minimum=1),
            host=get("CE_HOST") or "127.0.0.1",
            port=_int(get, "CE_PORT", 8080, minimum=0, maximum=65535),
            webhook_allow=allow,
            data_dir=get("CE_DATA_DIR") or ".data",
            main_model=get("CE_MAIN_MODEL") or "claude-sonnet-4-5",
            cheap_model=get("CE_CHEAP_MODEL") or "claude-haiku-4-5",
            idle_seconds=_float(get, "CE_IDLE_SECONDS", 300.0, maximum=IDLE_SECONDS_MAX),
            output_gate=_switch(get, "CE_OUTPUT_GATE", True),
            flush_interval_ms=_float(get, "CE_FLUSH_INTERVAL_MS", 5.0, maximum=FLUSH_INTERVAL_MS_MAX),
            approval_ttl_s=_approval_ttl(get),
            otlp_endpoint=get("CE_OTLP_ENDPOINT"),
            metrics_token=_metrics_token(get),
            tenant_rate=_float(get, "CE_TENANT_RATE", 100.0),
            tenant_burst=_float(get, "CE_TENANT_BURST", 200.0),
            tenant_concurrency=_int(get, "CE_TENANT_CONCURRENCY", 256, minimum=0),
            admin_write_rate=_float(get, "CE_ADMIN_WRITE_RATE", 10.0),
            admin_write_burst=_float(get, "CE_ADMIN_WRITE_BURST", 100.0),
            host_max_inflight=max_inflight,
            gateway_max_connections=_int(get, "CE_GATEWAY_MAX_CONNECTIONS", 0, minimum=0),
            host_max_unwritten=_max_unwritten(get, max_inflight),
            host_max_unwritten_per_session=_int(
                get, "CE_HOST_MAX_UNWRITTEN_PER_SESSION", UNWRITTEN_PER_SESSION_MAX,
                minimum=UNWRITTEN_PER_SESSION_MIN, maximum=UNWRITTEN_PER_SESSION_MAX),
            host_max_sessions=_int(get, "CE_HOST_MAX_SESSIONS", 10_000, minimum=1),
            host_cpu_slots=_int(get, "CE_HOST_CPU_SLOTS", 8, minimum=0),
            host_flush_batch=_int(get, "CE_HOST_FLUSH_BATCH", 64, minimum=0),
            dedicated_max_actors=_int(get, "CE_DEDICATED_MAX_ACTORS", 1_000, minimum=0),
            dedicated_max_actors_per_tenant=_int(get, "CE_DEDICATED_MAX_ACTORS_PER_TENANT", 250, minimum=0),
            host_lane=_switch(get, "CE_HOST_LANE", True),
            catalog_check=_catalog_check(get),
            log_format=log_format,  # type: ignore[arg-type]
            log_level=log_level,
        )

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)


def _catalog_check(get) -> CatalogCheck:
    value = (get("CE_CATALOG_CHECK") or "notify").lower()
    if value not in ("notify", "read"):
        raise ConfigError(
            f"CE_CATALOG_CHECK must be 'notify' (writers wait for the hosts' acknowledgement) or 'read' "
            f"(every turn reads the catalog stamp), got {get('CE_CATALOG_CHECK')!r}",
            variable="CE_CATALOG_CHECK",
        )
    return value  # type: ignore[return-value]


def _is_tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _max_unwritten(get, max_inflight: int) -> int:
    """CE_HOST_MAX_UNWRITTEN: 0 (the default: twice CE_HOST_MAX_INFLIGHT) or at least
    CE_HOST_MAX_INFLIGHT. Below it, a healthy host whose admitted turns all wait at the output gate
    at once (each unwritten until its flush commits) would turn new ones away as if Postgres were
    down."""
    value = _int(get, "CE_HOST_MAX_UNWRITTEN", 0, minimum=0)
    if 0 < value < max_inflight:
        raise ConfigError(
            f"CE_HOST_MAX_UNWRITTEN must be 0 (twice CE_HOST_MAX_INFLIGHT) or at least CE_HOST_MAX_INFLIGHT "
            f"({max_inflight}), got {value}: below it a healthy host would refuse turns waiting only for "
            "their flush", variable="CE_HOST_MAX_UNWRITTEN",
        )
    return value


def _int(get, name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
    raw = get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {raw!r}", variable=name) from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}", variable=name)
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}", variable=name)
    return value


def _switch(get, name: str, default: bool) -> bool:
    raw = get(name)
    if raw is None:
        return default
    value = raw.lower()
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise ConfigError(f"{name} must be 'on' or 'off', got {raw!r}", variable=name)


def _float(get, name: str, default: float, *, maximum: float | None = None) -> float:
    """A finite number >= 0 (and <= `maximum`): inf and nan would pass every comparison the
    engine makes with them, or none, and break later (a sleep, a date) far from the variable."""
    raw = get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}", variable=name) from None
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {raw!r}", variable=name)
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value:g}", variable=name)
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum:g}, got {value:g}", variable=name)
    return value


def _approval_ttl(get) -> float:
    """CE_APPROVAL_TTL_S: the range a tenant's own `approval_ttl_s` has (services.botconfig), as
    the engine's default is used in its place: an expiry time must be a date, and a held turn must
    not be expired at birth."""
    value = _float(get, "CE_APPROVAL_TTL_S", 900.0)
    try:
        check_approval_ttl(value)
    except InvalidInput:
        raise ConfigError(
            f"CE_APPROVAL_TTL_S must be a number of seconds from {APPROVAL_TTL_MIN_S} to {APPROVAL_TTL_MAX_S} "
            f"(30 days), got {value:g}",
            variable="CE_APPROVAL_TTL_S",
        ) from None
    return value


def _without_password(url: str) -> str:
    """`url` with the password of its user info and of its query (`?password=`) replaced."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return _REDACTED  # unparsable: nothing of it is safe to show
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{_REDACTED}@{host}"
    return parts._replace(netloc=netloc, query=_QUERY_PASSWORD_RE.sub(rf"\1{_REDACTED}", parts.query)).geturl()


def _check_database_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ConfigError(
            "DATABASE_URL must look like postgresql://user:password@host:5432/dbname "
            f"(got a URL with scheme {parts.scheme or 'none'!r}); unset it to use the embedded Postgres",
            variable="DATABASE_URL",
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(
            "DATABASE_URL has an invalid port; use postgresql://user:password@host:5432/dbname",
            variable="DATABASE_URL",
        ) from None
    if not parts.hostname and "host=" not in parts.query:
        raise ConfigError(
            "DATABASE_URL names no host; use postgresql://user:password@host:5432/dbname",
            variable="DATABASE_URL",
        )


#: the shortest operator token for GET /metrics: guessing one must be out of reach
METRICS_TOKEN_MIN = 24


def _metrics_token(get: Callable[[str], str | None]) -> str | None:
    token = get("CE_METRICS_TOKEN")
    if token is not None and (len(token) < METRICS_TOKEN_MIN or any(c.isspace() for c in token)):
        raise ConfigError(f"CE_METRICS_TOKEN must be at least {METRICS_TOKEN_MIN} characters without spaces "
                          "(e.g. `openssl rand -hex 32`)", variable="CE_METRICS_TOKEN")
    return token


def _check_allow_entry(entry: str) -> None:
    try:
        ipaddress.ip_network(entry)
        return
    except ValueError:
        pass
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        network = None
    if network is not None:  # `10.0.0.1/0` would be read as 0.0.0.0/0: allow everything
        raise ConfigError(
            f"CE_WEBHOOK_ALLOW entry {entry!r} has host bits set; write the network itself ({network}) or the one "
            "address without a prefix",
            variable="CE_WEBHOOK_ALLOW",
        )
    if not entry.replace("-", "").replace(".", "").replace("_", "").isalnum():
        raise ConfigError(
            f"CE_WEBHOOK_ALLOW entry {entry!r} is neither a CIDR (10.0.0.0/8) nor a host name",
            variable="CE_WEBHOOK_ALLOW",
        )
