"""JAX's persistent compile cache, on by default: a second start of the same configuration loads
its step programs from disk instead of compiling them.

``use_compile_cache(cfg.compile)`` (called by ``Engine`` before it loads the model, and by the
plan) points ``jax_compilation_cache_dir`` at ``compile.cache_dir``: ``"auto"`` is
``$MAMBACACHE_COMPILE_CACHE_DIR`` when that is set (empty: off; the test session sets it), else
``$XDG_CACHE_HOME/mambacache/jax`` (``~/.cache/mambacache/jax``); ``""`` or ``"off"`` turns the
cache off; anything else is the directory. Every program is cached whatever its compile time
(``jax_persistent_cache_min_compile_time_secs = 0``) and size
(``jax_persistent_cache_min_entry_size_bytes = -1``: no limit, no filesystem override).

An entry is the serialized executable of the whole step, keyed by its HLO, the compile options,
the backend and jaxlib's version, so a change of model, shape, dtype, mesh, flag or jax version is
a miss, never a stale hit. The Pallas kernels are part of it: on TPU the Mosaic kernels are custom
calls that libtpu compiles into the executable; on GPU the Triton kernels are compiled to cubins
by XLA into the executable (and the fused GEMMs' autotuning results go to XLA's own cache beside
it, ``jax_persistent_cache_enable_xla_caches``); on CPU the kernels run interpreted, lowered to
plain XLA ops of the same program. Programs with host callbacks are not cached by JAX. libtpu's
compile-only topologies (the plan's) write entries but cannot load them back (no client to
deserialize into), so the plan uses the cache only for ``--topology local``.

Invariants: process-wide (JAX's config), set once per directory: pointing it elsewhere resets
JAX's cache object so the next compile uses the new one. Host only, no device allocation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from absl import logging

#: the environment variable that ``compile.cache_dir = "auto"`` reads first (empty: off)
ENV_DIR = "MAMBACACHE_COMPILE_CACHE_DIR"
OFF = ("", "off", "none")

_current: str | None = None


def resolve_cache_dir(cache_dir: str) -> str | None:
    """The directory ``compile.cache_dir`` names (module docstring), None when off."""
    if cache_dir.strip().lower() in OFF:
        return None
    if cache_dir != "auto":
        return str(Path(cache_dir).expanduser())
    if ENV_DIR in os.environ:
        env = os.environ[ENV_DIR]
        return None if env.strip().lower() in OFF else str(Path(env).expanduser())
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "mambacache" / "jax")


def use_compile_cache(compile_cfg: Any) -> str | None:
    """Point JAX's persistent cache at ``compile_cfg.cache_dir`` (or turn it off); returns the
    directory in use, None when off."""
    global _current
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = resolve_cache_dir(compile_cfg.cache_dir)
    if path == _current:
        return path
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # JAX decides once whether (and where) it caches
    _current = path
    logging.info("persistent compile cache: %s", path or "off")
    return path


def cache_entries(path: str | None) -> int:
    """Executables stored under ``path`` (0 when off or absent)."""
    if not path or not os.path.isdir(path):
        return 0
    return sum(1 for name in os.listdir(path) if name.endswith("-cache"))
