"""One-shot commands print their report on stdout and nothing else (`chat-engine scale 4 | jq`):
their log lines go to stderr. Servers (run, serve) keep logging on stdout.

The commands run as subprocesses through the real `app.cli.main`; the Ray-side work of
`scale` and `restart-hosts` is replaced by a stand-in that logs as Placement.rescale does (a
structlog `info` line) and returns a report, so no Ray cluster is needed to see where each goes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STAND_IN = """
import sys
import structlog
import app.shards as shards

async def scale(settings, target):
    structlog.get_logger("actors.placement").info("rescaled", shards=target, moved=3)
    return {"shards": target, "moved": 3}

async def restart_hosts(settings):
    structlog.get_logger("actors.placement").info("session_host_restarted", host="h0")
    return ["h0"]

shards.scale, shards.restart_hosts = scale, restart_hosts
from app.cli import main
main(sys.argv[1:])
"""


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL", "RAY_"))}
    full_env.update({"CE_LOG_FORMAT": "json", "CE_LOG_LEVEL": "info", **env})
    return subprocess.run([sys.executable, "-c", STAND_IN, *args], env=full_env, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize(
    ("args", "report", "event"),
    [
        (("scale", "5"), {"shards": 5, "moved": 3}, "rescaled"),
        (("restart-hosts",), {"restarted": ["h0"]}, "session_host_restarted"),
    ],
)
def test_a_one_shot_command_prints_only_its_report_on_stdout_and_logs_on_stderr(args, report, event):
    result = run(*args)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == report  # the whole of stdout is the report: `| jq` reads it
    assert result.stdout.count("\n") == 1, result.stdout
    logged = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [entry["event"] for entry in logged] == [event]  # the log line is kept, on stderr

