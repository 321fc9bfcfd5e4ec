"""Argument validation against a tool's JSON schema, with errors the model can act on.

The schema itself is checked when a definition is saved (`check_schema`), so a broken schema is
a 422 for the tenant admin, never a crash in a contact's session.

`format` is checked (not only an annotation) for every format JSON Schema 2020-12 defines, in
any dialect (`_format_checker`; the checks of date-time, uri, hostname, duration... come with
jsonschema's `format-nongpl` extra, a dependency of the project). A schema naming one of them
that this host could not check is refused when saved. Any other format name (`phone`, or an MCP
server's `binary`, `int64`, `password`) is an annotation, as JSON Schema says unknown formats
are: it is not checked, unless the caller asks for checked formats only (`checked_formats_only`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import jsonschema
import msgspec
import re2
import referencing
import referencing.exceptions
import referencing.jsonschema
import structlog
from cachetools import LRUCache
from jsonschema.exceptions import SchemaError, ValidationError

from kernel.errors import InvalidInput, Overloaded
from services import offload
from services.tools.redaction import secret_name

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: a schema larger than this (encoded as JSON) is refused before anything reads it
MAX_SCHEMA_BYTES = 64 * 1024
#: a schema with more subschemas (objects, at any depth) than this is refused before anything
#: reads it further: the dialect's own check costs about 0.3 ms per subschema (a 240 KB `anyOf`
#: of `{}` took 12 s), so this bounds it at about 0.3 s, which runs off the loop (INLINE_NODES)
MAX_SCHEMA_NODES = 1_000
#: a schema of at most this many subschemas is checked on the event loop (about 4 ms); a larger
#: one in the worker process (services.offload) when a caller can wait for it (`schemas_checked`)
INLINE_NODES = 12

#: deeper than this a schema is refused when saved (and the checker's recursion never reached)
MAX_SCHEMA_DEPTH = 64
#: the most subschemas checking one value may visit with its `$ref`s unfolded (each counted where
#: it is used): a 2 KB schema whose `$defs` each use the one before twice unfolds to 2^n, and
#: checking a call against it would hold the session host's loop for hours
MAX_SCHEMA_EXPANSION = 10_000
#: the keyword checks one value's check may run in all (1 to 10 µs each: up to about 1 s, in the
#: worker process), whatever the value's size: past it the check stops with an in-band problem.
#: A schema that refers to itself twice per level (`allOf` of two `{"properties": {"a": {"$ref":
#: "#"}}}`) doubles with each level of the value, and a wide `anyOf` over a long upstream array
#: multiplies, which no count of the schema alone can see
MAX_CHECK_STEPS = 100_000
#: the keyword checks tried on the event loop first (a few ms at worst): nearly every value needs
#: far fewer; one that needs more is checked again in the worker (`ArgumentValidator.problems`)
INLINE_STEPS = 500
#: keywords whose values are data, not schemas: never searched for refs or patterns
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
#: keywords whose values map names to schemas: the names are not keywords (a property may be
#: called `default`, `enum` or `$ref`), the values are schemas
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas", "patternProperties"})
#: keywords that name or find a schema resource: jsonschema and referencing call string methods
#: on them (a `"$id": 5` was an AttributeError, a 500 for the admin), so they must be strings
_STRING_KEYWORDS = ("$schema", "$id", "$anchor", "$dynamicAnchor", "$ref", "$dynamicRef", "$recursiveRef")
#: dialects in which `id` (not `$id`) names a resource, and so must be a string too
_LEGACY_ID_DIALECTS = frozenset({
    "http://json-schema.org/draft-03/schema", "http://json-schema.org/draft-04/schema",
})
#: the formats JSON Schema 2020-12 defines (section 7.3 of its validation vocabulary): every one
#: is checked in a value, whatever the schema's dialect; a schema naming one this host cannot
#: check (an optional library missing) is refused when saved
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex",
})
_UNCHECKABLE = ("the schema cannot be read, so the value cannot be checked: a keyword holds a value of a type it "
                "cannot have; the business has to fix the schema")
_UNREADABLE = ("the schema cannot be read: a keyword holds a value of a type it cannot have (look at `$schema`, "
               "`$id`, `$anchor` and `$ref`, which must be strings) - at `{where}`")

_ENDLESS = "the arguments nest too deeply, or the schema refers to itself without end: they cannot be checked"
_TOO_MUCH = ("checking the {subject} took more than {steps:,} steps, so it was stopped: the value is too large "
             "for its schema (a wide anyOf over a long list, or a schema that refers to itself more than once per "
             "level); send a smaller or less deeply nested value, or simplify the tool's schema")
_TOO_SLOW = "checking the {subject} took too long ({why}), so it was not accepted; send a smaller value"
_BUSY = "the {subject} could not be checked: this host is busy checking others; try again in a moment"
#: the steps left to the check running now (None outside ArgumentValidator.errors)
_steps_left: ContextVar[list[int] | None] = ContextVar("schema_steps_left", default=None)


class _TooMuchWork(Exception):
    """A value's check ran past MAX_CHECK_STEPS keyword checks."""
