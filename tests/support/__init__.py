"""What tests share: fakes, harnesses and helpers, in one place. Test modules (`test_*.py`) import
from here and never from one another, nor from a conftest.py (tests/unit/test_test_imports.py
fails naming any such import). A fixture shared this way is bound by name in the module that uses
it: `world = host_world.world  # the fixture`.

Fakes (no Postgres, no Ray, no network):
- `fakes`: the turn's ports (scripted streaming LLM, clock, handlers, tool backend, catalogs).
- `turns`: a turn over a scripted model (`ScriptedLLM`, `make_env`, `env_for`, the `registry`
  fixture and the tools `LOOKUP`, `WRITE`).
- `host_fakes`, `placement_fakes`: a session host's store and tenants; Ray and the shard store.
- `host_world`: session hosts over those fakes (`World`, the `world` fixture, `eventually`, `spin`).
- `catalog_fakes`: the tool repository a host's catalogs read.
- `contract`: a backend binding tool and a backend the contract report never calls.
- `net_fakes`: a map resolver, loopback-only sockets (the `sockets` fixture), a loopback app.
- `tracing`: one in-memory span exporter for the run (the `spans` fixture).
- `waits`: `spin(until)` on the event loop.

Harnesses (real Postgres or real servers on loopback):
- `postgres`: `database_url`, another database on the test server.
- `gateways`: in-process gateways over the real repositories, the router faked (`FakeRouter`,
  `gateway`, `problem_of`; `ScriptedRouter`, `scripted_gateway`; `documented_gateway`;
  `OriginGateway`).
- `builtin_services`, `appointments`: the built-in tools over Postgres, a webhook receiver.
- `mcp_server`: a real MCP server on loopback (`ShopMcpServer`).
- `cli`: the CLI run as a subprocess.

End to end (the real stack):
- `api`: `Api`, a tenant's client of the gateway, and small POST/SSE helpers.
- `e2e`: new tenants, `/call` lines, order tools, conversations checked against the database.
- `backend`: a tenant's backend on loopback for the e2e tests.
"""
