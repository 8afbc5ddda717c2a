"""Tensor parallelism, persistence, device memory, topologies, sizing and the plan.

The device mesh and shardings (``mesh``), Orbax checkpoints of params and of the cache
(``checkpoint``), per-device memory tracking (``device_memory``).
"""