#: the memory one compiled pattern may use, its program and its matching cache together (RE2's
#: own cap; its default is 8 MiB): a pattern that needs more is refused when saved
RE2_MAX_MEM = 2 << 20
#: compiled patterns kept per process, least recently used out: with RE2_MAX_MEM, at most 256 MiB
RE2_CACHED_PATTERNS = 128
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False
_RE2_OPTIONS.max_mem = RE2_MAX_MEM


def _refuse(uri: str) -> referencing.Resource:
    raise referencing.exceptions.NoSuchResource(ref=uri)


#: a schema's `$ref`s resolve within the schema only: nothing is ever fetched (a tenant's
#: `$ref` to a URL would otherwise have the host GET it, past the SSRF guard, on its event loop)
NO_RETRIEVAL: referencing.Registry = referencing.Registry(retrieve=_refuse)


@functools.lru_cache(maxsize=RE2_CACHED_PATTERNS)
def _regex(pattern: str) -> Any:
    """`pattern` compiled by RE2, which matches in linear time (Python's re backtracks: a tenant's
    `^(a+)+$` against 30 characters froze the host's loop for seconds); None when RE2 cannot run it."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error:
        return None


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    regex = _regex(pattern)
    if regex is None:
        yield ValidationError(f"the pattern {pattern!r} cannot be checked (a lookaround or backreference)")
    elif regex.search(instance) is None:
        yield ValidationError(f"{_shown(instance)} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _regex(pattern)
        for key, value in instance.items():
            if regex is not None and regex.search(key) is not None:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _counted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    """`keyword`'s check, counted against the steps left to the check running now."""

    def check(validator: Any, value: Any, instance: Any, schema: dict) -> Any:
        left = _steps_left.get()
        if left is not None:
            left[0] -= 1
            if left[0] < 0:
                raise _TooMuchWork
        return keyword(validator, value, instance, schema)

    return check


@functools.cache
def _safe(cls: type) -> type:
    """The dialect's validator with `pattern` and `patternProperties` matched by RE2, and every
    keyword's check counted (MAX_CHECK_STEPS)."""
    keywords = {**cls.VALIDATORS, "pattern": _pattern, "patternProperties": _pattern_properties}
    return jsonschema.validators.extend(cls, validators={k: _counted(v) for k, v in keywords.items()})


def _validator_class(schema: dict[str, Any]) -> type:
    dialect = schema.get("$schema")
    if not isinstance(dialect, str):  # refused on save; never a TypeError from the lookup here
        return _safe(jsonschema.Draft202012Validator)
    return _safe(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))


def _dialect(schema: dict[str, Any]) -> str:
    """The schema's `$schema` without its empty fragment ("" when there is none, or it is not a
    string: that is refused on save)."""
    dialect = schema.get("$schema")
    return dialect.rstrip("#") if isinstance(dialect, str) else ""


@functools.cache
def _format_checker(cls: type) -> jsonschema.FormatChecker:
    """The dialect's format checks, with 2020-12's for the formats the dialect does not define
    (a draft-07 schema's `uuid`, `duration`): an older `$schema` does not turn checks off."""
    checker = jsonschema.FormatChecker(())
    checker.checkers = {**jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers, **cls.FORMAT_CHECKER.checkers}
    return checker


