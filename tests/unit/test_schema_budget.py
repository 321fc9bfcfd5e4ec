"""Schema work has a budget (issue 39): a tenant's schema is measured before anything reads it,
checked once per content, and checked (with the values it governs) off the event loop when it is
large. The worker process is real (services.offload); nothing here times anything: where work
ran is shown by what ran in this process and what did not."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from kernel.errors import InvalidInput, Overloaded
from services import offload
from services.tools import validation
from services.tools.validation import (
    INLINE_NODES,
    INLINE_STEPS,
    MAX_CHECK_STEPS,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_NODES,
    ArgumentValidator,
    check_any_schema,
    check_schema,
    schemas_checked,
    validator_for,
)
from tests.support.offload_spy import spy_on_offload


def wide(properties: int, **extra) -> dict:
    """An object schema of `properties` string properties (more than INLINE_NODES: off the loop)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20, **extra}
                                             for i in range(properties)}}


#: a wide anyOf over every item of a list: each item costs 200 keyword checks
HEAVY_OUTPUT = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "anyOf": [{"type": "object", "required": [f"y{i}"]} for i in range(200)]}}}}


@pytest.fixture
def nothing_checked_here(monkeypatch):
    """A schema's check (the dialect's and the engine's) never runs in this process."""

    def refuse(*args, **kwargs):
        raise AssertionError("the schema was checked in the serving process")

    monkeypatch.setattr(validation, "_check", refuse)


@pytest.fixture
def nothing_offloaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("work was sent to the worker process")

    monkeypatch.setattr(offload, "run", refuse)


@pytest.fixture
def offloaded(monkeypatch) -> list[str]:
    """The names of the functions sent to the (real) worker process."""
    return spy_on_offload(monkeypatch)


# -- measured before anything reads it ---------------------------------------------------------------


def test_a_schema_over_the_byte_budget_is_refused_before_any_check(nothing_checked_here):
    # the issue's probe: a 240 KB anyOf of `{}` took 12.5 s in the dialect's check before any cap applied
    giant = {"type": "object", "properties": {"a": {"anyOf": [{}] * 60_000}}}
    with pytest.raises(InvalidInput, match=rf"JSON, more than the {MAX_SCHEMA_BYTES:,} allowed.*at `\$.parameters`"):
        check_schema(giant)


def test_a_schema_over_the_subschema_budget_is_refused_before_any_check(nothing_checked_here):
    small_but_many = {"type": "object", "properties": {"a": {"anyOf": [{}] * MAX_SCHEMA_NODES}}}  # ~3 KB
    with pytest.raises(InvalidInput, match=rf"more than {MAX_SCHEMA_NODES:,} subschemas.*at `\$.output_schema`"):
        check_any_schema(small_but_many, where="$.output_schema")


def test_a_schema_at_the_budget_is_checked():
    check_schema({"type": "object", "properties": {"a": {"anyOf": [{}] * (MAX_SCHEMA_NODES - 3)}}})


# -- checked once per content -------------------------------------------------------------------------


def test_a_schema_is_checked_once_whatever_its_key_order(monkeypatch):
    real, calls = validation.schema_verdict, []

    def counted(*args):
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(validation, "schema_verdict", counted)
    schema = {"type": "object", "properties": {"once_only": {"type": "integer", "minimum": 3}}}
    check_schema(schema)
    check_schema(dict(reversed(list(schema.items()))))  # the same content
    assert calls == ["$.parameters"]
    bad = {"type": "object", "properties": {"once_bad": {"type": "strin"}}}
    for _ in range(2):  # a refusal is kept too, and said again the same way
        with pytest.raises(InvalidInput, match=r"at `\$.parameters.properties.once_bad.type`"):
            check_schema(bad)
    assert calls == ["$.parameters", "$.parameters"]


def test_a_validator_is_made_once_per_schema_content():
    a = validator_for({"type": "object", "properties": {"v": {"type": "string"}}}, sensitive=("v",))
    b = validator_for({"properties": {"v": {"type": "string"}}, "type": "object"}, sensitive=("v",))
    assert a is b
    assert validator_for({"type": "object", "properties": {"v": {"type": "string"}}}) is not a  # other names hidden


# -- large schemas off the event loop ---------------------------------------------------------------------


async def test_a_small_schema_is_checked_here_without_the_worker(nothing_offloaded):
    await schemas_checked(check_schema, wide(INLINE_NODES - 2))


async def test_a_large_schema_is_checked_in_the_worker_and_its_verdict_kept(monkeypatch, offloaded):
    monkeypatch.setattr(validation, "_check", _refused_here)
    schema = wide(40, minLength=1)
    await schemas_checked(check_schema, schema)
    assert offloaded == ["schema_verdicts"]
    await schemas_checked(check_schema, schema)  # kept: the worker is not asked again
    check_schema(schema)  # nor checked here
    assert offloaded == ["schema_verdicts"]


async def test_a_large_schema_the_worker_refuses_is_a_422_naming_the_place(monkeypatch, offloaded):
    monkeypatch.setattr(validation, "_check", _refused_here)
    schema = wide(40)
    schema["properties"]["p7"] = {"type": "strin"}
    with pytest.raises(InvalidInput, match=r"invalid JSON schema.*at `\$.properties.p7.type`") as refused:
        await schemas_checked(check_schema, schema, where="$", checked_formats_only=True)
    assert refused.value.path == "$.properties.p7.type"
    assert offloaded == ["schema_verdicts"]


