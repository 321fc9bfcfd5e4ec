"""The application layer: entry points and wiring.

`chat-engine` (cli), the local stack of `make run` (stack), the shard command (shards), the
terminal chat client, and the demo doubles a local run and the tests use in place of the real
outside world: the demo store (a tenant's backend) and the local model (the model API) with its
rules. It imports actors/, services/ and storage/; nothing below imports it.
"""
