"""Session actors: the pure session code, its host, and their Ray shells."""

import services  # noqa: F401 - first, so that a local Ray stays on loopback (see services/__init__.py)
