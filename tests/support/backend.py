"""A tenant's backend for e2e tests: an aiohttp server on a loopback address that records requests.

Bound to 127.0.0.2 it is inside the stack's webhook allowlist (as the demo store is); bound to
127.0.0.3 it is a loopback address the SSRF guard refuses, so it serves as a canary: any request
it records is a request the guard should have stopped. Either way nothing leaves the machine.

Paths: `/slow/...` answers after `delay_s` (or when `release` is set); `/redirect/...?to=URL`
answers 302 to URL; `/fail500/...` and `/fail401/...` fail echoing the Authorization header;
anything else answers 200 with a small JSON body.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web


class Backend:
    def __init__(self, host: str = "127.0.0.2", *, delay_s: float = 0.0) -> None:
        self.host = host
        self.delay_s = delay_s
        self.release: asyncio.Event | None = None
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Backend:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.text()
            self.requests.append({"method": request.method, "path": request.path_qs,
                                  "headers": dict(request.headers), "body": body})
            what = request.match_info["what"]
            auth = request.headers.get("Authorization", "")
            if what == "slow":
                if self.release is not None:
                    await self.release.wait()
                else:
                    await asyncio.sleep(self.delay_s)
            if what == "redirect":
                return web.Response(status=302, headers={"Location": request.query["to"]})
            if what == "fail500":
                return web.Response(status=500, text=f"broken; you sent {auth}")
            if what == "fail401":
                return web.json_response({"error": f"bad credentials {auth}"}, status=401)
            return web.json_response({"ok": True, "path": request.path})

        app = web.Application()
        app.router.add_route("*", "/{what}", handle)
        app.router.add_route("*", "/{what}/{rest:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0).start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.release is not None:
            self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
