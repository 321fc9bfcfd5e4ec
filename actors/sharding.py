"""Which shard host owns a session: rendezvous hashing under a shard state (no Ray, no I/O).

A session `tenant_id:session_id` goes to the shard that wins it by highest-random-weight
hashing, so changing the count from n to m moves only the sessions whose winner changed. During
a rescale the state has a `pending` count too, and a host owns a session only if it wins it
under both counts: a session that moves is owned by nobody until the new count is committed,
which is what lets its old host flush and drop it before its new host may activate it.
"""

from __future__ import annotations

import hashlib

from storage.repos.cluster import ShardState

HOST_PREFIX = "ce-host-"


def rendezvous_index(key: str, shards: int) -> int:
    """The shard that wins `key` by highest-random-weight hashing (stable across processes)."""
    best, best_score = 0, b""
    for i in range(shards):
        score = hashlib.blake2b(f"{i}\x00{key}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = i, score
    return best


def host_name(index: int) -> str:
    return f"{HOST_PREFIX}{index}"


def parse_host_name(name: str) -> tuple[str, int] | None:
    """`(prefix, index)` of a shard host's actor name (`bench-ce-host-3` -> `("bench-", 3)`), else None."""
    prefix, sep, index = name.rpartition(HOST_PREFIX)
    if not sep or not index.isdigit():
        return None
    return prefix, int(index)


def session_key(tenant_id: str, session_id: str) -> str:
    return f"{tenant_id}:{session_id}"


def route(state: ShardState, tenant_id: str, session_id: str) -> int:
    """The shard a gateway sends the session to (by the count in force; a moving session is
    refused by both of its hosts until the commit, and the gateway retries)."""
    return rendezvous_index(session_key(tenant_id, session_id), state.shards)


def owns(state: ShardState, index: int, tenant_id: str, session_id: str) -> bool:
    """Whether shard `index` may hold the session under `state` (both counts while one is pending)."""
    key = session_key(tenant_id, session_id)
    if rendezvous_index(key, state.shards) != index:
        return False
    return state.pending is None or rendezvous_index(key, state.pending) == index
