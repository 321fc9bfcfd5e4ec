"""Connecting this process to Ray: join RAY_ADDRESS, or start a local Ray bound to loopback."""

from __future__ import annotations

import os

import ray

from actors.placement import NAMESPACE
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
