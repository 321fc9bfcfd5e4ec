"""A turn over a scripted model: `ScriptedLLM` answers each request with the next step,
`make_env`/`env_for` build the TurnEnv around it, `registry` (a fixture) holds the handlers
the tools `LOOKUP` and `WRITE` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from actors.session import TurnEnv
from services.approvals import approval_keys
from services.botconfig import BotConfig
from services.llm.port import LLMRequest, LLMResponse, TextBlock, TextDelta, ToolUseBlock, Usage
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.fakes import StreamScriptedLLM

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


@dataclass(frozen=True)
class Streamed:
    """A scripted step that streams its text as these deltas (the text block is them joined),
    then makes `calls` ((name, args) pairs), if any."""

    deltas: tuple[str, ...]
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


class ScriptedLLM(StreamScriptedLLM):
    """Answers each request with the next scripted step: a text (streamed as one delta), a list
    of (name, args) calls, or a `Streamed` step."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps = list(steps)
        self.requests: list[LLMRequest] = []

    async def stream(self, request: LLMRequest):
        self.requests.append(request)
        step = self.steps.pop(0) if self.steps else "fallback text"
        if isinstance(step, str):
            step = Streamed(deltas=(step,))
        elif not isinstance(step, Streamed):
            step = Streamed(deltas=(), calls=tuple(step))
        for delta in step.deltas:
            yield TextDelta(text=delta)
        text = "".join(step.deltas)
        n = len(self.requests)
        content = [TextBlock(text=text)] if step.deltas else []
        content += [ToolUseBlock(id=f"call_{n}_{i}", name=name, input=args) for i, (name, args) in enumerate(step.calls)]
        yield LLMResponse(
            content=content, stop_reason="tool_use" if step.calls else "end_turn",
            usage=Usage(input_tokens=10, output_tokens=3), model=request.model,
        )


def make_env(llm, registry: HandlerRegistry, tools: list, config: BotConfig | None = None) -> TurnEnv:
    catalog = build_catalog([], [(t, 1) for t in tools], registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=config or BotConfig(),
                   main_model="main", cheap_model="cheap")


@pytest.fixture
def registry() -> HandlerRegistry:
    reg = HandlerRegistry()
    calls: list[str] = []

    @reg.register("lookup")
    async def lookup(args, ctx):
        calls.append("lookup")
        return {"found": args.get("q", "")}

    @reg.register("broken")
    async def broken(args, ctx):
        from services.tools.errors import UpstreamStatus
        raise UpstreamStatus("upstream error (500)", status=500)

    @reg.register("lead")
    async def lead(args, ctx):
        return {"lead": "saved"}

    @reg.register("handoff")
    async def handoff(args, ctx):
        return {"handed_off": True}

    reg.calls = calls  # type: ignore[attr-defined]
    return reg


LOOKUP = PythonTool(name="lookup", description="look things up", parameters=SCHEMA, handler="lookup")
WRITE = PythonTool(name="book", description="book a slot", parameters=SCHEMA, handler="lookup", mutability="write")


KEYS = approval_keys(["a" * 44])


def env_for(llm, registry, tools, **env) -> TurnEnv:
    catalog = build_catalog([], [(t, 1) for t in tools], registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(progress_after_ms=50), catalog=catalog, config=BotConfig(),
                   main_model="main", cheap_model="cheap", approval_keys=KEYS, **env)
