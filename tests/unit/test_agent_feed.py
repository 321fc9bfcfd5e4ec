"""The agents' feed on one gateway (services.gateway.feed), without Postgres: a notice is read
back once and handed to every watcher of its tenant in order; other tenants' watchers get
nothing; a lost LISTEN or a watcher that cannot keep up is told to reload (RESET)."""

from __future__ import annotations

from kernel.records import SessionEvent
from services.gateway import feed as feed_module
from services.gateway.feed import RESET, AgentFeed
from storage.repos.sessions import FeedNotice


class Log:
    def __init__(self) -> None:
        self.reads = 0

    async def events_after(self, tenant_id: str, session_id: str, after: int) -> list[SessionEvent]:
        self.reads += 1
        return [SessionEvent(seq=n, type="message", data={"text": f"{tenant_id}-{n}"}) for n in range(after + 1, 9)]


async def subscribed(feed: AgentFeed, tenant_id: str):
    queue = feed_module.asyncio.Queue(maxsize=feed_module.WATCHER_QUEUE)
    feed._watchers.setdefault(tenant_id, set()).add(queue)  # as subscribe() does once it listens
    return queue


def drained(queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_a_notice_is_read_once_and_reaches_every_watcher_of_its_tenant_only():
    log = Log()
    feed = AgentFeed(pool=None, sessions=log)
    a1, a2, b = await subscribed(feed, "ta"), await subscribed(feed, "ta"), await subscribed(feed, "tb")
    await feed._deliver(FeedNotice(t="ta", s="s1", a=2, z=4))
    assert log.reads == 1
    for queue in (a1, a2):
        assert [(s, e.seq) for s, e in drained(queue)] == [("s1", 3), ("s1", 4)]
    assert drained(b) == []
    await feed._deliver(FeedNotice(t="tc", s="s1", a=0, z=1))  # nobody of that tenant here
    assert log.reads == 1


async def test_a_lost_listen_tells_every_watcher_to_reload():
    feed = AgentFeed(pool=None, sessions=Log())
    a, b = await subscribed(feed, "ta"), await subscribed(feed, "tb")
    feed._lost()
    assert drained(a) == [RESET] and drained(b) == [RESET]


async def test_a_watcher_that_cannot_keep_up_is_dropped_and_told_to_reload():
    feed = AgentFeed(pool=None, sessions=Log())
    slow = feed_module.asyncio.Queue(maxsize=2)
    feed._watchers["ta"] = {slow}
    await feed._deliver(FeedNotice(t="ta", s="s1", a=0, z=8))
    items = drained(slow)
    assert items[-1] == RESET and len(items) == 2
    assert feed.watchers == 0
