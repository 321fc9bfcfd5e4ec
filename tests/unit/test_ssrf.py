"""The SSRF guard as a policy table: which addresses are refused, which the allowlist lets through.

Nothing here connects anywhere: host names "resolve" through `MapResolver`, and an accepted
public address is only checked by the policy, never contacted.
"""

from __future__ import annotations

import ipaddress

import pytest

from kernel.errors import ConfigError
from services.tools.errors import DestinationBlocked, UpstreamUnreachable
from services.tools.ssrf import (
    AresResolver,
    CheckedDestination,
    DestinationPolicy,
    check_destination,
    refusal_rule,
)
from tests.support.net_fakes import MapResolver

NO_ALLOW = DestinationPolicy(allow=())

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.255.0.7", "loopback"),
    ("::1", "loopback"),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.254", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "metadata"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("fc00::1", "unique-local"),
    ("fd12:3456::1", "unique-local"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("::ffff:127.0.0.1", "ipv4-mapped loopback"),
    ("::ffff:169.254.169.254", "ipv4-mapped link-local"),
    ("::ffff:10.0.0.1", "ipv4-mapped private"),
    ("100.64.0.1", "cgnat"),
    ("100.127.255.254", "cgnat"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", None),  # broadcast: refused, whichever rule names it
    ("192.0.2.10", None),  # documentation range: not global
    ("64:ff9b::a00:1", "nat64 private"),  # NAT64 form of 10.0.0.1
    ("2002:a9fe:a9fe::", "6to4 link-local"),  # 6to4 form of 169.254.169.254
    ("fec0::1", None),  # deprecated site-local
    ("168.63.129.16", "cloud platform address"),  # Azure's wire server (metadata, health, DNS)
    ("192.0.0.192", "cloud platform address"),  # Oracle Cloud's metadata service
    ("::ffff:168.63.129.16", "ipv4-mapped cloud platform address"),
]


@pytest.mark.parametrize(("address", "rule_part"), REFUSED)
async def test_an_internal_address_reached_through_a_host_name_is_refused(
    address: str, rule_part: str | None
) -> None:
    resolver = MapResolver({"victim.test": [address]})
    with pytest.raises(DestinationBlocked) as info:
        await check_destination("https://victim.test/api", resolver, NO_ALLOW)
    error = info.value
    assert str(error) == "destination not allowed"
    assert (
        address not in error.reason and address not in error.advice
    )  # nothing internal to the model
    assert rule_part is None or rule_part in error.rule
    assert address in error.detail  # but the operator log says which address
    assert resolver.calls == [("victim.test", 443)]


@pytest.mark.parametrize(("address", "rule_part"), REFUSED)
async def test_an_internal_ip_literal_is_refused_without_any_lookup(
    address: str, rule_part: str | None
) -> None:
    host = f"[{address}]" if ":" in address else address
    resolver = MapResolver()
    with pytest.raises(DestinationBlocked, match="^destination not allowed$"):
        await check_destination(f"http://{host}:8080/x", resolver, NO_ALLOW)
    assert resolver.calls == []


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "8.8.8.8", "2606:2800:220:1:248:1893:25c8:1946"]
)
async def test_a_public_address_is_accepted_by_the_policy(address: str) -> None:
    # policy only: nothing here opens a connection to this address
    resolver = MapResolver({"shop.test": [address]})
    checked = await check_destination("https://shop.test/api/orders/1?x=2", resolver, NO_ALLOW)
    assert checked == CheckedDestination(
        scheme="https",
        host="shop.test",
        port=443,
        addresses=[address],
        path_and_query="/api/orders/1?x=2",
    )


async def test_every_address_is_checked_one_internal_answer_refuses_the_host() -> None:
    resolver = MapResolver({"mixed.test": ["93.184.216.34", "10.0.0.1"]})
    with pytest.raises(DestinationBlocked) as info:
        await check_destination("https://mixed.test/", resolver, NO_ALLOW)
    assert "10.0.0.1" in info.value.detail


async def test_the_host_is_resolved_exactly_once_and_all_addresses_are_kept() -> None:
    resolver = MapResolver(
        {"shop.test": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "93.184.216.34"]}
    )
    checked = await check_destination("http://shop.test:8080/a", resolver, NO_ALLOW)
    assert resolver.calls == [("shop.test", 8080)]
    assert checked.addresses == ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"]


async def test_allowlist_cidr_lets_covered_addresses_through_and_nothing_else() -> None:
    policy = DestinationPolicy(allow=("10.0.0.0/8",))
    resolver = MapResolver({"backend.test": ["10.0.0.1"], "other.test": ["192.168.1.1"]})
    checked = await check_destination("http://backend.test/x", resolver, policy)
    assert checked.addresses == ["10.0.0.1"]
    with pytest.raises(DestinationBlocked):
        await check_destination("http://other.test/x", resolver, policy)


async def test_allowlist_cidr_covers_the_ipv4_mapped_form() -> None:
    policy = DestinationPolicy(allow=("127.0.0.0/8",))
    checked = await check_destination("http://[::ffff:127.0.0.1]:9000/", MapResolver(), policy)
    assert [ipaddress.ip_address(a) for a in checked.addresses] == [
        ipaddress.ip_address("::ffff:127.0.0.1")
    ]


