"""GET /metrics answers an operator, not the public (issue 39): its `tool` labels name every
tenant's tools and each scrape reads every host. With CE_METRICS_TOKEN set, only a request
sending it; without one, only a loopback peer. Over HTTP on loopback with the real Postgres."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from kernel.errors import ConfigError, Forbidden, Unauthorized
from services.gateway.app import build_app
from services.gateway.ops_routes import metrics_refusal
from services.settings import Settings
from storage.repos.jobs import JobRepo
from tests.support.gateways import repo_deps

TOKEN = "metrics-operator-token-0123456789abcdef"


@pytest.mark.parametrize("remote,authorization,token,refused", [
    ("127.0.0.1", None, None, None),
    ("127.8.9.10", None, None, None),
    ("::1", None, None, None),
    ("10.0.0.7", None, None, Forbidden),  # a pod network peer, no token set: the public is refused
    ("203.0.113.5", f"Bearer {TOKEN}", None, Forbidden),  # a token sent where none is set opens nothing
    (None, None, None, Forbidden),
    ("10.0.0.7", f"Bearer {TOKEN}", TOKEN, None),
    ("10.0.0.7", None, TOKEN, Unauthorized),
    ("10.0.0.7", f"Bearer {TOKEN[:-1]}", TOKEN, Unauthorized),
    ("10.0.0.7", TOKEN, TOKEN, Unauthorized),  # the scheme is part of it
    ("127.0.0.1", None, TOKEN, Unauthorized),  # with a token set, loopback needs it too
])
def test_who_may_read_metrics(remote, authorization, token, refused):
    answer = metrics_refusal(remote, authorization, token)
    if refused is None:
        assert answer is None
    else:
        assert isinstance(answer, refused)
        assert "CE_METRICS_TOKEN" in str(answer) and TOKEN not in str(answer)


@pytest.mark.parametrize("value", ["short", "x" * 23, "has a space but is long enough"])
def test_a_weak_metrics_token_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="CE_METRICS_TOKEN must be at least 24 characters"):
        Settings.from_env({"CE_METRICS_TOKEN": value})


def test_the_metrics_token_is_read_and_never_shown():
    settings = Settings.from_env({"CE_METRICS_TOKEN": TOKEN})
    assert settings.metrics_token == TOKEN and TOKEN not in repr(settings)
    assert Settings.from_env({}).metrics_token is None


@pytest_asyncio.fixture
async def gateway(pool) -> AsyncIterator[TestClient]:
    deps = repo_deps(pool, jobs=JobRepo(pool), metrics_token=TOKEN)
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client


async def test_with_a_token_set_metrics_answers_only_a_request_that_sends_it(gateway):
    r = await gateway.get("/metrics")
    problem = await r.json()
    assert r.status == 401 and "Authorization: Bearer <CE_METRICS_TOKEN>" in problem["detail"], problem
    assert (await gateway.get("/metrics", headers={"Authorization": "Bearer wrong"})).status == 401
    r = await gateway.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and "ce_messages_total" in await r.text()
    assert (await gateway.get("/healthz")).status == 200  # the other operations routes stay open
