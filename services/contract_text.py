"""The contract report as text for a terminal (`chat-engine contract`)."""

from __future__ import annotations

from typing import Any

_FILLED_BY = {
    "tenant": "the tenant's id, in every session",
    "claim": "the token's '{claim}' claim, for a verified contact only",
    "none": "nothing (every call fails)",
}


def format_report(report: dict[str, Any]) -> str:
    if "tools" not in report:
        return f"error: {report.get('detail') or report}"
    lines = [(f"tool contract for tenant {report['tenant_id']}: "
              f"{'OK' if report['ok'] else 'PROBLEMS'} ({report['findings']} finding(s))"), ""]
    for tool in report["tools"]:
        head = f"{tool['name']}  [{tool['type']}, {tool['origin']}"
        head += f", v{tool['version']}]" if tool.get("version") else "]"
        lines.append(head)
        lines.append(f"  runs: {tool.get('runs') or '(nothing loaded)'}   offered to the model: {'yes' if tool['offered'] else 'no'}")
        for f in tool["fields"]:
            model = f["model_name"] or "-"
            backend = f["backend_name"] or "-"
            req = " (required)" if f.get("required_by_model") or f.get("required_by_backend") else ""
            lines.append(f"    {model:>16} -> {backend:<16} from {f['source']}{req}")
        for need in tool.get("scope") or []:
            lines.append(f"  scope {need['key']}: {_FILLED_BY[need['provided_by']].format(claim=need.get('claim'))}")
        for finding in tool["findings"]:
            mark = "ERROR" if finding["severity"] == "error" else "warn "
            lines.append(f"  {mark} {finding['kind']}: {finding['message']}")
            lines.append(f"        fix: {finding['fix']}")
        lines.append("")
    return "\n".join(lines)
