"""The dashboard's browser tests' common ground: Debian's headless chromium driven by Playwright.

- `browser` (module scope): one chromium for a test module; Playwright never downloads one here.
- `tab`: a fresh browser context (its own sessionStorage) on the stack's gateway, as `Page`.
- `open_page(browser, url, name)`: another such context, for a test that needs two people (an
  agent and a contact) in two tabs that share nothing.
- `needs_chromium`: the skip mark for a module when /usr/bin/chromium is missing.

Screenshots land in test-artifacts/dashboard/ (gitignored); each page also leaves a
`<name>-last.png` of where it stopped, pass or fail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

CHROMIUM = Path("/usr/bin/chromium")
#: what this machine needs: no sandbox as root, and no background traffic to a closed network
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
TIMEOUT_MS = 20_000

needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason=(
    "/usr/bin/chromium is missing: install Debian's chromium package (`make test` does: "
    "apt-get install -y chromium) to run the dashboard browser tests"))


@pytest_asyncio.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


class Page:
    """A browser tab on the gateway, with screenshots and a log of page errors (uncaught
    exceptions, CSP refusals) that the test asserts empty."""

    def __init__(self, page: Any, url: str, name: str) -> None:
        self.page = page
        self.url = url
        self.name = name
        self.errors: list[str] = []
        self._shots = 0
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        # a 4xx answer to fetch() is logged by Chrome as "Failed to load resource": expected here
        page.on("console", lambda m: self.errors.append(f"console: {m.text}")
                if m.type == "error" and not m.text.startswith("Failed to load resource") else None)

    async def shot(self, step: str) -> None:
        self._shots += 1
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=str(ARTIFACTS / f"{self.name}-{self._shots:02d}-{step}.png"), full_page=True)

    async def sign_in(self, key: str) -> None:
        from playwright.async_api import expect

        await self.page.goto(self.url + "/")
        await self.page.get_by_label("Tenant API key").fill(key)
        await self.page.get_by_role("button", name="Sign in").click()
        await expect(self.page.locator("#nav")).to_be_visible()

    async def go(self, hash_: str) -> None:
        await self.page.goto(f"{self.url}/#{hash_}")


@asynccontextmanager
async def open_page(browser: Any, url: str, name: str, **context_options: Any) -> AsyncIterator[Page]:
    """A new browser context with one page on the gateway at `url`; closed on exit, after a
    `<name>-last.png` screenshot."""
    from playwright.async_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    context = await browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **context_options})
    context.set_default_timeout(TIMEOUT_MS)
    page = Page(await context.new_page(), url, name)
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            await page.page.screenshot(path=str(ARTIFACTS / f"{page.name}-last.png"), full_page=True)
        finally:
            await context.close()


@pytest_asyncio.fixture
async def tab(browser, stack, request) -> AsyncIterator[Page]:
    async with open_page(browser, stack.gateway.url, request.node.name.removeprefix("test_")[:60]) as page:
        yield page
