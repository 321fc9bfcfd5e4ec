"""Argument validation against a tool's JSON schema, with errors the model can act on.

The schema itself is checked when a definition is saved (`check_schema`), so a broken schema is
a 422 for the tenant admin, never a crash in a contact's session.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from services.errors import InvalidInput


class ArgumentValidator:
    """A compiled validator for one tool's parameter schema."""

    __slots__ = ("_validator",)

    def __init__(self, schema: dict[str, Any]) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def errors(self, arguments: dict[str, Any]) -> list[str]:
        """Readable problems with `arguments`, most useful first; empty when valid."""
        problems = []
        for error in sorted(self._validator.iter_errors(arguments), key=_error_rank):
            problems.append(_describe(error))
        return problems


def check_schema(schema: dict[str, Any], *, where: str = "$.parameters") -> None:
    """Raise InvalidInput naming what is wrong when `schema` is not a usable object schema."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidInput(f"parameters must be a JSON-schema object (\"type\": \"object\") - at `{where}`", path=where)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        path = where + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in exc.absolute_path)
        raise InvalidInput(f"invalid JSON schema: {exc.message} - at `{path}`", path=path) from None


def check_any_schema(schema: dict[str, Any], *, where: str) -> None:
    """Raise InvalidInput when `schema` is not a valid JSON schema (of any type)."""
    if not isinstance(schema, dict):
        raise InvalidInput(f"a JSON schema must be an object - at `{where}`", path=where)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        path = where + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in exc.absolute_path)
        raise InvalidInput(f"invalid JSON schema: {exc.message} - at `{path}`", path=path) from None


def _error_rank(error: jsonschema.ValidationError) -> tuple[int, str]:
    # Missing and unexpected fields first: they are what the model most often gets wrong.
    order = {"required": 0, "additionalProperties": 1, "type": 2}
    return (order.get(error.validator, 3), error.json_path)


def _describe(error: jsonschema.ValidationError) -> str:
    field = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"'{missing}' is required"
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unknown argument")
    if field:
        return f"'{field}': {error.message}"
    return error.message
