"""The shard count of the session hosts as the composition roots see it: agreed through Postgres.

- `follow_shards` (a gateway, at start): stores CE_SHARDS as the count if none is stored yet,
  otherwise adopts the stored one (a rescale outlives restarts and CE_SHARDS), and follows every
  change on `LISTEN ce_cluster`. Hosts answer a turn for a session they do not own with their
  own state, so a gateway whose notification is late still routes right: this is for promptness.
- `scale` (the operator, `chat-engine scale N`): joins the Ray cluster at RAY_ADDRESS and runs
  `Placement.rescale` against the stored count (see actors/placement.py for the protocol);
  `restart_hosts` (`chat-engine restart-hosts`) re-creates the hosts with the caller's settings.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from actors import cluster
from actors.placement import Placement
from kernel.errors import ConfigError
from services.settings import Settings
from storage.pool import create_pool
from storage.repos.cluster import ClusterRepo

log = structlog.get_logger(__name__)


class ShardFollower:
    """Keeps a Placement routing by the stored shard state; `close()` stops following."""

    def __init__(self, pool: Any, repo: ClusterRepo, placement: Any) -> None:
        self._pool = pool
        self._repo = repo
        self._placement = placement
        self._listener: Any = None
        self._closed = False
        self._resubscribing: asyncio.Future | None = None

    async def reload(self, host_group: str | None = None) -> None:
        group = self._placement.host_group
        if host_group is not None and host_group != group:
            return
        try:
            state = await self._repo.get(group)
        except Exception as exc:  # noqa: BLE001 - hosts still redirect; the next change retries
            log.warning("shard_state_reload_failed", error=type(exc).__name__)
            return
        if state is not None:
            self._placement.apply_shard_state(state)

    def _lost(self) -> None:
        log.warning("shard_listener_lost")
        self._resubscribing = asyncio.ensure_future(self._resubscribe())  # held: asyncio keeps tasks weakly

    async def _resubscribe(self) -> None:
        if self._listener is not None:
            await self._listener.close()  # returns its dead connection to the pool
        delay = 0.5
        while not self._closed:
            try:
                self._listener = await self._repo.listen(self.reload, on_lost=self._lost)
            except Exception:  # noqa: BLE001 - Postgres away: try again
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            await self.reload()  # changes made while we were away
            return

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            await self._listener.close()
        await self._pool.close()


async def follow_shards(settings: Settings, placement: Any) -> ShardFollower | None:
    """Route `placement` by the stored shard count from now on (before it starts its hosts).

    Returns None for dedicated placement (no shards). Raises StorageUnavailable/StorageError when
    Postgres cannot be reached.
    """
    if placement.mode != "sharded":
        return None
    pool = await create_pool(settings.database_url, min_size=1, max_size=2)
    try:
        repo = ClusterRepo(pool)
        state = await repo.ensure(placement.host_group, placement.shards)
        if state.shards != placement.shards:
            log.warning("shard_count_from_database", stored=state.shards, configured=placement.shards,
                        hint="the stored count wins; change it with 'chat-engine scale N'")
        placement.apply_shard_state(state)
        follower = ShardFollower(pool, repo, placement)
        follower._listener = await repo.listen(follower.reload, on_lost=follower._lost)
    except BaseException:
        await pool.close()
        raise
    return follower


def _check_operator_settings(settings: Settings, command: str) -> None:
    if not settings.ray_address or not settings.database_url:
        raise ConfigError(
            f"'chat-engine {command}' changes a running cluster: set RAY_ADDRESS (the cluster the "
            "gateways use) and DATABASE_URL (their database)",
            variable="RAY_ADDRESS" if not settings.ray_address else "DATABASE_URL",
        )
    if settings.placement != "sharded":
        raise ConfigError("CE_PLACEMENT=dedicated has no session hosts to change", variable="CE_PLACEMENT")


async def scale(settings: Settings, target: int) -> Any:
    """`chat-engine scale N`: change the number of session hosts of the running cluster.

    Returns the RescaleReport. Raises ConfigError without RAY_ADDRESS or DATABASE_URL.
    """
    _check_operator_settings(settings, "scale")
    await asyncio.to_thread(cluster.connect, settings)
    pool = await create_pool(settings.database_url, min_size=1, max_size=3)
    try:
        return await Placement(settings).rescale(target, ClusterRepo(pool))
    finally:
        await pool.close()
        await asyncio.to_thread(cluster.disconnect)


async def restart_hosts(settings: Settings) -> list[str]:
    """`chat-engine restart-hosts`: re-create every session host, one at a time, with these
    settings (how a rotated secret or a changed CE_* value reaches the hosts). Returns their names."""
    _check_operator_settings(settings, "restart-hosts")
    await asyncio.to_thread(cluster.connect, settings)
    pool = await create_pool(settings.database_url, min_size=1, max_size=2)
    try:
        state = await ClusterRepo(pool).get("")
        # created with the stored count: the one a host falls back to should the row ever be gone
        placement = Placement(settings, shards=state.shards if state is not None else None)
        return await placement.restart_hosts()
    finally:
        await pool.close()
        await asyncio.to_thread(cluster.disconnect)
