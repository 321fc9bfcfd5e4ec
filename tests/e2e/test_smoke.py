"""The demo conversation of README through the real stack: `make run`'s code path."""

from __future__ import annotations


async def test_demo_tenant_order_lookup_through_gateway_and_ray(stack, client):
    headers = {"Authorization": f"Bearer {stack.demo_key}"}
    async with client.post(f"{stack.gateway.url}/v1/sessions/smoke-1/messages", headers=headers,
                           json={"text": "where is my order 12345?"}) as r:
        body = await r.json()
        assert r.status == 200, body
    assert body["tool_calls"][0]["name"] == "check_order" and body["tool_calls"][0]["success"]
    assert "12345" in body["reply"] and "status" in body["reply"]
    assert body["rounds"] == 2


async def test_the_demo_tenant_is_offered_every_built_in(stack, client):
    from services.builtins import DEFINITIONS

    headers = {"Authorization": f"Bearer {stack.demo_key}"}
    async with client.get(f"{stack.gateway.url}/v1/tools/contract", headers=headers) as r:
        report = await r.json()
        assert r.status == 200, report
    offered = {t["name"] for t in report["tools"] if t["origin"] == "builtin" and t["offered"]}
    assert offered == {d.name for d in DEFINITIONS}


async def test_the_cli_finds_the_stack_through_demo_env_whatever_port_it_was_given(stack):
    # the stack was started on port 0: demo.env must name the port the gateway got, not 0
    import asyncio
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = Path(stack.settings.data_dir)
    assert (data / "demo.env").read_text().splitlines() == [f"CE_URL={stack.gateway.url}",
                                                             f"CE_API_KEY={stack.demo_key}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL"))}
    result = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", "contract"],
                                     env={**env, "CE_DATA_DIR": str(data)}, capture_output=True, text=True,
                                     timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "check_order" in result.stdout
