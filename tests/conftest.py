"""Test-session set-up: XLA compiles at backend optimization level 0.

The suite is bound by XLA compiles of tiny programs (hundreds of step, kernel and reference
programs, each run a few times), not by running them. LLVM's optimization passes are most of a
CPU compile, so the tests compile with `--xla_backend_optimization_level=0`: about 30% less wall
time on the suite's compile-heavy files (`tests/test_engine_kimi.py -k cache_on_equals_off`
40.6 s -> 29.5 s; robustness + GDR kernels + MoE 175 s -> 122 s, 2-core VM, one run each). The
level changes how fast the generated code runs, not what it computes (no fast-math either way),
and every comparison in the suite is between programs compiled the same way or against a
tolerance. XLA's older loop emitters compile CPU fusions faster than its fusion emitters
(`--xla_cpu_use_fusion_emitters=false`: the Kimi on=off test 40-43 s -> 22-31 s, one run
each of four, same machine). Both are set in the environment before JAX initialises, so
subprocesses (servers, mesh workers: `tests/multidevice.py` appends its device count) compile
the same way.
`MAMBACACHE_TEST_XLA_OPT=1` keeps XLA's defaults (to run the suite as users compile).

Memory maps: every program XLA compiles for the CPU maps three regions per kernel (code, read-only
data, data; about 40 maps for a small step function), and they stay mapped while JAX's caches hold
the program. A worker compiles thousands of programs over the suite, about 4,000 maps a minute,
and Linux refuses a process's mapping number 65,531 (`vm.max_map_count`): XLA's next compile then
dies of a segmentation fault inside `backend_compile_and_load` (seen twice, 85-93% of the way
through, in whichever file was running). So between two test files, a process holding more than
`MAP_LIMIT` maps drops JAX's compilation caches (`jax.clear_caches()`): programs that only a cache
kept are unmapped; later files compile what they need again.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings

import pytest

if os.environ.get("MAMBACACHE_TEST_XLA_OPT", "0") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        if _flag.split("=")[0] not in _flags:
            _flags = f"{_flags} {_flag}".strip()
    os.environ["XLA_FLAGS"] = _flags
    if "jax" in sys.modules:  # a plugin imported JAX first: the level applies to subprocesses only
        warnings.warn("tests/conftest.py: JAX was imported before XLA_FLAGS was set", stacklevel=1)


MAP_LIMIT = 30_000  # maps; Linux's default vm.max_map_count is 65,530


def map_count() -> int | None:
    """Memory maps this process holds (None where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a file (its module fixtures torn down): past ``MAP_LIMIT`` maps,
    drop JAX's compilation caches so their programs are unmapped (module docstring)."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        maps = map_count()
        if maps is not None and maps > MAP_LIMIT and "jax" in sys.modules:
            import jax

            jax.clear_caches()
            gc.collect()
    return result
