"""Tools around the engine: benchmarks, workloads, traces and the simulator.

Workloads, one timed pass (``runner``), the report, the benchmark CLI (``python -m
mambacache.bench``, in ``cli``) and the trace simulator (``simulate``). The engine never
imports this package.
"""
