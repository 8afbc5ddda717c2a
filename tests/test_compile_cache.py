"""The persistent compile cache (``engine/runners/compile_cache.py``) and the warm-up's
ahead-of-time compiles (``engine/runners/warmup.py``): a second start of the same configuration
compiles nothing, and serves the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mambacache.config import EngineConfig
from mambacache.engine.runners.compile_cache import ENV_DIR, cache_entries, resolve_cache_dir

# one engine start: the warm-up's report and a greedy generation, as one JSON line
START = """
import json, sys
import mambacache as mc
from mambacache.engine.engine import Engine
cfg = mc.EngineConfig.load(None, json.loads(sys.argv[1]))
engine = Engine(cfg)
warm = engine.warmup(32)
out = engine.generate([[5, 17, 3, 99, 4, 4, 4]], mc.SamplingParams(max_new_tokens=4))
print(json.dumps({"warm": warm, "tokens": out[0].output_token_ids,
                  "after": engine.metrics()["programs_compiled"]}))
"""
SMALL = {"model.kernels": "reference", "scheduler.max_running_requests": 4,
         "scheduler.chunked_prefill_size": 16, "cache.page_size": 16}


def _start(overrides: dict, **env_vars: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_vars}
    run = subprocess.run([sys.executable, "-c", START, json.dumps(overrides)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "jax"
    first = _start(SMALL | {"compile.cache_dir": str(cache)})
    warm = first["warm"]
    # ahead of time: each program compiled once (the run after it compiles nothing more)
    assert warm["ahead_of_time"] and warm["compiles"] == warm["programs"] >= 3, warm
    assert len(warm["program_list"]) == warm["programs"]
    assert all(p["seconds"] > 0 for p in warm["program_list"])
    assert cache_entries(str(cache)) >= warm["programs"]
    second = _start(SMALL | {"compile.cache_dir": str(cache)})
    assert second["warm"]["compiles"] == 0, second["warm"]
    assert second["warm"]["cache_hits"] == warm["programs"]
    assert second["tokens"] == first["tokens"] and second["after"] == first["after"] == 0


def test_off_writes_nothing_and_the_sequential_warmup_compiles_the_same_set(tmp_path):
    # "off" wins over the directory "auto" would take
    run = _start(SMALL | {"compile.cache_dir": "off", "compile.ahead_of_time": False},
                 **{ENV_DIR: str(tmp_path / "env")})
    warm = run["warm"]
    assert not warm["ahead_of_time"] and warm["cache_hits"] == 0
    assert warm["compiles"] == warm["programs"]
    assert not (tmp_path / "env").exists()


def test_auto_is_the_environment_then_the_users_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "env"))
    assert resolve_cache_dir("auto") == str(tmp_path / "env")
    monkeypatch.setenv(ENV_DIR, "")
    assert resolve_cache_dir("auto") is None  # the test session's default: off
    monkeypatch.delenv(ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("auto") == str(tmp_path / "xdg" / "mambacache" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve_cache_dir("auto") == str(Path.home() / ".cache" / "mambacache" / "jax")
    assert resolve_cache_dir("off") is None and resolve_cache_dir("") is None
    assert resolve_cache_dir(str(tmp_path / "x")) == str(tmp_path / "x")


def test_the_test_session_never_caches_into_home():
    assert os.environ.get(ENV_DIR) == ""  # tests/conftest.py
    assert EngineConfig().compile.cache_dir == "auto"


@pytest.mark.parametrize("key,value", [("compile.threads", -1), ("compile.threads", 1000),
                                       ("compile.ahead_of_time", "yes"),
                                       ("compile.cache_dir", 3)])
def test_bad_compile_keys_are_errors_naming_the_value(key, value):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EngineConfig().replace(**{key: value})
