"""Settings.from_env: malformed values fail at start-up with a ConfigError naming the variable."""

from __future__ import annotations

import pytest

from kernel.errors import ConfigError
from services.settings import Settings


@pytest.mark.parametrize(
    ("env", "variable", "message"),
    [
        ({"DATABASE_URL": "mysql://u:p@db:3306/x"}, "DATABASE_URL", r"DATABASE_URL must look like postgresql://"),
        ({"DATABASE_URL": "not a url"}, "DATABASE_URL", r"DATABASE_URL must look like postgresql://"),
        ({"DATABASE_URL": "postgresql://u:p@db:notaport/x"}, "DATABASE_URL", r"DATABASE_URL has an invalid port"),
        ({"DATABASE_URL": "postgresql:///x"}, "DATABASE_URL", r"DATABASE_URL names no host"),
        ({"CE_PLACEMENT": "random"}, "CE_PLACEMENT", r"CE_PLACEMENT must be 'sharded' or 'dedicated', got 'random'"),
        ({"CE_SHARDS": "four"}, "CE_SHARDS", r"CE_SHARDS must be a whole number, got 'four'"),
        ({"CE_SHARDS": "0"}, "CE_SHARDS", r"CE_SHARDS must be >= 1, got 0"),
        ({"CE_SHARDS": "-3"}, "CE_SHARDS", r"CE_SHARDS must be >= 1, got -3"),
        ({"CE_HOST_LANE": "sometimes"}, "CE_HOST_LANE", r"CE_HOST_LANE must be 'on' or 'off', got 'sometimes'"),
        ({"CE_OUTPUT_GATE": "disabled"}, "CE_OUTPUT_GATE", r"CE_OUTPUT_GATE must be 'on' or 'off', got 'disabled'"),
        ({"CE_OUTPUT_GATE": "of"}, "CE_OUTPUT_GATE", r"CE_OUTPUT_GATE must be 'on' or 'off', got 'of'"),
        ({"CE_PORT": "99999"}, "CE_PORT", r"CE_PORT must be <= 65535, got 99999"),
        ({"CE_HOST_MAX_SESSIONS": "0"}, "CE_HOST_MAX_SESSIONS", r"CE_HOST_MAX_SESSIONS must be >= 1, got 0"),
        # read loosely, 10.0.0.1/0 is 0.0.0.0/0: every address
        ({"CE_WEBHOOK_ALLOW": "10.0.0.1/0"}, "CE_WEBHOOK_ALLOW",
         r"CE_WEBHOOK_ALLOW entry '10.0.0.1/0' has host bits set; write the network itself \(0.0.0.0/0\)"),
    ],
)
def test_malformed_values_raise_config_error_naming_the_variable(env, variable, message):
    with pytest.raises(ConfigError, match=message) as info:
        Settings.from_env(env)
    assert info.value.variable == variable
    assert variable in str(info.value)


def test_a_database_url_password_is_not_echoed_in_the_error():
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"DATABASE_URL": "postgresql://u:s3cret-pw@db:99999999/x"})
    assert "s3cret-pw" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://user:pw@db.internal:5432/chat",
        "postgres://user@localhost/chat",
        "postgresql://postgres@/postgres?host=/tmp/pgsock",  # the embedded server's unix socket
    ],
)
def test_well_formed_database_urls_are_accepted(url):
    assert Settings.from_env({"DATABASE_URL": url}).database_url == url


def test_defaults_and_valid_values():
    s = Settings.from_env({"CE_PLACEMENT": "dedicated", "CE_SHARDS": "8"})
    assert (s.placement, s.shards, s.database_url) == ("dedicated", 8, None)
    assert Settings.from_env({}).placement == "sharded"
    assert Settings.from_env({"CE_SHARDS": "  "}).shards == 4  # blank counts as unset


def test_the_turn_lane_is_on_unless_switched_off():
    assert Settings.from_env({}).host_lane is True
    assert Settings.from_env({"CE_HOST_LANE": "Off"}).host_lane is False
    assert Settings.from_env({"CE_HOST_LANE": "1"}).host_lane is True


def test_the_output_gate_is_on_unless_switched_off():
    assert Settings.from_env({}).output_gate is True
    assert Settings.from_env({"CE_OUTPUT_GATE": "OFF"}).output_gate is False
    assert Settings.from_env({"CE_OUTPUT_GATE": "no"}).output_gate is False
    assert Settings.from_env({"CE_OUTPUT_GATE": "yes"}).output_gate is True
    assert Settings.from_env({"CE_PORT": "65535"}).port == 65535


