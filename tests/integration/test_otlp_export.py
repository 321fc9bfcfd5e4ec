"""With CE_OTLP_ENDPOINT configured, a process exports its turn traces over OTLP/HTTP (loopback)."""

from __future__ import annotations

import asyncio
import sys
import textwrap

from aiohttp import web

SCRIPT = textwrap.dedent('''
    import asyncio, sys
    from services.tracing import configure_tracing
    from actors.session import TurnEnv, handle_message, new_state
    from services.botconfig import BotConfig
    from services.tools.executor import Executor
    from services.tools.registry import HandlerRegistry, build_catalog
    from tests.support.turns import ScriptedLLM

    provider = configure_tracing(sys.argv[1], service_name="otlp-test")
    env = TurnEnv(llm=ScriptedLLM(["hello"]), executor=Executor(), main_model="m", cheap_model="c",
                  catalog=build_catalog([], [], registry=HandlerRegistry(), backend=None), config=BotConfig())
    asyncio.run(handle_message(new_state("t", "s"), "hi", "m1", env))
    provider.shutdown()
''')


async def test_turn_spans_are_exported_to_the_configured_otlp_endpoint():
    received: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SCRIPT, url,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        await runner.cleanup()
    body = b"".join(received)
    assert b"turn" in body and b"round" in body and b"otlp-test" in body
