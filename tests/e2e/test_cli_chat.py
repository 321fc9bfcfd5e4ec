"""`chat-engine chat` and `chat-engine contract` against the running stack, as a terminal user."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys


def run_cli(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CE_")}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


async def test_chat_streams_the_reply_and_shows_tool_calls_as_they_happen(stack):
    result = await asyncio.to_thread(run_cli, [
        "chat", "--url", stack.gateway.url, "--key", stack.demo_key, "--session", "cli-chat-1",
    ], "where is my order 12345?\nexit\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "[calling check_order]" in out and "[check_order ok" in out
    assert out.index("[calling check_order]") < out.index("Order 12345")


async def test_contract_prints_a_readable_report(stack):
    result = await asyncio.to_thread(run_cli, ["contract", "--url", stack.gateway.url, "--key", stack.demo_key])
    assert result.returncode == 0, result.stderr
    assert "tool contract for tenant" in result.stdout
    assert "check_order" in result.stdout and "search -> q" in " ".join(result.stdout.split())
