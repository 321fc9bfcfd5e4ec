"""Pieces of the tool-contract report tests: a backend binding tool to vary (`binding`) and a
tool backend the report never calls (`NullBackend`)."""

from __future__ import annotations

from services.contacts import ContactVerification
from services.tools.model import BackendBindingTool

SEARCH_PARAMS = {"type": "object", "properties": {"search": {"type": "string"}, "limit": {"type": "integer"}},
                 "required": ["search"]}


def binding(**overrides) -> BackendBindingTool:
    base = {"name": "example_catalog_search", "description": "search", "parameters": SEARCH_PARAMS,
            "method": "GET", "path": "/example/catalog", "parameter_map": {"search": "q", "limit": "per_page"},
            "scope": ("account_id",)}
    base.update(overrides)
    return BackendBindingTool(**base)


class NullBackend:
    async def call_webhook(self, *a, **k):  # pragma: no cover - never called by the report
        raise AssertionError

    async def call_binding(self, *a, **k):  # pragma: no cover
        raise AssertionError


#: a tenant whose verified contacts carry their account (the `sub` of their token): what fills
#: the seed binding's `account_id` (an anonymous session has none)
ACCOUNT_CLAIMS = ContactVerification(algorithms=("HS256",), scope_claims={"account_id": "sub"})
