"""Test-session set-up: XLA compiles at backend optimization level 0.

The suite is bound by XLA compiles of tiny programs (hundreds of step, kernel and reference
programs, each run a few times), not by running them. LLVM's optimization passes are most of a
CPU compile, so the tests compile with `--xla_backend_optimization_level=0`: about 30% less wall
time on the suite's compile-heavy files (`tests/test_engine_kimi.py -k cache_on_equals_off`
40.6 s -> 29.5 s; robustness + GDR kernels + MoE 175 s -> 122 s, 2-core VM, one run each). The
level changes how fast the generated code runs, not what it computes (no fast-math either way),
and every comparison in the suite is between programs compiled the same way or against a
tolerance. It is set in the environment before JAX initialises, so subprocesses (servers, mesh
workers: `tests/multidevice.py` appends its device count) compile the same way.
`MAMBACACHE_TEST_XLA_OPT=1` keeps XLA's default level (to run the suite as users compile).
"""

from __future__ import annotations

import os
import sys
import warnings

if os.environ.get("MAMBACACHE_TEST_XLA_OPT", "0") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()
    if "jax" in sys.modules:  # a plugin imported JAX first: the level applies to subprocesses only
        warnings.warn("tests/conftest.py: JAX was imported before XLA_FLAGS was set", stacklevel=1)
