"""Repositories: typed access to every table the engine owns (asyncpg stays inside storage/).

Each repository takes the pool; every method taking a `tenant_id` scopes all its SQL by it, so
one tenant can never read or change another's rows through these functions.
"""

from storage.repos.botconfig import BotConfigRepo
from storage.repos.calls import ToolCallRepo
from storage.repos.sessions import SessionRepo
from storage.repos.tenants import TenantRepo, hash_api_key
from storage.repos.tools import CATALOG_CHANNEL, CatalogListener, ToolRepo, listen_catalog

__all__ = [
    "CATALOG_CHANNEL",
    "BotConfigRepo",
    "CatalogListener",
    "SessionRepo",
    "TenantRepo",
    "ToolCallRepo",
    "ToolRepo",
    "hash_api_key",
    "listen_catalog",
]