def test_the_repr_redacts_the_api_key_the_encryption_keys_and_url_passwords():
    # a log line, a traceback with locals or a debugger shows the repr: before, every secret in full
    s = Settings.from_env({
        "DATABASE_URL": "postgresql://ce:db-pw-9f2@db.internal:5432/chat?sslmode=require&password=q-pw-77",
        "ANTHROPIC_API_KEY": "sk-ant-api03-abcdef", "CE_SECRET_KEY": "key-one-aaaa,key-two-bbbb",
        "CE_OTLP_ENDPOINT": "https://otel:otlp-pw-33@collector:4318", "CE_SHARDS": "8",
    })
    shown = repr(s)
    for secret in ("db-pw-9f2", "q-pw-77", "sk-ant-api03-abcdef", "key-one-aaaa", "key-two-bbbb", "otlp-pw-33"):
        assert secret not in shown and secret not in str(s) and secret not in repr([s]), secret
    assert "database_url='postgresql://ce:[redacted]@db.internal:5432/chat?sslmode=require&password=[redacted]'" in shown
    assert "anthropic_api_key='[redacted]'" in shown and "secret_keys=('[redacted]', '[redacted]')" in shown
    assert "shards=8" in shown and "otlp_endpoint='https://otel:[redacted]@collector:4318'" in shown
    assert dict(s.__rich_repr__())["anthropic_api_key"] == "[redacted]"
    # the values themselves are untouched
    assert s.anthropic_api_key == "sk-ant-api03-abcdef" and s.secret_key == "key-one-aaaa"
    assert repr(Settings()).startswith("Settings(database_url=None, ray_address=None, anthropic_api_key=None,")


@pytest.mark.parametrize(
    ("env", "variable", "message"),
    [
        # not finite: accepted before, then compared with and slept on far from the variable
        ({"CE_IDLE_SECONDS": "inf"}, "CE_IDLE_SECONDS", r"CE_IDLE_SECONDS must be a finite number, got 'inf'"),
        ({"CE_IDLE_SECONDS": "1e999"}, "CE_IDLE_SECONDS", r"CE_IDLE_SECONDS must be a finite number, got '1e999'"),
        ({"CE_TENANT_RATE": "nan"}, "CE_TENANT_RATE", r"CE_TENANT_RATE must be a finite number, got 'nan'"),
        ({"CE_TENANT_BURST": "Infinity"}, "CE_TENANT_BURST", r"CE_TENANT_BURST must be a finite number"),
        ({"CE_FLUSH_INTERVAL_MS": "-inf"}, "CE_FLUSH_INTERVAL_MS", r"CE_FLUSH_INTERVAL_MS must be a finite number"),
        ({"CE_APPROVAL_TTL_S": "nan"}, "CE_APPROVAL_TTL_S", r"CE_APPROVAL_TTL_S must be a finite number"),
        ({"CE_TENANT_RATE": "-1"}, "CE_TENANT_RATE", r"CE_TENANT_RATE must be >= 0, got -1"),
        ({"CE_TENANT_BURST": "lots"}, "CE_TENANT_BURST", r"CE_TENANT_BURST must be a number, got 'lots'"),
        # the approval TTL: a tenant's own range (botconfig.check_approval_ttl); 1e12 s made every
        # approval a 500 (now + timedelta overflows), 0 expired every held turn at birth
        ({"CE_APPROVAL_TTL_S": "1e12"}, "CE_APPROVAL_TTL_S",
         r"CE_APPROVAL_TTL_S must be a number of seconds from 1 to 2592000 \(30 days\), got 1e\+12"),
        ({"CE_APPROVAL_TTL_S": "2592001"}, "CE_APPROVAL_TTL_S", r"CE_APPROVAL_TTL_S must be .* from 1 to 2592000"),
        ({"CE_APPROVAL_TTL_S": "0"}, "CE_APPROVAL_TTL_S", r"CE_APPROVAL_TTL_S must be .* from 1 to 2592000"),
        ({"CE_APPROVAL_TTL_S": "0.5"}, "CE_APPROVAL_TTL_S", r"CE_APPROVAL_TTL_S must be .* from 1 to 2592000"),
        # upper bounds where a huge value breaks something
        ({"CE_IDLE_SECONDS": "1e12"}, "CE_IDLE_SECONDS", r"CE_IDLE_SECONDS must be <= 86400, got 1e\+12"),
        ({"CE_FLUSH_INTERVAL_MS": "60000"}, "CE_FLUSH_INTERVAL_MS", r"CE_FLUSH_INTERVAL_MS must be <= 1000, got 60000"),
        # a level structlog does not know was silently info
        ({"CE_LOG_LEVEL": "verbose"}, "CE_LOG_LEVEL",
         r"CE_LOG_LEVEL must be one of debug, info, warning, error, critical, got 'verbose'"),
        ({"CE_LOG_LEVEL": "warn"}, "CE_LOG_LEVEL", r"CE_LOG_LEVEL must be one of .*got 'warn'"),
    ],
)
def test_numbers_that_are_not_finite_or_out_of_range_and_unknown_levels_are_refused(env, variable, message):
    with pytest.raises(ConfigError, match=message) as info:
        Settings.from_env(env)
    assert info.value.variable == variable
    assert str(info.value).count(variable) == 1 and "\n" not in str(info.value)  # one sentence


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"CE_APPROVAL_TTL_S": "1"}, "approval_ttl_s", 1.0),
        ({"CE_APPROVAL_TTL_S": "2592000"}, "approval_ttl_s", 2_592_000.0),
        ({"CE_IDLE_SECONDS": "86400"}, "idle_seconds", 86_400.0),
        ({"CE_IDLE_SECONDS": "0.05"}, "idle_seconds", 0.05),
        ({"CE_FLUSH_INTERVAL_MS": "0"}, "flush_interval_ms", 0.0),
        ({"CE_FLUSH_INTERVAL_MS": "1000"}, "flush_interval_ms", 1000.0),
        ({"CE_TENANT_RATE": "0"}, "tenant_rate", 0.0),  # 0: unlimited
        ({"CE_TENANT_RATE": "1e6"}, "tenant_rate", 1e6),
        ({"CE_LOG_LEVEL": "WARNING"}, "log_level", "warning"),
        ({"CE_LOG_LEVEL": "debug"}, "log_level", "debug"),
        ({}, "log_level", "info"),
    ],
)
def test_values_within_range_are_kept(env, field, value):
    assert getattr(Settings.from_env(env), field) == value