def checked_formats(schema: dict[str, Any] | None = None) -> frozenset[str]:
    """The format names checked in values of `schema` (of a schema without `$schema` when None)."""
    return frozenset(_format_checker(_validator_class(schema or {})).checkers)


class ArgumentValidator:
    """A compiled validator for one tool's parameter schema (or a form's, or a tool's output).
    Values under `sensitive` or secret-looking names (services.tools.redaction, at any depth) are
    never repeated in its problems, nor, while one is present, the object as a whole; with
    `all_sensitive` no value is (a form's answers are all the contact's). `subject` names the
    object in problems about it as a whole ("the result has more than 3 properties").
    Made through `validator_for`, which keeps one per schema content."""

    __slots__ = ("_all_sensitive", "_schema", "_sensitive", "_subject", "_validator")

    def __init__(self, schema: dict[str, Any], *, sensitive: frozenset[str] | tuple[str, ...] = frozenset(),
                 all_sensitive: bool = False, subject: str = "arguments") -> None:
        try:
            cls = _validator_class(schema)
            self._validator: Any = cls(schema, registry=NO_RETRIEVAL, format_checker=_format_checker(cls))
        except Exception as exc:  # noqa: BLE001 - one stored before it was checked as now: `errors` says so
            log.warning("schema_unreadable", error=type(exc).__name__)
            self._validator = None
        self._schema = schema
        self._sensitive = frozenset(sensitive)
        self._all_sensitive = all_sensitive
        self._subject = subject

    def errors(self, value: Any, *, steps: int = MAX_CHECK_STEPS) -> list[str]:
        """Readable problems with `value`, most useful first; empty when valid. A schema stored
        before it was checked as now (a `$ref` that resolves nowhere, one that refers to itself
        without end, a `$id` that is not a string), or a check that would run past `steps`
        keyword checks, is a problem here, never an exception. Runs where it is called: on an
        event loop, `problems`."""
        found = self._errors(value, steps)
        return [_TOO_MUCH.format(subject=self._subject, steps=steps)] if found is None else found

    async def problems(self, value: Any) -> list[str]:
        """`errors`, never holding the event loop more than INLINE_STEPS keyword checks: a value
        that needs more is checked again in the worker process (services.offload), up to
        MAX_CHECK_STEPS, within its deadline."""
        found = self._errors(value, INLINE_STEPS)
        if found is not None:
            return found
        try:
            return await offload.run(value_problems, self._schema, value, self._sensitive, self._all_sensitive,
                                     self._subject)
        except offload.NotFinished as exc:
            return [_TOO_SLOW.format(subject=self._subject, why=exc)]
        except Overloaded:
            return [_BUSY.format(subject=self._subject)]

    def _errors(self, value: Any, steps: int) -> list[str] | None:
        """The problems with `value`; None when checking it ran past `steps` keyword checks."""
        if self._validator is None:
            return [_UNCHECKABLE]
        token = _steps_left.set([steps])
        try:
            found = sorted(self._validator.iter_errors(value), key=_error_rank)
        except RecursionError:
            return [_ENDLESS]
        except _TooMuchWork:
            return None
        except referencing.exceptions.Unresolvable as exc:
            ref = _shown(str(getattr(exc, "ref", "")))
            return [f"the schema's $ref {ref} cannot be checked: it refers to nothing in the schema"]
        except Exception as exc:  # noqa: BLE001 - a schema stored before it was checked as now
            log.warning("schema_unreadable", error=type(exc).__name__)
            return [_UNCHECKABLE]
        finally:
            _steps_left.reset(token)
        return [_describe(error, self._sensitive, self._all_sensitive, self._subject) for error in found]


#: validators by schema content and how they describe problems: a catalog loaded again compiles
#: only the schemas that changed, and the worker process keeps its own
_validators: LRUCache = LRUCache(maxsize=2048)


