"""The fakes in tests implement the ports their consumers declare, and so do the adapters.

Two checks. `runtime_checkable` Protocols let `isinstance` say that each fake has every method
of its port (names only). mypy checks the rest: `_as_their_ports` below assigns each fake, and
each adapter, to a variable annotated with its port, and mypy (run on this file by
`test_fakes_and_adapters_conform_to_their_ports_under_mypy`, configured in pyproject.toml) fails
on any method missing, any argument renamed, added without a default, or of another type, and any
return type that does not fit. A fake that drifts from its port fails here, not in a test that
happens to call the method it lost.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.host import JobSource, SessionStore, TenantSource
from actors.local import LocalRouter
from actors.placement import Placement, ShardStore
from actors.ray_host import ShardSource
from actors.session import HandoffDesk, ToolExecutor
from services.builtins.handoff import HandoffService, HandoffStore
from services.gateway.common import SessionRouter
from services.llm.anthropic_client import AnthropicLLM
from services.llm.port import LLMClient
from services.tools.executor import Executor
from services.tools.limiter import Clock, SystemClock
from services.tools.mcp import McpServerStore
from services.tools.registry import Handler, ToolBackend
from services.tools.webhook import WebhookToolBackend
from storage.repos.builtins import HandoffRepo
from storage.repos.cluster import ClusterRepo
from storage.repos.jobs import JobRepo
from storage.repos.mcp_servers import McpServerRepo
from storage.repos.sessions import SessionRepo
from tests.support.fakes import FakeClock, FakeHandler, FakeToolBackend
from tests.support.host_fakes import FakeHandoffDesk, FakeSessionStore, FakeTenants, RuleModel
from tests.support.placement_fakes import FakeShardStore

ROOT = Path(__file__).resolve().parents[2]


def _as_their_ports(
    anthropic: AnthropicLLM, sessions: SessionRepo, jobs: JobRepo, cluster: ClusterRepo,
    placement: Placement, local: LocalRouter, webhooks: WebhookToolBackend, mcp_servers: McpServerRepo,
    handoff_repo: HandoffRepo, handoff_service: HandoffService,
) -> None:
    """Never called: mypy reads it. Each line states that a class implements a port."""
    # the fakes the unit tests run the turn with
    llm: LLMClient = RuleModel()
    store: SessionStore = FakeSessionStore()
    tenants: TenantSource = FakeTenants()
    executor: ToolExecutor = Executor()
    clock: Clock = FakeClock()
    backend: ToolBackend = FakeToolBackend()
    handler: Handler = FakeHandler("lookup")
    shard_store: ShardStore = FakeShardStore()
    shard_source: ShardSource = FakeShardStore()
    # the adapters the engine runs with
    llm = anthropic
    store = sessions
    job_source: JobSource = jobs
    shard_store = cluster
    shard_source = cluster
    router: SessionRouter = placement
    router = local
    backend = webhooks
    clock = SystemClock()
    servers: McpServerStore = mcp_servers
    handoffs: HandoffStore = handoff_repo
    desk: HandoffDesk = FakeHandoffDesk()
    desk = handoff_service
    del desk, handoffs, servers, llm, store, tenants, executor, clock, backend, handler, shard_store, shard_source, job_source, router


@pytest.mark.parametrize(("fake", "port"), [
    (RuleModel, LLMClient),
    (FakeSessionStore, SessionStore),
    (FakeTenants, TenantSource),
    (Executor, ToolExecutor),
    (FakeShardStore, ShardStore),
    (FakeShardStore, ShardSource),
    (FakeHandoffDesk, HandoffDesk),
])
def test_each_fake_has_every_method_of_its_port(fake: type, port: type) -> None:
    assert isinstance(fake(), port), f"{fake.__name__} lacks a method of {port.__name__}"


def test_fakes_and_adapters_conform_to_their_ports_under_mypy() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-color-output", str(Path(__file__).relative_to(ROOT))],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, f"a fake or an adapter drifted from its port:\n{result.stdout}{result.stderr}"