def test_the_unwritten_turn_caps_default_to_twice_the_admission_and_the_turn_cache():
    from actors.host import HostSettings, SessionHost
    from actors.session import TURN_CACHE

    s = Settings.from_env({})
    assert (s.host_max_unwritten, s.host_max_unwritten_per_session) == (0, TURN_CACHE)
    host = HostSettings.from_settings(Settings.from_env({"CE_HOST_MAX_INFLIGHT": "10"}))
    assert (host.max_unwritten, host.max_unwritten_per_session) == (0, TURN_CACHE)
    assert SessionHost(name="h", store=None, tenants=None, settings=host).stats()["unwritten_turns_cap"] == 20


def test_the_unwritten_turn_caps_are_settings_a_host_runs_with():
    from actors.host import HostSettings, SessionHost

    s = Settings.from_env({"CE_HOST_MAX_INFLIGHT": "10", "CE_HOST_MAX_UNWRITTEN": "15",
                           "CE_HOST_MAX_UNWRITTEN_PER_SESSION": "20"})
    host = HostSettings.from_settings(s)
    assert (host.max_unwritten, host.max_unwritten_per_session) == (15, 20)
    assert SessionHost(name="h", store=None, tenants=None, settings=host).stats()["unwritten_turns_cap"] == 15
    # the least either may be: the admission limit, and a session's mailbox and running turn
    edge = Settings.from_env({"CE_HOST_MAX_INFLIGHT": "10", "CE_HOST_MAX_UNWRITTEN": "10",
                              "CE_HOST_MAX_UNWRITTEN_PER_SESSION": "17"})
    assert (edge.host_max_unwritten, edge.host_max_unwritten_per_session) == (10, 17)


@pytest.mark.parametrize(
    ("env", "variable", "message"),
    [
        # below the admission limit, a healthy host's turns waiting at the gate would be refused
        ({"CE_HOST_MAX_INFLIGHT": "100", "CE_HOST_MAX_UNWRITTEN": "50"}, "CE_HOST_MAX_UNWRITTEN",
         r"CE_HOST_MAX_UNWRITTEN must be 0 \(twice CE_HOST_MAX_INFLIGHT\) or at least CE_HOST_MAX_INFLIGHT \(100\), got 50"),
        ({"CE_HOST_MAX_UNWRITTEN": "-1"}, "CE_HOST_MAX_UNWRITTEN", r"CE_HOST_MAX_UNWRITTEN must be >= 0"),
        ({"CE_HOST_MAX_UNWRITTEN_PER_SESSION": "16"}, "CE_HOST_MAX_UNWRITTEN_PER_SESSION",
         r"CE_HOST_MAX_UNWRITTEN_PER_SESSION must be >= 17, got 16"),
        ({"CE_HOST_MAX_UNWRITTEN_PER_SESSION": "65"}, "CE_HOST_MAX_UNWRITTEN_PER_SESSION",
         r"CE_HOST_MAX_UNWRITTEN_PER_SESSION must be <= 64, got 65"),
    ],
)
def test_unwritten_turn_caps_that_would_refuse_a_healthy_host_are_refused_at_start(env, variable, message):
    with pytest.raises(ConfigError, match=message) as info:
        Settings.from_env(env)
    assert info.value.variable == variable


def test_the_per_session_cap_is_never_above_the_turn_cache_it_protects():
    from actors.session import TURN_CACHE
    from services.settings import UNWRITTEN_PER_SESSION_MAX

    assert UNWRITTEN_PER_SESSION_MAX == TURN_CACHE


def test_the_least_per_session_cap_holds_a_sessions_mailbox_and_its_running_turn():
    from actors.host import HostSettings
    from services.settings import UNWRITTEN_PER_SESSION_MIN

    assert UNWRITTEN_PER_SESSION_MIN == HostSettings().mailbox + 1
