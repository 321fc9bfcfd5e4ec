"""submit_form: tenant-defined forms (JSON schemas in ce_forms) and validated submissions.

The tenant admin saves a form as a JSON schema of an object (PUT /v1/forms/{name}); the schema is
checked then, so a broken one is a 422 for the admin, never a failure in a contact's session. A
submission is validated against it (jsonschema, formats checked) and stored only when valid; the
in-band error names each wrong field and the rule it breaks, never the answer itself. Called without `data`, the tool
describes the form's fields so the model knows what to ask for.

The answers (`data`) are `sensitive`: stored whole in ce_form_submissions for the tenant, shown
as [redacted] in call records, traces and the dashboard. One submission of a form per message:
the idempotency key names the form only, so a turn re-run after a crash, whose model words an
answer differently, finds the row the first run wrote and stores nothing. Only a call with the
same answers is told "submitted" then; one with other answers (a re-run's rewording, or a second
person's form in the same message) is told in-band that they were not stored, so the model never
says answers were submitted that were dropped.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from kernel.errors import InvalidInput
from services.builtins.base import TenantConfigs, clip
from services.builtins.memory import MemoryService
from services.builtins.notify import Notifier
from services.tools.context import TrustedContext
from services.tools.errors import InvalidArguments, PolicyDenied
from services.tools.model import PythonTool
from services.tools.validation import check_schema, validator_for
from storage.pool import storable_text

HANDLER = "builtin.submit_form"
EVENT = "form.submitted"
FORM_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}\Z")

DEFINITION = PythonTool(
    name="submit_form",
    description=(
        "Submit one of the business's forms (for example a contact, quote or feedback form) with "
        "the customer's answers as `data`. Call it without `data` to learn the form's fields first; "
        "an error names each field that is missing or wrong."
    ),
    parameters={
        "type": "object",
        "properties": {
            "form": {"type": "string", "maxLength": 64, "description": "the form's name"},
            "data": {"type": "object", "description": "the answers, field name -> value"},
        },
        "required": ["form"],
        "additionalProperties": False,
    },
    mutability="write",
    requires_approval=False,  # the contact is filling in the form themselves
    # The answers are the contact's details: kept whole in ce_form_submissions for the tenant,
    # redacted in call records, traces and the dashboard (as collect_lead's fields are).
    sensitive=("data",),
    # one submission of a form per message: a turn re-run after a crash may word an answer differently
    idempotency_arguments=("form",),
    handler=HANDLER,
)


def check_form(name: str, schema: Any) -> dict[str, Any]:
    """Validate an admin's form definition. Returns the schema; raises InvalidInput naming the
    problem (a bad name, not an object schema, an invalid JSON schema)."""
    if not FORM_NAME_RE.match(name or ""):
        raise InvalidInput(f"form name {clip(name, 70)!r} must be 1-64 letters, digits, _ or - and start with a letter")
    if not isinstance(schema, dict):
        raise InvalidInput("the body must be a JSON schema object like {\"type\": \"object\", \"properties\": {...}}",
                           path="$")
    # formats are rules here, not annotations: one the engine does not check is refused, or the form
    # would say `"format": "phone"` and store whatever a contact answers
    check_schema(schema, where="$", checked_formats_only=True)
    return schema


def form_problems(schema: Any) -> list[str]:
    """What `check_form` would refuse in a stored form's schema today: a form saved before a check
    existed (a `format` the engine does not check, such as `phone`, that stores any answer) keeps
    working as saved, and its admin reads here what to fix. Empty when there is nothing."""
    try:
        check_schema(schema, where="$", checked_formats_only=True)
    except InvalidInput as exc:
        return [f"{exc}; PUT the form again with it fixed"]
    return []


def describe_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """What the model needs to fill a form: each field's type, description, and which are required."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    fields = {}
    for name, prop in props.items():
        prop = prop if isinstance(prop, dict) else {}
        info = {k: prop[k] for k in ("type", "description", "enum", "format", "minimum", "maximum",
                                     "minLength", "maxLength", "pattern") if k in prop}
        fields[name] = info
    return {"fields": fields, "required": [r for r in schema.get("required") or [] if isinstance(r, str)]}


