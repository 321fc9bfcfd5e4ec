"""`AresResolver`, the SSRF guard's default resolver: bounded, cancellable, and off the thread pool.

The regression guarded here: host names are tenant data, and the old resolver ran the blocking
system resolver in the event loop's default executor (6 threads on a 2-core host), so a few
lookups of a name whose DNS never answers held every thread and stalled every other tenant's
lookups. These tests aim the resolver at DNS servers on 127.0.0.1 only, always through an explicit
`nameservers` list: a black hole that reads nothing and answers nothing, and a tiny server that
answers from a table. No packet goes anywhere else; "localhost" comes from /etc/hosts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
import uvloop

from services.tools.errors import UpstreamUnreachable
from services.tools.mcp_client import McpHttpClient
from services.tools.ssrf import AresResolver, DestinationPolicy, check_destination
from services.tools.webhook import WebhookClient

SLACK_S = 1.0  # what a busy shared machine may add to a deadline before a test calls it late
PROMPT_S = 0.5  # "at once": an /etc/hosts answer or a cancellation, even on a busy machine

_TYPE_A, _TYPE_AAAA = 1, 28


class BlackHoleDns:
    """A UDP "DNS server" on 127.0.0.1 that never answers; counts the queries that reached it."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.queries = 0

    def drain(self) -> int:
        """Read what arrived since the last call; returns the total number of queries so far."""
        while True:
            try:
                self._sock.recv(4096)
            except BlockingIOError:
                return self.queries
            self.queries += 1

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def black_hole() -> Iterator[BlackHoleDns]:
    server = BlackHoleDns()
    yield server
    server.close()


class TableDns(asyncio.DatagramProtocol):
    """A DNS server on 127.0.0.1 answering A and AAAA queries from a table; NXDOMAIN otherwise."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(_reply(data, self.table), addr)


def _reply(query: bytes, table: dict[str, list[str]]) -> bytes:
    """A minimal DNS answer to `query` (RFC 1035 4.1), hand-built: header, question, answers."""
    end = query.index(b"\x00", 12) + 1  # the question name ends at its zero-length label
    labels, at = [], 12
    while query[at]:
        labels.append(query[at + 1 : at + 1 + query[at]].decode())
        at += 1 + query[at]
    qtype = struct.unpack("!H", query[end : end + 2])[0]
    question = query[12 : end + 4]
    name = ".".join(labels).lower()
    addresses = [ipaddress.ip_address(a) for a in table.get(name, [])]
    wanted = 4 if qtype == _TYPE_A else 6 if qtype == _TYPE_AAAA else 0
    rdatas = [a.packed for a in addresses if a.version == wanted]
    rcode = 0 if name in table else 3  # NXDOMAIN
    flags = 0x8000 | (struct.unpack("!H", query[2:4])[0] & 0x0100) | 0x0080 | rcode  # QR, RD, RA
    header = query[:2] + struct.pack("!HHHHH", flags, 1, len(rdatas), 0, 0)
    answers = b"".join(
        b"\xc0\x0c" + struct.pack("!HHIH", qtype, 1, 60, len(rdata)) + rdata for rdata in rdatas
    )
    return header + question + answers


async def wait_until(condition: Callable[[], bool], *, within_s: float = 2.0) -> None:
    """Poll `condition` (e.g. queries seen by a server) until it holds; fails instead of hanging."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        # the whole-lookup deadline ends it: c-ares would still be waiting on its one long try
        ({"timeout_s": 0.3, "attempt_timeout_s": 10.0, "tries": 1}, r"timed out after 0\.3 s"),
        # c-ares gives up first: one short try, no answer
        ({"timeout_s": 10.0, "attempt_timeout_s": 0.2, "tries": 1}, "failed: timeout"),
    ],
    ids=["lookup_deadline", "ares_tries"],
)
async def test_a_name_whose_dns_never_answers_fails_with_oserror_within_the_budget(
    black_hole: BlackHoleDns, budget: dict, match: str
) -> None:
    resolver = AresResolver(nameservers=[black_hole.address], **budget)
    started = time.monotonic()
    with pytest.raises(OSError, match=match) as caught:
        await resolver.resolve("never-answers.test", 443)
    elapsed = time.monotonic() - started
    assert caught.value.errno == socket.EAI_AGAIN
    assert elapsed < min(budget["timeout_s"], budget["attempt_timeout_s"]) + SLACK_S
    assert black_hole.drain() >= 1, "the query went to the loopback black hole"