def validator_for(schema: dict[str, Any], *, sensitive: frozenset[str] | tuple[str, ...] = frozenset(),
                  all_sensitive: bool = False, subject: str = "arguments") -> ArgumentValidator:
    """The ArgumentValidator of `schema` (see there), made once per schema content."""
    key = (_digest(schema), frozenset(sensitive), all_sensitive, subject)
    validator = _validators.get(key)
    if validator is None:
        validator = _validators[key] = ArgumentValidator(schema, sensitive=sensitive, all_sensitive=all_sensitive,
                                                         subject=subject)
    return validator


def value_problems(schema: dict[str, Any], value: Any, sensitive: frozenset[str], all_sensitive: bool,
                   subject: str) -> list[str]:
    """`errors` of `value` against `schema`, up to MAX_CHECK_STEPS: what the worker process runs."""
    return validator_for(schema, sensitive=sensitive, all_sensitive=all_sensitive, subject=subject).errors(value)


def _digest(value: Any, encoded: bytes | None = None) -> bytes:
    """A digest of `value`'s JSON with keys sorted (`encoded`, when the caller has it): equal for
    equal schemas, whatever their key order."""
    if encoded is None:
        encoded = _encoded(value)
    return hashlib.blake2b(encoded if encoded is not None else repr(value).encode(), digest_size=16).digest()


def _encoded(value: Any) -> bytes | None:
    """`value` as JSON with keys sorted (as long as it is in any key order); None when it is not
    JSON (never from a request: its identity is then its repr)."""
    try:
        return msgspec.json.encode(value, order="sorted")
    except Exception:  # noqa: BLE001 - any value a caller holds: not JSON is an answer, not an error
        return None


# -- checking a schema when it is saved -----------------------------------------------------------

#: (message, path) of a schema's refusal; None when it is usable
_Verdict = tuple[str, str | None] | None
#: verdicts by schema content and place: a form listed again, a catalog loaded again, a tool saved
#: again with the same schema is never checked again
_verdicts: LRUCache = LRUCache(maxsize=4096)
_MISSING = object()
#: schema work sent to the worker in one task: about 0.3 ms a subschema, a few seconds at most
_NODES_PER_TASK = 10_000


class _Build:
    """What one `schemas_checked` knows: the large schemas its build met unchecked (by key), and
    verdicts made for it that are not kept (a check that ran past its deadline)."""

    __slots__ = ("known", "pending", "rebuilding")

    def __init__(self) -> None:
        self.pending: dict[tuple[bytes, str, bool], tuple[dict[str, Any], int]] = {}
        self.known: dict[tuple[bytes, str, bool], _Verdict] = {}
        self.rebuilding = False


#: the `schemas_checked` running now, if any
_build_state: ContextVar[_Build | None] = ContextVar("schemas_checked_build", default=None)


def check_schema(schema: dict[str, Any], *, where: str = "$.parameters", checked_formats_only: bool = False) -> None:
    """Raise InvalidInput naming what is wrong when `schema` is not a usable object schema.
    With `checked_formats_only` a `format` this engine does not check (`phone`) is refused too,
    naming the ones it checks (otherwise it is an annotation, as JSON Schema says). On an event
    loop, call it inside `schemas_checked`, which checks large schemas off the loop."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidInput(f"parameters must be a JSON-schema object (\"type\": \"object\") - at `{where}`", path=where)
    _settle(schema, where, checked_formats_only)


def check_any_schema(schema: dict[str, Any], *, where: str, checked_formats_only: bool = False) -> None:
    """Raise InvalidInput when `schema` is not a valid JSON schema (of any type); formats and the
    event loop as `check_schema`."""
    if not isinstance(schema, dict):
        raise InvalidInput(f"a JSON schema must be an object - at `{where}`", path=where)
    _settle(schema, where, checked_formats_only)


async def schemas_checked(build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`build(*args, **kwargs)`, with the checks of schemas above INLINE_NODES subschemas done in
    the worker process (services.offload) rather than on the event loop. `build` (pure: a tool's
    definition, a catalog, a form's view) runs once taking each such schema it has no verdict for
    as usable; those schemas are then checked in the worker, a few seconds' work per task, and
    their verdicts kept. When every one is usable, that first result is the answer; otherwise
    `build` runs again, and each refusal is raised where `build` meets it. Raises what `build`
    raises, and Overloaded when the worker has too much in hand."""
    state = _Build()
    token = _build_state.set(state)
    try:
        built = build(*args, **kwargs)
        if not state.pending:
            return built
        await _check_in_worker(state)
        if all(state.known.get(key, _verdicts.get(key)) is None for key in state.pending):
            return built
        state.rebuilding = True
        return build(*args, **kwargs)
    finally:
        _build_state.reset(token)


