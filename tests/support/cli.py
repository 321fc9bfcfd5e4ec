"""The CLI run as an operator runs it: a subprocess with only the environment a test gives it."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "app.cli"]


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL"))}
    full_env.update(env)
    return subprocess.run([*CLI, *args], env=full_env, capture_output=True, text=True, timeout=60, check=False)