async def test_allowlist_host_name_allows_that_host_whatever_it_resolves_to() -> None:
    policy = DestinationPolicy(allow=("Demo-Backend.internal",))
    resolver = MapResolver(
        {"demo-backend.internal": ["10.1.2.3", "127.0.0.1"], "evil.internal": ["10.1.2.3"]}
    )
    checked = await check_destination("http://DEMO-BACKEND.internal./api", resolver, policy)
    assert checked.host == "demo-backend.internal"
    assert checked.addresses == ["10.1.2.3", "127.0.0.1"]
    with pytest.raises(DestinationBlocked):
        await check_destination("http://evil.internal/api", resolver, policy)


async def test_allowlisting_a_host_name_does_not_allow_its_address_under_another_name() -> None:
    policy = DestinationPolicy(allow=("backend.internal",))
    with pytest.raises(DestinationBlocked):
        await check_destination("http://10.1.2.3/api", MapResolver(), policy)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("ftp://shop.test/file", "scheme not allowed"),
        ("file:///etc/passwd", "scheme not allowed"),
        ("gopher://shop.test/", "scheme not allowed"),
        ("//shop.test/x", "scheme not allowed"),
        ("http://user:pw@shop.test/", "userinfo in url"),
        ("http://shop.test@169.254.169.254/", "userinfo in url"),
        ("http://@shop.test/", "userinfo in url"),
        ("http://shop .test/", "malformed url"),
        ("http://shop.test\\@evil.test/", "malformed url"),
        ("http:///path-only", "malformed url"),
        ("http://[::1/", "malformed url"),
        ("http://shop.test:99999/", "malformed url"),
        ("http://shop.test:0/", "malformed url"),
        ("http://127.1/", "malformed url"),  # legacy numeric IPv4 forms are not host names
        ("http://2130706433/", "malformed url"),
        ("http://0x7f.0.0.1/", "malformed url"),
        ("http://exa%6dple.test/", "malformed url"),
    ],
)
async def test_malformed_or_non_http_urls_are_refused_before_any_lookup(
    url: str, rule: str
) -> None:
    resolver = MapResolver({"shop.test": ["93.184.216.34"]})
    with pytest.raises(DestinationBlocked, match="^destination not allowed$") as info:
        await check_destination(url, resolver, NO_ALLOW)
    assert info.value.rule == rule
    assert resolver.calls == []


async def test_a_host_that_does_not_resolve_is_unreachable_not_blocked() -> None:
    with pytest.raises(UpstreamUnreachable, match="could not be resolved"):
        await check_destination("https://nowhere.test/", MapResolver(), NO_ALLOW)


async def test_a_host_resolving_to_nothing_is_unreachable() -> None:
    with pytest.raises(UpstreamUnreachable, match="could not be resolved"):
        await check_destination("https://empty.test/", MapResolver({"empty.test": []}), NO_ALLOW)


async def test_unicode_host_names_are_checked_in_their_idna_form() -> None:
    resolver = MapResolver({"xn--bcher-kva.test": ["93.184.216.34"]})
    checked = await check_destination("https://bücher.test/", resolver, NO_ALLOW)
    assert checked.host == "xn--bcher-kva.test"


@pytest.mark.parametrize(
    ("checked", "url"),
    [
        (
            CheckedDestination(
                scheme="https", host="a.test", port=443, addresses=[], path_and_query="/x?y=1"
            ),
            "https://a.test/x?y=1",
        ),
        (
            CheckedDestination(
                scheme="http", host="a.test", port=8080, addresses=[], path_and_query="/"
            ),
            "http://a.test:8080/",
        ),
        (
            CheckedDestination(
                scheme="http", host="::1", port=80, addresses=[], path_and_query="/"
            ),
            "http://[::1]/",
        ),
    ],
)
def test_checked_destination_rebuilds_its_url(checked: CheckedDestination, url: str) -> None:
    assert checked.url == url


def test_refusal_rule_is_none_for_a_public_address_and_names_the_rule_otherwise() -> None:
    assert refusal_rule(ipaddress.ip_address("93.184.216.34")) is None
    assert (
        refusal_rule(ipaddress.ip_address("169.254.169.254"))
        == "link-local address (cloud metadata)"
    )
    assert refusal_rule(ipaddress.ip_address("fe80::1%eth0")) == "link-local address"


def test_an_allowlist_entry_that_is_neither_cidr_nor_host_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CE_WEBHOOK_ALLOW entry 'not a host!'"):
        DestinationPolicy(allow=("not a host!",))


async def test_the_default_resolver_resolves_an_ip_literal_without_the_network() -> None:
    # a loopback port nobody serves: were a query sent, it would go nowhere else
    resolver = AresResolver(nameservers=["127.0.0.1:9"])
    assert await resolver.resolve("127.0.0.1", 80) == ["127.0.0.1"]


@pytest.mark.parametrize("entry", ["10.0.0.1/0", "10.0.0.1/8", "fd00::1/64"])
def test_a_cidr_with_host_bits_is_refused_naming_it_not_widened(entry) -> None:
    # before: ip_network(strict=False) turned 10.0.0.1/0 into 0.0.0.0/0, "allow everything"
    with pytest.raises(ConfigError, match=f"CE_WEBHOOK_ALLOW entry {entry!r} has host bits set"):
        DestinationPolicy(allow=(entry,))


def test_an_address_without_a_prefix_is_still_one_host() -> None:
    policy = DestinationPolicy(allow=("10.0.0.7", "10.1.0.0/16"))
    assert [str(n) for n in policy.networks] == ["10.0.0.7/32", "10.1.0.0/16"]