async def _check_in_worker(state: _Build) -> None:
    """Check `state.pending` in the worker, in tasks of at most _NODES_PER_TASK subschemas: the
    verdicts go to `_verdicts`, a check that ran past its deadline to `state.known` alone."""
    tasks: list[list[tuple[bytes, str, bool]]] = [[]]
    load = 0
    for key, (_, nodes) in state.pending.items():
        if tasks[-1] and load + nodes > _NODES_PER_TASK:
            tasks.append([])
            load = 0
        tasks[-1].append(key)
        load += nodes
    for keys in tasks:
        items = [(state.pending[key][0], key[1], key[2]) for key in keys]
        try:
            verdicts = await offload.run(schema_verdicts, items)
        except offload.NotFinished as exc:
            for key in keys:
                said = f"checking the schema took too long ({exc}); make it smaller or simpler - at `{key[1]}`"
                state.known[key] = (said, key[1])
            continue
        for key, verdict in zip(keys, verdicts, strict=True):
            _verdicts[key] = verdict


def schema_verdicts(items: list[tuple[dict[str, Any], str, bool]]) -> list[_Verdict]:
    """`schema_verdict` of each (schema, where, checked_formats_only): what the worker runs."""
    return [schema_verdict(schema, where, formats_only) for schema, where, formats_only in items]


def schema_verdict(schema: dict[str, Any], where: str, checked_formats_only: bool) -> _Verdict:
    """The dialect's check and the engine's (`_check`) as data, never cached."""
    try:
        _check(schema, where, checked_formats_only)
    except InvalidInput as exc:
        return str(exc), exc.path
    return None


def _settle(schema: dict[str, Any], where: str, checked_formats_only: bool) -> None:
    """Refuse a schema over budget at once, then raise its verdict: kept, made here (a small
    schema, or outside `schemas_checked`), or left for the worker (inside `schemas_checked`)."""
    encoded = _encoded(schema)  # once: its length is the budget's, its digest the verdict's key
    nodes = _bounded_count(schema, where, len(encoded) if encoded is not None else 0)
    key = (_digest(schema, encoded), where, checked_formats_only)
    verdict = _verdicts.get(key, _MISSING)
    state = _build_state.get()
    if verdict is _MISSING and state is not None:
        verdict = state.known.get(key, _MISSING)
    if verdict is _MISSING:
        if nodes > INLINE_NODES and state is not None and not state.rebuilding:
            state.pending[key] = (schema, nodes)
            return  # usable for now: schemas_checked builds again if the worker says otherwise
        verdict = _verdicts[key] = schema_verdict(schema, where, checked_formats_only)
    if verdict is not None:
        message, path = verdict
        raise InvalidInput(message, path=path)


def _bounded_count(schema: dict[str, Any], where: str, size: int) -> int:
    """How many objects `schema` holds at any depth (itself included), refusing it first when its
    JSON (`size` bytes; 0 when it is not JSON: `_check` says what it cannot read) is over
    MAX_SCHEMA_BYTES, or, counting without recursion, when it nests deeper than a schema may
    (twice MAX_SCHEMA_DEPTH levels of objects and lists: `_schema_nodes` then says exactly where)
    or the count passes MAX_SCHEMA_NODES. Nothing else reads it before."""
    if size > MAX_SCHEMA_BYTES:
        raise InvalidInput(f"the schema is {size:,} bytes of JSON, more than the {MAX_SCHEMA_BYTES:,} allowed; "
                           f"make it smaller - at `{where}`", path=where)
    count, pending = 0, [(schema, 0)]
    while pending:
        node, depth = pending.pop()
        if depth > 2 * MAX_SCHEMA_DEPTH:
            raise InvalidInput(f"the schema nests too deeply (more than {MAX_SCHEMA_DEPTH} levels) - at `{where}`",
                               path=where)
        if isinstance(node, dict):
            count += 1
            if count > MAX_SCHEMA_NODES:
                raise InvalidInput(f"the schema has more than {MAX_SCHEMA_NODES:,} subschemas; make it smaller "
                                   f"(list fewer alternatives, or describe the value more simply) - at `{where}`",
                                   path=where)
            pending.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            pending.extend((value, depth + 1) for value in node)
    return count


