"""The chat engine's services.

Importing this package keeps a local Ray (one this process starts, no RAY_ADDRESS) on loopback.
Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported; unset, it binds
the machine's interface address (docs/architecture.md, practical notes). Set here, before any module
of ours imports ray, it also reaches the processes that Ray starts (they inherit the environment).
A process that joins a cluster (RAY_ADDRESS set) is left alone: its node address must be real.

Ray also starts its worker processes (our session hosts among them) at niceness 15, its
`worker_niceness`: on a busy node every other process (Postgres, the gateway, Ray's own daemons)
then runs ahead of the hosts, the engine's hot path. A local Ray gets `RAY_worker_niceness=0`
here; the image sets it for the nodes of a cluster (deploy/Dockerfile), and a host that still
finds itself niced lowers it if it may (actors/ray_host.py).
"""

import os

if (os.environ.get("RAY_ADDRESS") or "").strip() in ("", "local"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")
