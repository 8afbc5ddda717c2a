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
Only flags the running XLA knows are set (a subprocess probe once per session): XLA aborts on an
unknown flag, and jax >= 0.11 no longer has `--xla_cpu_use_fusion_emitters` (it compiles CPU
fusions with the fusion emitters only).

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
import subprocess
import sys
import warnings

import pytest

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_knows(flags: list[str]) -> bool:
    """Does the installed XLA accept ``flags``? XLA aborts the process on a flag it does not
    know (jax >= 0.11 dropped ``--xla_cpu_use_fusion_emitters``), so ask a subprocess that
    starts the CPU backend with them (about a second)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def known_test_flags(flags: tuple[str, ...]) -> list[str]:
    """The test flags the running XLA knows: all of them when it takes them together (one
    probe), else each probed on its own."""
    if xla_knows(list(flags)):
        return list(flags)
    return [flag for flag in flags if xla_knows([flag])]


# workers (xdist) and subprocesses inherit the controller's environment: probe once per session
if (os.environ.get("MAMBACACHE_TEST_XLA_OPT", "0") != "1"
        and os.environ.get("MAMBACACHE_TEST_XLA_PROBED") != "1"):
    _flags = os.environ.get("XLA_FLAGS", "")
    _missing = tuple(f for f in TEST_XLA_FLAGS if f.split("=")[0] not in _flags)
    for _flag in known_test_flags(_missing) if _missing else []:
        _flags = f"{_flags} {_flag}".strip()
    os.environ["XLA_FLAGS"] = _flags
    os.environ["MAMBACACHE_TEST_XLA_PROBED"] = "1"
    if "jax" in sys.modules:  # a plugin imported JAX first: the level applies to subprocesses only
        warnings.warn("tests/conftest.py: JAX was imported before XLA_FLAGS was set", stacklevel=1)


# The persistent compile cache (mambacache/engine/runners/compile_cache.py) is off in the test
# session and its subprocesses: nothing written into the user's home; tests that want it name a tmp
# dir.
os.environ.setdefault("MAMBACACHE_COMPILE_CACHE_DIR", "")


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