def _check(schema: dict[str, Any], where: str, checked_formats_only: bool = False) -> None:
    """`_check_readable`, and never an exception other than InvalidInput: jsonschema and
    referencing assume what they read was checked (a hostile or odd schema could raise
    AttributeError or TypeError from deep inside them, a 500 for the admin)."""
    try:
        _check_readable(schema, where, checked_formats_only)
    except InvalidInput:
        raise
    except RecursionError:
        raise InvalidInput(f"the schema nests too deeply - at `{where}`", path=where) from None
    except Exception as exc:  # noqa: BLE001 - anything the checks above did not foresee is a 422
        log.warning("schema_unreadable", error=type(exc).__name__, where=where)
        raise InvalidInput(_UNREADABLE.format(where=where), path=where) from None


def _check_readable(schema: dict[str, Any], where: str, checked_formats_only: bool) -> None:
    """Bounded depth and resource keywords that are strings, the dialect's own check, then what
    this engine adds: `$ref`s that resolve within the schema (to a schema), patterns RE2 can
    run, no `patternProperties`, formats that are checked, a bounded unfolding of `$ref`s."""
    nodes = list(_schema_nodes(schema, where, 0))
    legacy_id = _dialect(schema) in _LEGACY_ID_DIALECTS
    for path, node in nodes:  # before anything reads them: jsonschema and referencing would raise
        _check_strings(node, path, legacy_id)
    cls = _validator_class(schema)
    # the dialect's check before any `$ref` is looked up: finding an anchor (`#a`) walks every
    # subschema, and one that is no schema (`"not": null`) is an AttributeError inside referencing
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        path = where + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in exc.absolute_path)
        raise InvalidInput(f"invalid JSON schema: {exc.message} - at `{path}`", path=path) from None
    except RecursionError:
        raise InvalidInput(f"the schema nests too deeply - at `{where}`", path=where) from None
    resolver = NO_RETRIEVAL.resolver_with_root(
        referencing.jsonschema.specification_with(
            schema.get("$schema", ""), default=referencing.jsonschema.DRAFT202012,
        ).create_resource(schema)
    )
    checked = frozenset(_format_checker(cls).checkers)
    for path, node in nodes:
        _check_node(node, path, resolver)
        _check_format(node, path, checked, checked_formats_only)
    try:
        unfolded = _expansion(schema, resolver)
    except RecursionError:  # a chain of $refs longer than the checker could follow either
        raise InvalidInput(f"the schema's $refs chain too deeply - at `{where}`", path=where) from None
    if unfolded > MAX_SCHEMA_EXPANSION:
        raise InvalidInput(
            f"the schema's $refs unfold to more than {MAX_SCHEMA_EXPANSION:,} subschemas (a $def that uses "
            f"another twice doubles it), so checking one value would stall the session; refer to each $def "
            f"fewer times, or write the schema out - at `{where}`", path=where,
        )


