"""The Makefile's choice of Python (`make python`, which `make setup` runs first): PYTHON= when
given, otherwise the newest supported one that runs; it says which, or what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


# What a make running these tests hands its children (`make test-core PYTHON=... VENV=...` puts
# both in MAKEFLAGS, and a child make would take them as given on its own command line).
INHERITED = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHON", "VENV"}


def make_python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "python", *args],
                          capture_output=True, text=True, timeout=60, check=False, env=env)


def test_the_python_given_is_used_and_named() -> None:
    done = make_python(f"PYTHON={sys.executable}")
    version = ".".join(map(str, sys.version_info[:3]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"using {sys.executable} (Python {version}) for .venv"


def test_no_supported_python_found_says_what_to_install() -> None:
    done = make_python("PY_CANDIDATES=python-none-such")
    assert done.returncode != 0
    assert "no supported Python found (3.11, 3.12 or 3.13; tried python-none-such)" in done.stderr
    assert "PYTHON=/path/to/python3.13" in done.stderr


def test_a_python_that_does_not_run_is_refused_naming_the_supported_ones() -> None:
    done = make_python("PYTHON=/nonexistent/python3.13")
    assert done.returncode != 0
    assert "supported are Python 3.11, 3.12 and 3.13" in done.stderr


def test_without_python_given_a_supported_one_is_chosen() -> None:
    done = make_python()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("using python3") and "(Python 3.1" in done.stdout
