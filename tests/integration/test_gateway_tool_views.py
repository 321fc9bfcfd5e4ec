"""A tenant's tool views (POST/GET/PATCH /v1/tools, versions): what the tenant can set, shown as
set or null, and nothing of the engine's own (`idempotency_arguments`, a built-ins' setting that
no tool body can carry). A real aiohttp server on loopback over real Postgres repositories."""

from __future__ import annotations

from services.gateway.bodies import ToolCreate
from tests.support import gateways

gateway = gateways.scripted_gateway  # the fixture

#: what a view adds to the definition a tenant sent
VIEW_EXTRAS = {"auth_header_set", "version", "published", "based_on_version", "created_at", "updated_at"}
TOOL = {"name": "order_status", "description": "Look up an order by its number.",
        "webhook_url": "https://example.com/orders/{order_id}", "parameters": {"order_id": {"type": "string"}}}


async def test_a_tenants_tool_views_show_what_the_tenant_can_set_and_no_unset_engine_field(gateway):
    client, _router, headers = gateway
    created = await client.post("/v1/tools", headers=headers, json=TOOL)
    assert created.status == 201, await created.text()
    patched = await client.patch("/v1/tools/order_status", headers=headers, json={"timeout_ms": 3000})
    assert patched.status == 200, await patched.text()
    one = await client.get("/v1/tools/order_status", headers=headers)
    listed = await client.get("/v1/tools", headers=headers)
    versions = await client.get("/v1/tools/order_status/versions", headers=headers)
    assert (one.status, listed.status, versions.status) == (200, 200, 200)
    views = [await created.json(), await patched.json(), await one.json(), *(await listed.json())["tools"],
             *(await versions.json())["versions"]]
    for view in views:
        # before, every view carried `"idempotency_arguments": null`: a field no tool body accepts
        assert "idempotency_arguments" not in view
        # each field of the view is one the tenant can send back (ToolCreate), or the view's own
        assert set(view) - VIEW_EXTRAS <= set(ToolCreate.__struct_fields__), set(view) - VIEW_EXTRAS
        # as every optional field a tenant can set but did not: shown, as null
        assert view["completes_variable"] is None and view["output_schema"] is None
