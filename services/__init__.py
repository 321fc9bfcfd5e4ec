"""The chat engine's services.

Importing this package keeps a local Ray (one this process starts, no RAY_ADDRESS) on loopback.
Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported; unset, it binds
the machine's interface address (ARCHITECTURE.md, practical notes). Set here, before any module
of ours imports ray, it also reaches the processes that Ray starts (they inherit the environment).
A process that joins a cluster (RAY_ADDRESS set) is left alone: its node address must be real.
"""

import os

if (os.environ.get("RAY_ADDRESS") or "").strip() in ("", "local"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
