"""The SSRF guard: which network destinations a webhook may reach, decided before any connection.

Owns the destination policy (built from `CE_WEBHOOK_ALLOW`), the `Resolver` port and its
c-ares adapter (`AresResolver`), and `check_destination`, which parses a URL, resolves its host
ONCE and checks every address it got. The webhook and MCP clients then connect only to those
checked addresses (`services.tools.webhook`, `services.tools.mcp_client`), so a DNS answer that
changes between check and connect (rebinding) cannot redirect the call.

Host names are tenant data, so their lookups must not be able to starve one another. The loop's
own `getaddrinfo` runs the blocking system resolver in a small shared thread pool (asyncio's
default executor: 6 threads on a 2-core host; libuv's 4 under uvloop), and a thread cannot be
cancelled: a few lookups of a name whose DNS answers slowly or never hold every thread for the
system resolver's full timeout, and every other tenant's webhook and MCP lookups queue behind
them. `AresResolver` asks c-ares (`aiodns`) instead: no pool thread, a bounded time per lookup,
and a caller that gives up (cancelled, or past its deadline) is released at once.

Refused unless the operator allowlist names the host or covers the address: loopback, private
(RFC 1918), link-local (169.254/16 — the cloud metadata address 169.254.169.254 — and fe80::/10),
unique-local fc00::/7, unspecified, multicast, reserved, shared/CGNAT 100.64/10, anything else
that is not globally routable, and IPv4 addresses embedded in IPv6 (mapped, NAT64, 6to4, Teredo)
that fall in any of those.

No network I/O happens here except through the injected `Resolver`; the rules are pure functions.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import aiodns
import msgspec

from kernel.errors import ConfigError
from services.tools.errors import UpstreamUnreachable, blocked

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_ALLOWED_SCHEMES = {"http": 80, "https": 443}
_HOST_NAME_RE = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$"
)
_CONTROL_OR_SPACE_RE = re.compile(r"[\x00-\x20\x7f\\]")

# Named ranges checked before the generic `is_global` fallback, so `rule` says precisely why.
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_METADATA = ipaddress.ip_address("169.254.169.254")
#: cloud platform services on addresses Python counts as global: Azure's wire server (its
#: metadata, health probes and DNS) and Oracle Cloud's metadata service
_CLOUD_PLATFORM = frozenset({ipaddress.ip_address("168.63.129.16"), ipaddress.ip_address("192.0.0.192")})

# c-ares status -> the getaddrinfo error the system resolver would have raised
_GAI_ERRORS = {
    aiodns.error.ARES_ENOTFOUND: socket.EAI_NONAME,
    aiodns.error.ARES_ENONAME: socket.EAI_NONAME,
    aiodns.error.ARES_ENODATA: socket.EAI_NONAME,
    aiodns.error.ARES_ETIMEOUT: socket.EAI_AGAIN,
    aiodns.error.ARES_ESERVFAIL: socket.EAI_AGAIN,
    aiodns.error.ARES_EREFUSED: socket.EAI_AGAIN,
    aiodns.error.ARES_ECONNREFUSED: socket.EAI_AGAIN,
}


class Resolver(Protocol):
    """Port: turn a host name into the IP addresses (as strings) a connection may use."""

    async def resolve(self, host: str, port: int) -> list[str]: ...


class AresResolver:
    """The default `Resolver`: c-ares through `aiodns`, asynchronous and cancellable.

    Reads the system's configuration as `getaddrinfo` does (/etc/hosts and DNS in the order
    /etc/nsswitch.conf gives; the nameservers, search domains and ndots of /etc/resolv.conf) and
    asks for IPv4 and IPv6 at once. A lookup gets `attempt_timeout_s` per try of a nameserver
    and `tries` tries, and never more than `timeout_s` in all (search domains multiply the
    tries). `nameservers` ("127.0.0.1" or "127.0.0.1:5353") replaces the system's list; tests
    point it at loopback servers.

    The c-ares channel binds to an event loop, so it is made on the first lookup inside a
    running loop (made again if a later lookup runs in another loop), never in the constructor:
    constructing one outside a loop is fine. Lookups share the channel, which waits for all of
    them at once on one event thread of c-ares's own. c-ares cannot cancel one query alone,
    so a caller that stops waiting is released at once and its unanswered query expires inside
    c-ares after its tries, holding no thread and delaying no other lookup.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 3.0,
        attempt_timeout_s: float = 1.0,
        tries: int = 2,
        nameservers: Sequence[str] | None = None,
    ) -> None:
        if timeout_s <= 0 or attempt_timeout_s <= 0 or tries < 1:
            raise ValueError(
                f"resolver timeouts must be > 0 and tries >= 1, got timeout_s={timeout_s}, "
                f"attempt_timeout_s={attempt_timeout_s}, tries={tries}"
            )
        self._timeout_s = timeout_s
        self._attempt_timeout_s = attempt_timeout_s
        self._tries = tries
        self._nameservers = list(nameservers) if nameservers else None
        self._channel: aiodns.DNSResolver | None = None

    async def resolve(self, host: str, port: int) -> list[str]:
        """Return the distinct addresses for `host`, in resolver order (RFC 6724 sorted).

        Raises socket.gaierror (an OSError) when the name does not resolve, the nameservers
        fail, or no answer came within `timeout_s`.
        """
        channel = self._channel_for(asyncio.get_running_loop())
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await channel.getaddrinfo(
                    host, port=port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
        except TimeoutError:
            raise socket.gaierror(
                socket.EAI_AGAIN, f"dns lookup of {host!r} timed out after {self._timeout_s:g} s"
            ) from None
        except aiodns.error.DNSError as error:
            code = error.args[0] if error.args else None
            message = error.args[1] if len(error.args) > 1 else "unknown error"
            raise socket.gaierror(
                _GAI_ERRORS.get(code, socket.EAI_FAIL),
                f"dns lookup of {host!r} failed: {str(message).lower()}",
            ) from None
        # one node per address and family; pycares gives the address text as bytes
        return list(dict.fromkeys(node.addr[0].decode() for node in result.nodes))

    def _channel_for(self, loop: asyncio.AbstractEventLoop) -> aiodns.DNSResolver:
        channel = self._channel
        if channel is None or channel.loop is not loop:
            channel = aiodns.DNSResolver(
                nameservers=self._nameservers,
                loop=loop,
                timeout=self._attempt_timeout_s,
                tries=self._tries,
            )
            self._channel = channel
        return channel


class CheckedDestination(msgspec.Struct, frozen=True, kw_only=True):
    """A destination that passed the guard: connect to `addresses` only, never re-resolve `host`."""

    scheme: str  # "http" | "https"
    host: str  # lower-case ASCII host name or IP literal, without brackets or trailing dot
    port: int
    addresses: list[str]  # every address `host` resolved to, each one checked
    path_and_query: str  # "/api/orders/123?x=1", already percent-encoded

    @property
    def url(self) -> str:
        """The request URL rebuilt from the checked parts (default port omitted)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        netloc = host if _ALLOWED_SCHEMES[self.scheme] == self.port else f"{host}:{self.port}"
        return f"{self.scheme}://{netloc}{self.path_and_query}"


@dataclass(frozen=True)
class DestinationPolicy:
    """The exceptions to the guard: the operator's `CE_WEBHOOK_ALLOW` entries (`allow`, for every
    tenant, any port) and one tenant's egress allowances (`tenant`: (entry, port) pairs an
    operator granted that tenant alone, `chat-engine tenant allow-egress`; port 0: any port).

    A host name entry allows that exact host (case-insensitive), whatever it resolves to. A CIDR
    entry allows any address inside it (an IPv4 CIDR also covers the IPv4-mapped IPv6 form).
    Raises ConfigError naming the entry when one is neither, or a CIDR with host bits set.
    """

    allow: tuple[str, ...] = ()
    tenant: tuple[tuple[str, int], ...] = ()
    networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)
    host_names: frozenset[str] = field(init=False, repr=False, compare=False)
    _tenant_networks: tuple[tuple[IPNetwork, int], ...] = field(init=False, repr=False, compare=False)
    _tenant_hosts: frozenset[tuple[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for raw in self.allow:
            entry = raw.strip()
            if not entry:
                continue
            parsed = parse_allow_entry(entry, variable="CE_WEBHOOK_ALLOW")
            if isinstance(parsed, str):
                names.add(parsed)
            else:
                networks.append(parsed)
        tenant_networks: list[tuple[IPNetwork, int]] = []
        tenant_hosts: set[tuple[str, int]] = set()
        for entry, port in self.tenant:
            parsed = parse_allow_entry(entry, variable="egress allowance")
            if isinstance(parsed, str):
                tenant_hosts.add((parsed, port))
            else:
                tenant_networks.append((parsed, port))
        # frozen dataclass: derived fields are set once here, never again
        object.__setattr__(self, "networks", tuple(networks))
        object.__setattr__(self, "host_names", frozenset(names))
        object.__setattr__(self, "_tenant_networks", tuple(tenant_networks))
        object.__setattr__(self, "_tenant_hosts", frozenset(tenant_hosts))

    def for_tenant(self, allowances: Iterable[tuple[str, int]]) -> DestinationPolicy:
        """This operator-wide policy with one tenant's egress allowances added."""
        allowances = tuple(allowances)
        return self if not allowances else DestinationPolicy(allow=self.allow, tenant=allowances)

    def allows_host(self, host: str, port: int | None = None) -> bool:
        name = host.lower().rstrip(".")
        return name in self.host_names or (name, 0) in self._tenant_hosts or (
            port is not None and (name, port) in self._tenant_hosts)

    def covers(self, address: IPAddress, port: int | None = None) -> bool:
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        if any(a in net for a in candidates for net in self.networks if a.version == net.version):
            return True
        return any(a in net for a in candidates for net, allowed in self._tenant_networks
                   if a.version == net.version and allowed in (0, port))