def _expansion(schema: dict[str, Any], resolver: referencing.Resolver) -> int:
    """How many subschemas checking one value may visit, `$ref`s unfolded where they are used
    (`$defs` themselves only through their uses), counting stopped past MAX_SCHEMA_EXPANSION. A
    `$ref` back into a schema being unfolded counts once: such recursion follows the value's
    depth, not the schema's. Every `$ref` resolves (_check_node ran first)."""
    memo: dict[int, int] = {}
    unfolding: set[int] = set()

    def cost(node: Any) -> int:
        if isinstance(node, list):
            total = 0
            for item in node:
                total += cost(item)
                if total > MAX_SCHEMA_EXPANSION:
                    break
            return total
        if not isinstance(node, dict):
            return 0
        key = id(node)
        if key in memo:
            return memo[key]
        if key in unfolding:
            return 1
        unfolding.add(key)
        total = 1
        for keyword, value in node.items():
            if keyword in _DATA_KEYWORDS or keyword in ("$defs", "definitions"):
                continue
            if keyword in ("$ref", "$dynamicRef") and isinstance(value, str):
                total += cost(resolver.lookup(value).contents)
            elif keyword in _SCHEMA_MAPS and isinstance(value, dict):
                total += cost(list(value.values()))  # names, then schemas: a property called `default` counts
            else:
                total += cost(value)
            if total > MAX_SCHEMA_EXPANSION:
                break
        unfolding.discard(key)
        memo[key] = total
        return total

    return cost(schema)


