"""The soak command (``mambacache/bench/soak.py``) end to end, small: a server child, three short
phases of concurrent clients (some dropped mid-answer): no request fails, the pools are back at 0
after each phase and the server's RSS levels off. Slow (the child compiles its program set):
``pytest -q -m slow -n 0 tests/test_serve_soak.py``."""

from __future__ import annotations

import os

import pytest

from mambacache.bench.soak import main, proc_memory_mb


def test_proc_memory_reads_this_process():
    mem = proc_memory_mb(os.getpid())
    assert 0 < mem["rss_mb"] <= mem["peak_rss_mb"]


@pytest.mark.slow
def test_short_soak_levels_off(tmp_path):
    out = main(["--phases", "4", "--phase-s", "8", "--clients", "16", "--max-tokens", "4",
                "--disconnect-every", "5", "--set", "serve.warmup_max_seq_len=1024",
                "--out", str(tmp_path / "soak.json")])
    phases = out["phases"][1:]
    for p in phases:
        assert set(p["requests"]) <= {"200", "dropped"}, p
        assert p["kv_pool_usage"] == 0 and p["state_pool_usage"] == 0, p
    assert sum(p["requests"].get("200", 0) for p in phases) > 0
    assert out["rss_growth_last_half_mb"] < 8.0, [p["rss_mb"] for p in phases]