class FormStore(Protocol):
    async def get(self, tenant_id: str, name: str) -> Any: ...
    async def list(self, tenant_id: str) -> list[Any]: ...
    async def submit(self, tenant_id: str, session_id: str | None, form_name: str, data: dict[str, Any], *,
                     idempotency_key: str | None = None, announce: Any = None) -> tuple[Any, bool]: ...


class FormService:
    def __init__(self, store: FormStore, *, configs: TenantConfigs, notifier: Notifier,
                 memory: MemoryService | None = None) -> None:
        self._store = store
        self._configs = configs
        self._notifier = notifier
        self._memory = memory

    async def submit(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of submit_form. Returns the stored submission's id, or the form's fields
        when `data` is absent. Raises InvalidArguments naming the form or the fields at fault,
        PolicyDenied when this message already submitted the form with other answers (stored
        once per message: these are not)."""
        name = str(args.get("form") or "").strip()
        form = await self._store.get(ctx.tenant_id, name) if name else None
        if form is None:
            forms = await self._store.list(ctx.tenant_id)
            if not forms:
                raise PolicyDenied("this business has no forms set up",
                                   advice="Tell the customer you cannot take this form here and offer another way to help.")
            names = ", ".join(f.name for f in forms[:20])
            raise InvalidArguments(
                f"there is no form named {clip(name, 40)!r}; the forms are: {names}",
                advice="Call submit_form again with one of these form names.",
            )
        data = args.get("data")
        if data is None:
            return {"form": form.name, "status": "not submitted: call again with data for these fields",
                    **describe_fields(form.schema)}
        # every answer is the contact's (`data` is sensitive): an error names the field and the
        # rule, never the value, whatever the form's schema declares
        problems = await validator_for(form.schema, all_sensitive=True).problems(data)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise InvalidArguments(
                f"form '{form.name}' is not valid: {shown}",
                advice="Ask the customer for the missing or corrected answers, then call submit_form again with all the data.",
            )
        config = await self._configs.config_for(ctx.tenant_id)
        announce = self._notifier.announcer(config, EVENT, tenant_id=ctx.tenant_id, about=lambda row: (row.id, {
            "submission_id": row.id, "session_id": ctx.session_id, "form": form.name,
            "data": data, "created_at": row.created_at.isoformat(),
        }))
        submission, created = await self._store.submit(
            ctx.tenant_id, ctx.session_id, form.name, data, idempotency_key=ctx.idempotency_key, announce=announce,
        )
        announce.done()
        if not created and not same_answers(submission.data, data):
            raise PolicyDenied(
                f"form '{form.name}' was already submitted in this message, with other answers; "
                "these answers were not stored",
                advice=("If they are for another submission (say, another person), ask the customer to send "
                        "them in a new message and call submit_form then; if they restate the earlier "
                        "answers, tell the customer the form is already submitted."),
            )
        if created and self._memory is not None:
            answers = ", ".join(f"{k}: {clip(str(v), 80)}" for k, v in list(data.items())[:10])
            await self._memory.remember_quietly(ctx, f"Submitted form {form.name}: {answers}")
        return {"submission_id": submission.id, "status": "submitted", "form": form.name}


def same_answers(stored: Any, given: Any) -> bool:
    """True when `given` (a call's answers) is what Postgres kept of `stored` (a submission's
    JSONB `data`): equal once each string is as the pool's codec stores it (NUL and lone
    surrogates replaced), numbers compared by value (JSONB gives 1e300 back as a 301-digit
    integer), true and 1 told apart."""
    if isinstance(stored, bool) or isinstance(given, bool):
        return type(stored) is type(given) and stored == given
    if isinstance(stored, int | float) and isinstance(given, int | float):
        try:
            return stored == given or float(stored) == float(given)
        except OverflowError:  # an integer past float's range, compared exactly above
            return False
    if isinstance(stored, str) and isinstance(given, str):
        return stored == storable_text(given)
    if isinstance(stored, dict) and isinstance(given, dict):
        given = {storable_text(k): v for k, v in given.items()}
        return stored.keys() == given.keys() and all(same_answers(stored[k], given[k]) for k in stored)
    if isinstance(stored, list) and isinstance(given, list | tuple):
        return len(stored) == len(given) and all(same_answers(a, b) for a, b in zip(stored, given, strict=True))
    return stored == given
