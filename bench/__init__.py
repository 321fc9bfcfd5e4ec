"""Measurement programs: `make bench` (measure, report), the flush and model-call
micro-benchmarks (flush, llm), `make loadtest` (loadtest, locustfile) and `make soak` (soak).

The top layer: it imports every layer below it (app, actors, services, storage) and nothing
imports it but the tests. Runs of `make bench` are kept as data under bench/results/.
"""
