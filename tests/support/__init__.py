"""What tests share: fakes, harnesses and helpers. Test modules import from here, never from
one another (tests/unit/test_test_imports.py checks it).

- `fakes`: the turn's ports faked (scripted LLMs, clock, handlers, tool backend, catalogs).
- `turns`: a turn's environment over a scripted LLM (`ScriptedLLM`, `make_env`, `env_for`).
- `host_fakes`, `placement_fakes`: a session host's store and tenants, Ray and the shard store.
- `host_world`: a SessionHost over those fakes (`World`) and waiting helpers.
- `net_fakes`: loopback-only sockets and a map resolver for the outbound HTTP clients.
- `mcp_server`: a real MCP server on loopback (`ShopMcpServer`).
- `builtin_services`: the built-ins over real Postgres, a webhook receiver.
- `gateways`: in-process gateways over real repositories with a fake session router.
- `api`, `e2e`, `backend`: the end-to-end client (`Api`) and helpers against the real stack.
"""
