"""The host-only prefix cache: allocators, the radix tree, eviction, the snapshot plan.

Also the integrity check, the disabled cache, the host tier and tree <-> plain data.

Nothing here imports JAX, the engine or the tools around it (an import-linter contract in
pyproject.toml, checked by ``tests/test_import_rules.py``): the tree deals in numpy int ids of KV
pages and state slots, never in device arrays, so the simulator and the engine share it.
"""
