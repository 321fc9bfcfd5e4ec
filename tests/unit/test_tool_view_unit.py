"""services.gateway.bodies.tool_view: a definition as the API shows it (pure)."""

from __future__ import annotations

import msgspec

from services.builtins.forms import DEFINITION as SUBMIT_FORM
from services.gateway.bodies import ToolCreate, definition_from_body, tool_view


def test_a_tenant_tools_view_leaves_out_the_unset_engine_only_idempotency_arguments():
    definition = definition_from_body(ToolCreate(name="lookup", description="Look things up.",
                                                 webhook_url="https://example.com/x"), encrypt=str)
    stored = msgspec.to_builtins(definition)
    assert stored["idempotency_arguments"] is None  # stored as the struct encodes it
    view = tool_view(stored, version=1)
    assert "idempotency_arguments" not in view
    assert view["completes_variable"] is None and view["output_schema"] is None  # settable: shown as null


def test_a_set_idempotency_arguments_is_shown_as_set():
    assert tuple(tool_view(msgspec.to_builtins(SUBMIT_FORM))["idempotency_arguments"]) == ("form",)