def parse_allow_entry(entry: str, *, variable: str) -> IPNetwork | str:
    """An allow entry as the network it names or the host name (normalised); ConfigError naming
    `variable` when it is neither, or a CIDR with host bits set (`strict=False` would widen
    10.0.0.1/0 to 0.0.0.0/0: allow everything)."""
    try:
        return ipaddress.ip_network(entry)
    except ValueError:
        if "/" in entry and _host_bits_set(entry):
            raise ConfigError(
                f"{variable} entry {entry!r} has host bits set; write the network itself "
                f"({ipaddress.ip_network(entry, strict=False)}) or the one address without a prefix",
                variable=variable,
            ) from None
    name = _normalise_host_name(entry)
    if name is None:
        raise ConfigError(f"{variable} entry {entry!r} is neither a CIDR (10.0.0.0/8) nor a host name",
                          variable=variable)
    return name


def _host_bits_set(entry: str) -> bool:
    """Whether `entry` is a CIDR that only a non-strict parse accepts (host bits set)."""
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def refusal_rule(address: IPAddress) -> str | None:
    """The name of the rule that refuses `address`, or None when it is a public address.

    Pure: the allowlist is not consulted here (see `DestinationPolicy`).
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            kind, v4 = embedded
            inner = refusal_rule(v4)
            if inner is not None:
                return f"{kind} {inner}"
    if address.is_unspecified:
        return "unspecified address"
    if address.is_loopback:
        return "loopback address"
    if address == _METADATA:
        return "link-local address (cloud metadata)"
    if address in _CLOUD_PLATFORM:
        return "cloud platform address (metadata service)"
    if address.is_link_local:
        return "link-local address"
    if address.is_multicast:
        return "multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return "shared address space (cgnat 100.64.0.0/10)"
    if isinstance(address, ipaddress.IPv6Address) and address in _UNIQUE_LOCAL:
        return "unique-local address"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local address"
    if address.is_reserved:
        return "reserved address"
    if address.is_private:
        return "private address"
    if not address.is_global:
        return "non-global address"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    if address.ipv4_mapped is not None:
        return "ipv4-mapped", address.ipv4_mapped
    if address in _NAT64:
        return "nat64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return "6to4", address.sixtofour
    if address.teredo is not None:
        return "teredo", address.teredo[1]
    return None


async def check_destination(
    url: str, resolver: Resolver, policy: DestinationPolicy
) -> CheckedDestination:
    """Parse `url`, resolve its host once, and check every address against the rules and `policy`.

    Returns the CheckedDestination to connect to. Raises DestinationBlocked (reason "destination
    not allowed"; `.rule` says which check refused) for a bad scheme, userinfo, a malformed host or
    any refused address; UpstreamUnreachable when the host does not resolve. Nothing connects here.
    """
    if _CONTROL_OR_SPACE_RE.search(url):
        raise blocked(
            "malformed url", "url contains whitespace, a control character or a backslash"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise blocked("malformed url", "url has an invalid host or port") from None
    scheme = parts.scheme.lower()
    if scheme not in _ALLOWED_SCHEMES:
        raise blocked("scheme not allowed", f"scheme {scheme or 'none'!r} is not http or https")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise blocked("userinfo in url", "credentials in the url (user@host) are not allowed")
    raw_host = parts.hostname
    if not raw_host:
        raise blocked("malformed url", "url names no host")
    if port is None:
        port = _ALLOWED_SCHEMES[scheme]
    if port == 0:
        raise blocked("malformed url", "port 0 is not a destination")

    literal = _parse_ip_literal(raw_host)
    if literal is not None:
        host = str(literal)
        addresses = [host]
    else:
        host_name = _normalise_host_name(raw_host)
        if host_name is None:
            raise blocked("malformed url", "host is not a valid host name or IP literal")
        host = host_name
        try:
            addresses = list(dict.fromkeys(await resolver.resolve(host, port)))
        except OSError:
            raise UpstreamUnreachable(
                "upstream host name could not be resolved",
                advice="Tell the customer you cannot reach the service right now.",
            ) from None
        if not addresses:
            raise UpstreamUnreachable(
                "upstream host name could not be resolved",
                advice="Tell the customer you cannot reach the service right now.",
            )

    host_allowed = policy.allows_host(host, port)
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise blocked(
                "unparseable address", f"host {host!r} resolved to a non-IP value"
            ) from None
        if host_allowed or policy.covers(address, port):
            continue
        rule = refusal_rule(address)
        if rule is not None:
            raise blocked(
                rule,
                f"host {host!r} resolved to {text}, a {rule}; allow it with CE_WEBHOOK_ALLOW if intended",
            )

    path = parts.path or "/"
    path_and_query = f"{path}?{parts.query}" if parts.query else path
    return CheckedDestination(
        scheme=scheme, host=host, port=port, addresses=addresses, path_and_query=path_and_query
    )


def literal_refusal(url: str, policy: DestinationPolicy) -> str | None:
    """The rule that refuses `url` whatever DNS answers, or None when only resolving can tell.

    Decidable from the text alone: an IP-literal host the guard refuses (unless `policy` covers
    it), and a host that is neither a host name nor an IP literal (legacy numeric forms such as
    2852039166 or 0xa9fea9fe). A host name returns None: `check_destination` decides at call time.
    Pure; used where a URL is registered, so a tenant learns at once rather than at the first call.
    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "malformed url"
    if not host:
        return "malformed url"
    literal = _parse_ip_literal(host)
    if literal is None:
        return None if _normalise_host_name(host) is not None else "malformed url"
    if policy.covers(literal, port if port is not None else _ALLOWED_SCHEMES.get(parts.scheme.lower())):
        return None
    return refusal_rule(literal)


def _parse_ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _normalise_host_name(host: str) -> str | None:
    """Lower-case ASCII (IDNA) form of a DNS host name without trailing dot, or None if invalid."""
    name = host.strip().rstrip(".").lower()
    if not name:
        return None
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    if not _HOST_NAME_RE.match(name):
        return None
    # all-numeric dotted names ("127.1", "2130706433") are legacy IPv4 forms, not host names
    if all(label.isdigit() or label.startswith("0x") for label in name.split(".")):
        return None
    return name


def policy_from_entries(entries: Iterable[str]) -> DestinationPolicy:
    """DestinationPolicy from allowlist entries (`Settings.webhook_allow`)."""
    return DestinationPolicy(allow=tuple(entries))