async def test_the_guard_reports_a_black_holed_name_as_unreachable_in_bounded_time(
    black_hole: BlackHoleDns,
) -> None:
    resolver = AresResolver(nameservers=[black_hole.address], timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(UpstreamUnreachable, match="upstream host name could not be resolved"):
        await check_destination(
            "https://orders.never-answers.test/x", resolver, DestinationPolicy()
        )
    assert time.monotonic() - started < 0.3 + SLACK_S


async def test_cancelling_a_lookup_returns_at_once_and_the_resolver_keeps_working(
    black_hole: BlackHoleDns,
) -> None:
    resolver = AresResolver(
        nameservers=[black_hole.address], timeout_s=30.0, attempt_timeout_s=10.0
    )
    lookup = asyncio.create_task(resolver.resolve("never-answers.test", 443))
    await wait_until(lambda: black_hole.drain() >= 1)  # in flight: c-ares has asked

    started = time.monotonic()
    lookup.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(PROMPT_S):
            await lookup
    assert time.monotonic() - started < PROMPT_S
    assert await resolver.resolve("localhost", 80)  # the shared channel was not disturbed


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A small default executor that counts what is submitted to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.asyncio(loop_scope="function")  # its own loop: the default executor is replaced
async def test_twenty_black_holed_lookups_take_no_pool_thread_and_others_still_resolve(
    black_hole: BlackHoleDns,
) -> None:
    loop = asyncio.get_running_loop()
    pool = CountingExecutor()
    loop.set_default_executor(pool)
    # c-ares gives up on its own (one 1 s try), so nothing is left pending when this loop closes
    resolver = AresResolver(
        nameservers=[black_hole.address], timeout_s=5.0, attempt_timeout_s=1.0, tries=1
    )

    stuck = [
        asyncio.create_task(resolver.resolve(f"tenant-{i}.never-answers.test", 443))
        for i in range(20)
    ]
    await wait_until(lambda: black_hole.drain() >= 20)  # all twenty are waiting on the black hole

    started = time.monotonic()
    assert set(await resolver.resolve("localhost", 80)) <= {"127.0.0.1", "::1"}
    assert time.monotonic() - started < PROMPT_S, "another lookup waited behind the stuck ones"
    started = time.monotonic()
    assert await loop.run_in_executor(None, lambda: "pool free") == "pool free"
    assert time.monotonic() - started < PROMPT_S, "the default executor was exhausted"
    assert pool.submitted == 1  # only the call above: no lookup used a pool thread
    assert not any(task.done() for task in stuck), "the twenty were still in flight throughout"

    results = await asyncio.gather(*stuck, return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results), results
    assert pool.submitted == 1

    # the control: the loop's own getaddrinfo (the old default resolver) does take a pool thread
    await loop.getaddrinfo("127.0.0.1", 80)
    assert pool.submitted == 2


async def test_localhost_resolves_from_etc_hosts_to_loopback_without_asking_dns(
    black_hole: BlackHoleDns,
) -> None:
    addresses = await AresResolver(nameservers=[black_hole.address]).resolve("localhost", 8080)
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    assert len(addresses) == len(set(addresses))
    assert black_hole.drain() == 0


async def test_a_name_is_answered_with_its_distinct_ipv4_and_ipv6_addresses() -> None:
    loop = asyncio.get_running_loop()
    table = {"shop.example.test": ["127.0.0.7", "127.0.0.7", "127.0.0.8", "::1"]}
    transport, _ = await loop.create_datagram_endpoint(
        lambda: TableDns(table), local_addr=("127.0.0.1", 0)
    )
    try:
        port = transport.get_extra_info("sockname")[1]
        resolver = AresResolver(nameservers=[f"127.0.0.1:{port}"])
        addresses = await resolver.resolve("shop.example.test", 443)
        assert sorted(addresses) == ["127.0.0.7", "127.0.0.8", "::1"]
        with pytest.raises(OSError, match="dns lookup of 'nowhere.example.test' failed") as caught:
            await resolver.resolve("nowhere.example.test", 443)
        assert caught.value.errno == socket.EAI_NONAME
    finally:
        transport.close()


def test_a_resolver_made_outside_a_loop_binds_to_each_loop_that_uses_it(
    black_hole: BlackHoleDns,
) -> None:
    resolver = AresResolver(nameservers=[black_hole.address])  # no running loop here
    for _ in range(2):  # a second asyncio.run is a new loop: the channel is made again for it
        assert asyncio.run(resolver.resolve("localhost", 80))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as `chat-engine` runs
        assert runner.run(resolver.resolve("localhost", 80))
        with pytest.raises(OSError):
            runner.run(
                AresResolver(
                    nameservers=[black_hole.address], attempt_timeout_s=0.2, tries=1
                ).resolve("never-answers.test", 80)
            )


def test_the_webhook_and_mcp_clients_default_to_the_c_ares_resolver_outside_a_loop() -> None:
    policy = DestinationPolicy()
    assert isinstance(WebhookClient(policy=policy)._resolver, AresResolver)
    assert isinstance(McpHttpClient(policy=policy)._resolver, AresResolver)


@pytest.mark.parametrize(
    "bad", [{"timeout_s": 0}, {"attempt_timeout_s": -1.0}, {"tries": 0}], ids=str
)
def test_a_resolver_without_a_positive_budget_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="resolver timeouts must be > 0 and tries >= 1"):
        AresResolver(**bad)
