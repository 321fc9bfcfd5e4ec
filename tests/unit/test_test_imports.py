"""No module under tests/ imports a test module (`test_*.py`) or a conftest.py: what tests share
lives in tests/support. Read with `ast`, so an import inside a function or through
`__import__`/`importlib.import_module` with a literal name counts too."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def is_forbidden(module: str) -> bool:
    """A test module or a conftest under tests/."""
    parts = module.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `path` (a file under the folder `root`, the `tests`
    package) imports, `from a import b` giving `a` and `a.b`."""
    package = list(path.relative_to(root.parent).parts[:-1])
    return imports_in(ast.parse(path.read_text(), filename=str(path)), package)


def imports_in(tree: ast.AST, package: list[str], offset: int = 0) -> list[tuple[int, str]]:
    """The imports of `tree`, and of any string in it that is Python with an import (a script
    run in a subprocess), at `offset` + their line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                script = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue
            found += imports_in(script, package, offset + node.lineno - 1)
            continue
        at = offset + getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [(at, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((at, base))
            found += [(at, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                found.append((at, node.args[0].value))
    return found


def offending_imports(root: Path, *, skip: Path | None = None) -> list[str]:
    offences = []
    for path in sorted(p for p in root.rglob("*.py") if p != skip):
        for line, module in imported_modules(path, root):
            if is_forbidden(module):
                offences.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return offences


def test_no_module_under_tests_imports_a_test_module_or_a_conftest():
    offences = offending_imports(TESTS, skip=Path(__file__).resolve())  # this file's examples offend on purpose
    assert offences == [], "move what is shared to tests/support:\n" + "\n".join(offences)


@pytest.mark.parametrize(("source", "offence"), [
    ("from tests.unit.test_session_loop import ScriptedLLM\n", "tests.unit.test_session_loop"),
    ("from tests.integration import test_openapi_statuses\n", "tests.integration.test_openapi_statuses"),
    ("import tests.e2e.test_mcp as m\n", "tests.e2e.test_mcp"),
    ("def f():\n    from .test_host import World\n", "tests.unit.test_host"),
    ("from . import test_host\n", "tests.unit.test_host"),
    ("from tests.conftest import database_url\n", "tests.conftest"),
    ("m = __import__('tests.unit.test_tracing')\n", "tests.unit.test_tracing"),
    ("import importlib\nm = importlib.import_module('tests.unit.test_host')\n", "tests.unit.test_host"),
    ("from tests import conftest\n", "tests.conftest"),
    ("SCRIPT = '''\n    import sys\n    from tests.unit.test_session_loop import ScriptedLLM\n'''\n",
     "tests.unit.test_session_loop"),
], ids=["from-module", "from-package", "import-as", "relative-in-function", "relative-package", "conftest",
        "__import__", "import_module", "conftest-from-package", "in-a-script"])
def test_the_check_names_each_kind_of_offending_import(tmp_path, source, offence):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_x.py").write_text(source)
    found = offending_imports(tmp_path / "tests")
    assert len(found) == 1 and found[0].startswith("tests/unit/test_x.py:") and found[0].endswith(f"imports {offence}")


@pytest.mark.parametrize("source", [
    "from tests.support.fakes import FakeClock\n",
    "from tests.support import fakes\n",
    "import tests.support.e2e\n",
    "from services.tools import test_data\n",  # not under tests/
], ids=["from-support-module", "from-support-package", "import-support", "outside-tests"])
def test_the_check_lets_imports_of_tests_support_and_of_the_code_pass(tmp_path, source):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_x.py").write_text(source)
    assert offending_imports(tmp_path / "tests") == []
