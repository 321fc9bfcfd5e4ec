"""Addresses on the test Postgres server."""

from __future__ import annotations

from urllib.parse import urlsplit


def database_url(url: str, database: str) -> str:
    """`url` pointing at another database on the same server."""
    return urlsplit(url)._replace(path=f"/{database}").geturl()
