"""collect_lead: the contact's details saved as a lead, once per session (seed 000).

Validated here with errors that name the field and the rule, never the value the contact typed
("'email' is not a valid email address: it must contain exactly one '@'": an error reaches
ce_tool_calls, the API's tool_calls and the dashboard, where email and phone are `sensitive`),
written with its memory fact in one transaction (UNIQUE (tenant_id, session_id) keeps it to one
per session even across a replayed turn), the `lead_collected` variable set by the engine
(`completes_variable`) so the tool leaves the tool set, the session's contact variable set to the
lead's email (so later sessions of the same contact can recall this one), and `lead.created`
sent to the tenant's notification webhook in the background.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from services.builtins.base import TenantConfigs, clip
from services.builtins.notify import Notifier
from services.tools.context import TrustedContext
from services.tools.errors import InvalidArguments, PolicyDenied
from services.tools.model import PythonTool
from services.tools.registry import SetVariables

HANDLER = "builtin.collect_lead"
COMPLETES = "lead_collected"
EVENT = "lead.created"

DEFINITION = PythonTool(
    name="collect_lead",
    description=(
        "Save the customer's contact details as a lead so the team can follow up: name and email "
        "(required), phone and notes about what they want (optional). Use once the customer has "
        "given their name and email; it is needed only once per conversation."
    ),
    parameters={
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "the customer's full name", "maxLength": 200},
            "email": {"type": "string", "description": "the customer's email address", "maxLength": 254},
            "phone": {"type": "string", "description": "the customer's phone number, with country code if given",
                      "maxLength": 40},
            "notes": {"type": "string", "description": "what the customer is interested in, in their words",
                      "maxLength": 2000},
        },
        "required": ["name", "email"],
        "additionalProperties": False,
    },
    # Contact details live in the leads table; call records, traces and logs keep them redacted.
    sensitive=("email", "phone", "notes"),  # notes: free text, often repeats the details
    # A write (a row in the tenant's leads), but one the contact just volunteered: no approval.
    mutability="write",
    requires_approval=False,
    completes_variable=COMPLETES,
    handler=HANDLER,
)

_EMAIL_RE = re.compile(r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+\Z")
_PHONE_CHARS_RE = re.compile(r"^\+?[0-9 ().\-/]+\Z")
_EMAIL_ADVICE = "Ask the customer to spell their email address again, then call collect_lead again."
_PHONE_ADVICE = ("Ask the customer for their phone number again (digits, optionally starting with + and the "
                 "country code), or call collect_lead without a phone.")


def validate_email(raw: Any) -> str:
    """The email, trimmed and lower-cased. Raises InvalidArguments naming `email` and the problem."""
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidArguments("'email' is missing", advice=_EMAIL_ADVICE)
    email = raw.strip()
    problem = None
    if email.count("@") != 1:
        problem = "it must contain exactly one '@'"
    else:
        local, domain = email.split("@")
        if not local:
            problem = "nothing before the '@'"
        elif not domain:
            problem = "no domain after the '@'"
        elif "." not in domain:
            problem = "the domain after the '@' has no dot (like example.com)"
        elif len(local) > 64 or len(email) > 254:
            problem = "it is too long"
        elif local.startswith(".") or local.endswith(".") or ".." in local:
            problem = "misplaced dots before the '@'"
        elif not _EMAIL_RE.match(email):
            problem = "it contains characters an email address cannot have"
    if problem:
        raise InvalidArguments(f"'email' is not a valid email address: {problem}", advice=_EMAIL_ADVICE)
    return email.lower()


def validate_phone(raw: Any) -> str | None:
    """The phone as given (trimmed), None when absent. Raises InvalidArguments naming `phone`."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if not isinstance(raw, str):
        raise InvalidArguments("'phone' must be text", advice=_PHONE_ADVICE)
    phone = raw.strip()
    if not _PHONE_CHARS_RE.match(phone) or "+" in phone[1:]:
        raise InvalidArguments(
            "'phone' is not a valid phone number: only digits, spaces, ( ) . - / and a leading + are allowed",
            advice=_PHONE_ADVICE,
        )
    digits = sum(c.isdigit() for c in phone)
    if not 7 <= digits <= 15:
        raise InvalidArguments(
            f"'phone' is not a valid phone number: it has {digits} digits, a phone number has 7 to 15",
            advice=_PHONE_ADVICE,
        )
    return phone


def validate_name(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidArguments("'name' is missing", advice="Ask the customer for their name, then call collect_lead again.")
    name = " ".join(raw.split())
    if not any(c.isalpha() for c in name):
        raise InvalidArguments(f"'name' {clip(name, 60)!r} has no letters",
                               advice="Ask the customer for their name, then call collect_lead again.")
    return name[:200]


class LeadStore(Protocol):
    async def create(self, tenant_id: str, session_id: str, *, name: str, email: str, phone: str | None,
                     notes: str | None, fact: str | None = None, contact_id: str | None = None,
                     language: str = "simple", announce: Any = None) -> tuple[Any, bool]: ...


class LeadService:
    def __init__(self, store: LeadStore, configs: TenantConfigs, notifier: Notifier,
                 text_config: Any = None) -> None:
        self._store = store
        self._configs = configs
        self._notifier = notifier
        self._text_config = text_config  # async (language) -> Postgres text search config name

    async def collect(self, args: dict[str, Any], ctx: TrustedContext) -> SetVariables:
        """The handler of collect_lead. Returns the saved lead (and the contact variable to set);
        raises InvalidArguments for a malformed field, PolicyDenied when this session already has
        a different lead."""
        name = validate_name(args.get("name"))
        email = validate_email(args.get("email"))
        phone = validate_phone(args.get("phone"))
        notes = " ".join(str(args["notes"]).split())[:2000] if args.get("notes") else None
        config = await self._configs.config_for(ctx.tenant_id)
        fact = f"Lead details: name {name}, email {email}" + (f", phone {phone}" if phone else "")
        if notes:
            fact += f". Interested in: {notes}"
        language = await self._text_config(ctx.language) if self._text_config else "simple"
        announce = self._notifier.announcer(config, EVENT, tenant_id=ctx.tenant_id, about=lambda lead: (lead.id, {
            "lead_id": lead.id, "session_id": ctx.session_id, "name": lead.name, "email": lead.email,
            "phone": lead.phone, "notes": lead.notes, "created_at": lead.created_at.isoformat(),
        }))
        lead, created = await self._store.create(
            ctx.tenant_id, ctx.session_id, name=name, email=email, phone=phone, notes=notes,
            fact=fact, contact_id=ctx.contact_sub, language=language, announce=announce,
        )
        announce.done()
        if not created and (lead.email or "").lower() != email:
            raise PolicyDenied(
                "a lead was already saved in this conversation",
                advice="Do not call collect_lead again; tell the customer their details are already with the team.",
            )
        variables = {}
        if not ctx.variables.get(config.contact_id_variable):
            variables[config.contact_id_variable] = email
        return SetVariables(
            # no email: the model has the one it sent, and a copy here would be one more place it
            # is stored (ce_tool_calls.result)
            result={"lead_id": lead.id, "status": "saved", "name": lead.name},
            variables=variables,
        )
