"""The runtime: engine, scheduler, requests, the model runner, batches, device pools, sampling
and metrics. Imports the host cache and the model; never the benchmark tools or the server.

Submodules are imported by their full path (``mambacache.engine.engine.Engine``); this package
imports nothing itself, so the host-only parts (requests, sampling parameters) stay free of JAX.
"""
