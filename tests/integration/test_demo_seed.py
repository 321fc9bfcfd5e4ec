"""The demo tenant is seeded once: `make run` again (app.stack.seed_demo_tenant on every start)
keeps what the tenant changed since, with the real Postgres repositories."""

from __future__ import annotations

import pytest_asyncio

from app.stack import seed_demo_tenant
from services.settings import Settings
from services.tools.crypto import generate_key
from storage.pool import create_pool
from storage.repos import BotConfigRepo, TenantRepo, ToolRepo
from storage.repos.builtins import BuiltinRepos

STORE = "http://127.0.0.2:8090"


@pytest_asyncio.fixture
async def demo_db(fresh_db):
    pool = await create_pool(await fresh_db(), min_size=1, max_size=4)  # its own: one `demo` tenant
    try:
        yield pool
    finally:
        await pool.close()


async def test_a_restart_keeps_the_demo_tenants_own_persona_tools_and_form(demo_db, tmp_path):
    pool = demo_db
    settings = Settings(secret_keys=(generate_key(),))
    key = await seed_demo_tenant(pool, settings, STORE, tmp_path)
    (tmp_path / "demo.env").write_text(f"CE_URL=http://127.0.0.1:1\nCE_API_KEY={key}\n")
    tenant = await TenantRepo(pool).tenant_for_key(key)
    assert tenant is not None
    configs, tools, builtins = BotConfigRepo(pool), ToolRepo(pool), BuiltinRepos(pool)
    seeded = await configs.get(tenant.id)
    assert "Demo Store" in seeded["persona"]  # the first start seeds it

    # the tenant makes the demo its own: PUT /v1/bot-config, PATCH /v1/tools/check_order, a form
    mine = {**seeded, "persona": "You are Captain Pirate. Answer in rhymes."}
    await configs.put(tenant.id, mine)
    order = (await tools.get(tenant.id, "check_order")).definition
    await tools.new_version(tenant.id, "check_order", {**order, "description": "Find my order, matey."},
                            publish=True)
    contact = {"type": "object", "required": ["email"], "additionalProperties": False,
               "properties": {"email": {"type": "string", "minLength": 3}}}
    from services.builtins.forms import check_form

    await builtins.forms.put(tenant.id, "contact", check_form("contact", contact))
    versions_before = len(await tools.versions(tenant.id, "check_order"))

    assert await seed_demo_tenant(pool, settings, STORE, tmp_path) == key  # the restart

    assert await configs.get(tenant.id) == mine
    assert (await tools.get(tenant.id, "check_order")).definition["description"] == "Find my order, matey."
    assert len(await tools.versions(tenant.id, "check_order")) == versions_before  # no version added
    assert (await builtins.forms.get(tenant.id, "contact")).schema["required"] == ["email"]


async def test_a_demo_tool_the_tenant_lacks_is_seeded_again_and_nothing_else_changes(demo_db, tmp_path):
    pool = demo_db
    settings = Settings(secret_keys=(generate_key(),))
    key = await seed_demo_tenant(pool, settings, STORE, tmp_path)
    (tmp_path / "demo.env").write_text(f"CE_API_KEY={key}\n")
    tenant = await TenantRepo(pool).tenant_for_key(key)
    tools = ToolRepo(pool)
    await tools.delete(tenant.id, "example_catalog_search")
    config = await BotConfigRepo(pool).get(tenant.id)

    await seed_demo_tenant(pool, settings, STORE, tmp_path)

    assert (await tools.get(tenant.id, "example_catalog_search")).definition["name"] == "example_catalog_search"
    assert await BotConfigRepo(pool).get(tenant.id) == config


async def test_when_the_demo_store_takes_another_port_what_points_at_it_follows(demo_db, tmp_path):
    # port 8090 taken on a later start: the demo store falls back to a free port (app.stack)
    pool = demo_db
    settings = Settings(secret_keys=(generate_key(),))
    key = await seed_demo_tenant(pool, settings, STORE, tmp_path)
    (tmp_path / "demo.env").write_text(f"CE_API_KEY={key}\n")
    tenant = await TenantRepo(pool).tenant_for_key(key)
    tools, configs = ToolRepo(pool), BotConfigRepo(pool)
    order = await tools.get(tenant.id, "check_order")
    await tools.new_version(tenant.id, "check_order", {**order.definition, "description": "Find my order, matey."},
                            publish=True)
    await tools.set_enabled(tenant.id, "check_order", False)
    persona = {**await configs.get(tenant.id), "persona": "You are Captain Pirate."}
    await configs.put(tenant.id, persona)

    await seed_demo_tenant(pool, settings, "http://127.0.0.2:41234", tmp_path)

    moved = await tools.get(tenant.id, "check_order")
    assert moved.definition["webhook_url"] == "http://127.0.0.2:41234/api/orders/{order_id}"
    assert moved.definition["description"] == "Find my order, matey." and moved.enabled is False  # theirs, kept
    config = await configs.get(tenant.id)
    assert config["backend"]["base_url"] == "http://127.0.0.2:41234"
    assert config["persona"] == "You are Captain Pirate."
    await seed_demo_tenant(pool, settings, "http://127.0.0.2:41234", tmp_path)  # same port again: nothing new
    assert (await tools.get(tenant.id, "check_order")).version == moved.version
