"""Connecting this process to Ray: join RAY_ADDRESS, or start a local Ray bound to loopback.

`connect_ray` is what entry points call: it fails in seconds, naming RAY_ADDRESS, when the
cluster cannot be reached.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import ray

from actors.placement import NAMESPACE
from kernel.errors import ConfigError
from services.settings import Settings


def connect(settings: Settings, *, num_cpus: int | None = None) -> None:
    """Join the cluster at RAY_ADDRESS, or start a local one on 127.0.0.1. Idempotent."""
    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=NAMESPACE, logging_level="WARNING",
                 log_to_driver=False)
        return
    # On loopback: importing `actors` set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray was
    # imported (services/__init__.py); without it Ray binds the machine's interface address.
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False,
        _node_ip_address="127.0.0.1", namespace=NAMESPACE, logging_level="WARNING",
        log_to_driver=False,
    )


def disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()


#: how long joining RAY_ADDRESS may take to answer a TCP connect before it counts as unreachable
RAY_PROBE_TIMEOUT_S = 5.0


def connect_ray(settings: Settings) -> None:
    """Join RAY_ADDRESS, or start a local Ray (`connect`), blocking.

    Raises ConfigError naming RAY_ADDRESS when the cluster cannot be reached: Ray itself retries
    for minutes and then raises a RuntimeError with its connection traceback in the message.
    The address is tried with one TCP connect first so that an unreachable one fails in seconds.
    """
    address = settings.ray_address
    if address and not ray.is_initialized():
        _probe_ray_address(address)
    try:
        connect(settings)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
        if not address:
            raise
        raise _ray_unreachable(address, type(exc).__name__) from None


def _probe_ray_address(address: str) -> None:
    """A TCP connect to RAY_ADDRESS's host:port (ray://host:port too); `auto` and anything that is
    not host:port are left to Ray."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise _ray_unreachable(address, "its port is not a number") from None
    if not host or port is None:
        return
    try:
        socket.create_connection((host, port), timeout=RAY_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise _ray_unreachable(address, exc.strerror or type(exc).__name__) from None


def _ray_unreachable(address: str, why: str) -> ConfigError:
    return ConfigError(
        f"cannot connect to the Ray cluster at RAY_ADDRESS={address} ({why.lower()}); check that its head "
        "is running and the address is its GCS host:port (usually port 6379), or unset RAY_ADDRESS to "
        "start a local Ray",
        variable="RAY_ADDRESS",
    )
