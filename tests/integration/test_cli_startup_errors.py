"""Start-up failures an operator meets are one sentence and exit status 2 (app/cli.py's
promise), not a traceback: a taken CE_PORT, an unreachable RAY_ADDRESS. Loopback only."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "app.cli"]


def run_cli(*args: str, env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL", "RAY_"))}
    full_env.update(env)
    return subprocess.run([*CLI, *args], env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def one_sentence(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("chat-engine:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_run_on_a_taken_port_says_so_naming_ce_host_and_ce_port_before_starting_anything(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = run_cli("run", env={"CE_DATA_DIR": str(tmp_path), "CE_HOST": "127.0.0.1", "CE_PORT": str(port)})
    line = one_sentence(result)
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in line
    assert "CE_HOST/CE_PORT" in line
    assert time.monotonic() - started < 20  # checked first: no Postgres, Ray or hosts were started
    assert not (tmp_path / "pg").exists() and not any(tmp_path.iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [("serve",), ("scale", "3"), ("restart-hosts",)])
async def test_an_unreachable_ray_address_is_one_sentence_naming_it(fresh_db, command):
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    env = {"DATABASE_URL": await fresh_db(), "RAY_ADDRESS": address, "CE_PORT": "0"}
    result = await asyncio.to_thread(run_cli, *command, env=env, timeout=60)
    line = one_sentence(result)
    assert f"cannot connect to the Ray cluster at RAY_ADDRESS={address}" in line
    assert "unset RAY_ADDRESS to start a local Ray" in line