async def test_every_large_schema_of_one_build_goes_to_the_worker_in_one_pass(monkeypatch, offloaded):
    monkeypatch.setattr(validation, "_check", _refused_here)
    builds = []

    def build():  # what a tool's definition or a catalog does: several checks, then a result
        builds.append(1)
        check_schema(wide(30, minLength=2))
        check_any_schema(wide(31, minLength=2), where="$.output_schema")
        return "built"

    assert await schemas_checked(build) == "built"
    assert offloaded == ["schema_verdicts"] and len(builds) == 1  # both in one task; all usable: built once


async def test_a_catalog_of_many_large_schemas_is_checked_in_bounded_tasks_and_built_twice_at_most(
        monkeypatch, offloaded):
    monkeypatch.setattr(validation, "_check", _refused_here)
    monkeypatch.setattr(validation, "_NODES_PER_TASK", 100)  # about 2 schemas of 42 subschemas a task
    schemas = [wide(40, minLength=3 + i) for i in range(7)]
    schemas[5]["properties"]["p1"] = {"type": "strin"}
    builds, refused = [], []

    def build():  # a catalog: one tool's refusal is that tool's problem, the rest load
        builds.append(1)
        for i, schema in enumerate(schemas):
            try:
                check_schema(schema, where=f"$.tools[{i}]")
            except InvalidInput as exc:
                refused.append(exc.path)
        return len(schemas) - len(refused)

    assert await schemas_checked(build) == 6
    assert len(offloaded) == 4 and len(builds) == 2  # 7 schemas in tasks of two; built again for the refusal
    assert refused == ["$.tools[5].properties.p1.type"]


def _refused_here(*args):
    raise AssertionError("a large schema was checked in the serving process")


# -- values: a few ms here, the rest in the worker, all within an absolute budget ------------------------


async def test_a_value_within_the_inline_budget_is_checked_here(nothing_offloaded):
    validator = ArgumentValidator(HEAVY_OUTPUT, subject="result")
    assert await validator.problems({"items": [{"y3": 1}]}) == []
    assert INLINE_STEPS >= 200


async def test_a_value_past_the_inline_budget_is_checked_in_the_worker(offloaded):
    rows = {f"p{i}": "x" for i in range(10)}
    schema = {"type": "object", "properties": {"rows": {"type": "array", "items": wide(10)}}}
    validator = ArgumentValidator(schema, subject="result")
    value = {"rows": [rows] * 200 + [{**rows, "p3": "y" * 21}]}
    assert await validator.problems(value) == validator.errors(value) == [
        "'rows.200.p3': 'yyyyyyyyyyyyyyyyyyyyy' is too long"]
    assert offloaded == ["value_problems"]


async def test_a_heavy_output_check_stops_at_the_absolute_budget_in_band(offloaded):
    # the issue's probe: a wide anyOf over a 40 KB upstream array held a host's loop for ~10 s
    validator = ArgumentValidator(HEAVY_OUTPUT, subject="result")
    [problem] = await validator.problems({"items": [{"x": "a"}] * 4000})
    assert problem.startswith(f"checking the result took more than {MAX_CHECK_STEPS:,} steps")
    assert offloaded == ["value_problems"]


async def test_a_busy_worker_is_an_in_band_problem_not_an_exception(monkeypatch):
    monkeypatch.setattr(offload, "MAX_PENDING", 0)
    validator = ArgumentValidator(HEAVY_OUTPUT, subject="result")
    assert await validator.problems({"items": [{"x": "a"}] * 10}) == [
        "the result could not be checked: this host is busy checking others; try again in a moment"]


# -- the worker itself ---------------------------------------------------------------------------------


async def test_a_task_past_its_deadline_is_stopped_and_the_worker_replaced():
    with pytest.raises(offload.NotFinished, match="past its 0.5 s deadline"):
        await offload.run(time.sleep, 60, deadline_s=0.5)
    assert await offload.run(sum, [1, 2, 3]) == 6  # a new worker took its place


async def test_past_its_limit_of_tasks_in_hand_the_worker_refuses_with_a_retry(monkeypatch):
    monkeypatch.setattr(offload, "MAX_PENDING", 0)
    with pytest.raises(Overloaded) as refused:
        await offload.run(sum, [1])
    assert refused.value.status == 503 and refused.value.retry_after > 0


async def test_arguments_that_cannot_be_sent_to_the_worker_fail_at_once_not_never():
    # pebble pickles in its own thread: a value too deep to pickle there was lost, and its caller
    # waited for ever
    deep: dict = {}
    node = deep
    for _ in range(5_000):
        node["a"] = node = {}
    with pytest.raises(offload.NotFinished, match=r"could not be sent to the worker \(RecursionError\)"):
        await offload.run(len, deep)
    assert await offload.run(len, [1, 2]) == 2


def _thread_niceness() -> dict[int, int]:
    """This process's threads and their niceness (field 19 of /proc/self/task/<tid>/stat)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            out[int(task.name)] = int(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16])
    return out


async def test_the_worker_and_the_threads_that_start_it_run_at_lower_priority_from_the_start():
    offload.shutdown()  # a worker of its own, started by this test
    try:
        assert await offload.run(os.getpriority, os.PRIO_PROCESS, 0) == offload.NICE
        threads = _thread_niceness()
        assert threads[threading.get_native_id()] == 0  # this thread keeps its own
        # the pool's threads, started by a thread at NICE: the worker is a process they start
        # (again after a kill), so it runs at NICE from its first instruction, its imports too
        assert offload.NICE in threads.values()
    finally:
        offload.shutdown()
