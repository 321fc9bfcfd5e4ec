"""The gateway's key caches as configured: bounded, short-lived, and apart from each other (their
TTL and eviction through the gateway: tests/integration/test_gateway_api_keys.py)."""

from __future__ import annotations

from services.gateway.common import (
    KEY_CACHE_MAX,
    KEY_CACHE_TTL_S,
    UNKNOWN_KEY_CACHE_MAX,
    UNKNOWN_KEY_TTL_S,
    GatewayDeps,
)


def test_the_gateway_bounds_both_key_caches_and_keeps_the_negative_one_short():
    deps = GatewayDeps(router=None, tenants=None, tools=None, calls=None, sessions=None, configs=None,
                       secret_box=None)
    assert (deps.key_cache.maxsize, deps.key_cache.ttl) == (KEY_CACHE_MAX, KEY_CACHE_TTL_S)
    assert deps.unknown_keys.maxsize == UNKNOWN_KEY_CACHE_MAX == 4096
    assert deps.unknown_keys.ttl == UNKNOWN_KEY_TTL_S <= KEY_CACHE_TTL_S
    assert deps.key_cache is not deps.unknown_keys  # a bogus-key flood cannot push out good ones
