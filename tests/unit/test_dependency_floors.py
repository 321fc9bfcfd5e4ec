"""Dependency floors past known advisories: the project never admits an affected release, and the
one installed meets the floor."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

#: package -> (the newest release with a known advisory that concerns this engine, the floor past it)
FLOORS = {"aiohttp": ("3.13.2", "3.13.3")}  # decompression bombs in the HTTP parser and client


def test_the_declared_floor_excludes_every_release_with_a_known_advisory():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = {r.name: r for r in map(Requirement, project["project"]["dependencies"])}
    for name, (affected, floor) in FLOORS.items():
        specifier = declared[name].specifier
        assert not specifier.contains(affected) and specifier.contains(floor), (name, specifier)
        assert Version(version(name)) >= Version(floor), name
