"""The runtime: the engine, its scheduler and step loop on top, subpackages by concern below.

Leases (a request's cache state), the step (host plan, batch, buckets), speculative decoding,
sampling, the runners (the model runner, the jitted programs, pools) and the shadow runner.
Imports the host cache and the model; never the benchmark tools or the server; the
import-linter contract ``engine-layers`` keeps the order.

Submodules are imported by their full path (``mambacache.engine.engine.Engine``); this package
imports nothing itself, so the host-only parts (requests, sampling parameters) stay free of JAX.
"""