def _schema_nodes(node: Any, path: str, depth: int) -> Iterator[tuple[str, dict]]:
    """Every object in a schema with its path, data keywords' values left out. The values of a
    name-to-schema map (`properties`) are schemas whatever their names (a property `default`)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidInput(f"the schema nests too deeply (more than {MAX_SCHEMA_DEPTH} levels) - at `{path}`", path=path)
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _schema_nodes(sub, f"{path}.{key}.{name}", depth + 2)
            elif key not in _DATA_KEYWORDS:
                yield from _schema_nodes(value, f"{path}.{key}", depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schema_nodes(value, f"{path}[{i}]", depth + 1)


def _check_strings(node: dict, path: str, legacy_id: bool) -> None:
    """Refuse a resource keyword (`$schema`, `$id`, `$ref`...; `id` in draft-03/04) whose value
    is not a string."""
    for keyword in (*_STRING_KEYWORDS, "id") if legacy_id else _STRING_KEYWORDS:
        if keyword in node and not isinstance(node[keyword], str):
            at = f"{path}.{keyword}"
            raise InvalidInput(f"{keyword} must be a string (a URI or a fragment), not "
                               f"{_shown(node[keyword])} - at `{at}`", path=at)


def _check_format(node: dict, path: str, checked: frozenset[str], checked_only: bool) -> None:
    """Refuse a `format` the engine cannot check: a standard one whose library is missing here
    (values would pass unchecked while the schema says otherwise), or with `checked_only` any."""
    fmt = node.get("format")
    if not isinstance(fmt, str) or fmt in checked:  # not a string: the dialect's own check says so
        return
    if fmt in STANDARD_FORMATS:
        why = "is a standard format, but this host cannot check it (a library jsonschema needs is missing)"
    elif checked_only:
        why = "is not a format this engine checks; use a `pattern` for it"
    else:
        return
    at = f"{path}.format"
    raise InvalidInput(f"format {_shown(fmt)} {why}; the formats checked are {', '.join(sorted(checked))} "
                       f"- at `{at}`", path=at)


def _check_node(node: dict, path: str, resolver: referencing.Resolver) -> None:
    if "patternProperties" in node:
        raise InvalidInput(f"patternProperties is not supported in a tool's schema: list the properties, or give "
                           f"additionalProperties a schema - at `{path}.patternProperties`", path=f"{path}.patternProperties")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _regex(pattern) is None:
        raise InvalidInput(f"the pattern {_shown(pattern)} uses a lookaround or backreference, is not a valid "
                           f"regular expression, or needs more than {RE2_MAX_MEM >> 20} MiB to run; patterns are "
                           f"matched in linear time (RE2 syntax) - at `{path}.pattern`",
                           path=f"{path}.pattern")
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if not isinstance(ref, str):
            continue
        if not ref.startswith("#"):
            raise InvalidInput(f"{keyword} {_shown(ref)}: a $ref may only refer to this schema (\"#/$defs/...\"); "
                               f"nothing is fetched - at `{path}`", path=path)
        try:
            target = resolver.lookup(ref).contents
        except (referencing.exceptions.Unresolvable, LookupError, TypeError, ValueError):
            # a pointer through a value that is no object or list (`#/a/0` with `"a": 5`) is a
            # TypeError or ValueError inside referencing, not an Unresolvable
            raise InvalidInput(f"$ref {_shown(ref)} does not resolve to anything in this schema - at `{path}`",
                               path=path) from None
        if not isinstance(target, dict | bool):
            raise InvalidInput(f"$ref {_shown(ref)} resolves to {_shown(target)}, which is not a schema (an object "
                               f"or true/false) - at `{path}`", path=path)


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 2] + "…" + text[-1]


def _error_rank(error: jsonschema.ValidationError) -> tuple[int, str]:
    # Missing and unexpected fields first: they are what the model most often gets wrong.
    order = {"required": 0, "additionalProperties": 1, "type": 2}
    return (order.get(error.validator, 3), error.json_path)


def _describe(error: jsonschema.ValidationError, sensitive: frozenset[str] = frozenset(),
              all_sensitive: bool = False, subject: str = "arguments") -> str:
    path = error.absolute_path
    field = ".".join(str(p) for p in path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"'{missing}' is required"
    if error.validator == "additionalProperties":  # names the unexpected keys, never their values
        return error.message.replace("Additional properties are not allowed", "unknown argument")
    if path and (all_sensitive or any(_hidden(p, sensitive) for p in path)):
        # the message would repeat the value ("'4111…' does not match …"): say what is wrong only
        return f"'{field}': {_rule_broken(error)}"
    if not path and (all_sensitive or (isinstance(error.instance, dict)
                                       and any(_hidden(k, sensitive) for k in error.instance))):
        # a rule on the object as a whole (anyOf, oneOf, not, const, maxProperties...): its
        # message quotes the whole object, sensitive values with it
        return _root_rule_broken(error, sensitive, all_sensitive, subject)
    if field:
        return f"'{field}': {error.message}"
    return error.message


def _hidden(name: Any, sensitive: frozenset[str]) -> bool:
    """True when a value under `name` (a key, or a step of an error's path) is never quoted."""
    return isinstance(name, str) and (name in sensitive or secret_name(name))


def _rule_broken(error: jsonschema.ValidationError) -> str:
    """What is wrong with a value, in words that never repeat it (the schema's own values may)."""
    rule, limit = error.validator, error.validator_value
    said = {
        "pattern": f"the value does not match its pattern {limit!r}",
        "type": f"the value is not of type {limit!r}",
        "format": f"the value is not a valid {limit!r}",
        "enum": f"the value is not one of {_shown(limit, 200)}",
        "const": "the value is not the one allowed",
        "minLength": f"the value is shorter than {limit} characters",
        "maxLength": f"the value is longer than {limit} characters",
        "minimum": f"the value is less than the minimum of {limit}",
        "maximum": f"the value is more than the maximum of {limit}",
        "exclusiveMinimum": f"the value must be more than {limit}",
        "exclusiveMaximum": f"the value must be less than {limit}",
        "multipleOf": f"the value is not a multiple of {limit}",
        "minItems": f"the list has fewer than {limit} items",
        "maxItems": f"the list has more than {limit} items",
        "uniqueItems": "the list has repeated items",
    }
    return said.get(rule, f"the value is not valid ({rule})")


def _root_rule_broken(error: jsonschema.ValidationError, sensitive: frozenset[str], all_sensitive: bool,
                      subject: str = "arguments") -> str:
    """A rule on the whole object (`subject`: the arguments, the result) described without quoting
    it: the rule, and for anyOf/oneOf what the closest alternative lacks (with the same care)."""
    rule, limit = error.validator, error.validator_value
    have, do = ("have", "do") if subject.endswith("s") else ("has", "does")
    if rule == "maxProperties":
        return f"the {subject} {have} more than {limit} properties"
    if rule == "minProperties":
        return f"the {subject} {have} fewer than {limit} properties"
    if rule == "dependentRequired":  # "'b' is a dependency of 'a'": names only
        return error.message
    said = f"the {subject} {do} not satisfy the schema's '{rule}' rule"
    if rule in ("anyOf", "oneOf") and error.context:
        inner = []
        for sub in sorted(error.context, key=_error_rank):
            text = _describe(sub, sensitive, all_sensitive, subject)
            if text not in inner:
                inner.append(text)
        return f"{said}: " + "; or ".join(inner[:2])
    return said
