"""Where schema work ran, without timing anything: the functions sent to the real worker process."""

from __future__ import annotations

from typing import Any

from services import offload


def spy_on_offload(monkeypatch: Any) -> list[str]:
    """The names of the functions sent to the (real) worker process from now on, in order."""
    sent: list[str] = []
    real = offload.run

    async def spy(fn, *args, **kwargs):
        sent.append(fn.__name__)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(offload, "run", spy)
    return sent
