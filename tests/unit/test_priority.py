"""actors.ray_host.normal_priority: a host Ray started niced runs at niceness 0 when it may."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, threading
os.nice(15)                       # as Ray starts its workers
threading.Thread(target=lambda: __import__("time").sleep(5), daemon=True).start()  # a thread from before
from actors.ray_host import normal_priority
print(normal_priority(), sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root (CI runs as root)")
def test_a_niced_host_process_lowers_every_thread_to_zero():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.split() == ["0", "[0]"], out


def test_without_the_right_to_lower_it_the_host_says_so_and_runs_on(monkeypatch):
    import structlog

    from actors import ray_host

    def refused(*_args):
        raise PermissionError("not permitted")

    monkeypatch.setattr(ray_host.os, "getpriority", lambda *_args: 15)
    monkeypatch.setattr(ray_host.os, "setpriority", refused)
    with structlog.testing.capture_logs() as logs:
        assert ray_host.normal_priority() == 15
    assert [e["event"] for e in logs] == ["session_host_niced"]
    assert logs[0]["niceness"] == 15 and "RAY_worker_niceness=0" in logs[0]["fix"]
