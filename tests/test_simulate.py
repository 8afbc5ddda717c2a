"""The trace simulator: CLI, result keys, identical-prompt hits, pressure without crashes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mambacache.bench.simulate import (
    identical_prompt_trace,
    load_trace,
    main,
    shared_prefix_trace,
    simulate,
    write_trace,
)
from mambacache.config import CacheConfig

KEYS = ("prompt_tokens", "cached_tokens", "hit_rate", "us_per_request", "snapshots_kept",
        "snapshots_skipped", "snapshots_evicted", "peak_token_usage", "peak_mamba_usage")


@pytest.mark.parametrize("page_size", [1, 16])
def test_identical_prompts_cache_all_but_last_token(page_size):
    n = 6
    cfg = CacheConfig(page_size=page_size, num_kv_tokens=8192, num_mamba_slots=8)
    res = simulate(identical_prompt_trace(n, 1000, output_len=1), cfg, check_integrity=True)
    per_hit = 999 // page_size * page_size
    assert res["prompt_tokens"] == n * 1000
    assert res["cached_tokens"] == (n - 1) * per_hit
    assert res["hit_rate"] == pytest.approx((n - 1) * per_hit / (n * 1000))


def test_cli_writes_result(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix_trace(40, 2, 64, 8, output_len=3, vocab_size=100))
    assert len(load_trace(trace)) == 40
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cache]\nnum_kv_tokens = 4096\nnum_mamba_slots = 16\n[workload]\nx = 1\n")
    out = tmp_path / "r.json"
    res = main(["--trace", str(trace), "--config", str(cfg), "--set", "cache.page_size=4",
                "--concurrency", "4", "--out", str(out), "--check-integrity"])
    saved = json.loads(out.read_text())
    for key in KEYS:
        assert key in saved and saved[key] == res[key]
    assert saved["config"]["page_size"] == 4
    assert 0 < saved["hit_rate"] < 1
    assert saved["requests_dropped"] == 0


def test_engine_host_time_excludes_the_oracle():
    """``engine_us_per_*`` are the engine's own time: every step's, less the shadow runner's."""
    trace = shared_prefix_trace(24, 2, 64, 8, output_len=4, vocab_size=100)
    res = simulate(trace, CacheConfig(page_size=4, num_kv_tokens=4096, num_mamba_slots=16),
                   concurrency=4)
    assert res["engine_us_per_step"] > 0
    # every request's share comes from the steps, and steps without rows add only to the sum
    assert res["engine_us_per_request"] >= res["us_per_request_mean"] * (1 - 1e-9) > 0


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
def test_pressure_on_both_pools_never_raises(eviction):
    trace = shared_prefix_trace(120, 4, 48, 16, output_len=4, vocab_size=50, seed=1)
    cfg = CacheConfig(num_kv_tokens=600, num_mamba_slots=8, eviction=eviction)
    res = simulate(trace, cfg, concurrency=5, check_integrity=True)
    assert res["num_requests"] + res["requests_dropped"] == 120
    assert res["num_requests"] > 100
    assert res["snapshots_evicted"] > 0
    assert res["peak_mamba_usage"] > 0.6 and res["peak_token_usage"] > 0.4
    roomy = simulate(trace, CacheConfig(num_kv_tokens=2000, num_mamba_slots=24,
                                        eviction=eviction), concurrency=5, check_integrity=True)
    assert roomy["hit_rate"] > 0.3  # shared 48-token prefixes of 64-token prompts


def test_disabled_cache_never_hits():
    cfg = CacheConfig(enable=False, num_kv_tokens=4096, num_mamba_slots=4)
    res = simulate(identical_prompt_trace(5, 100), cfg, concurrency=2, check_integrity=True)
    assert res["cached_tokens"] == 0 and res["snapshots_kept"] == 0


def test_request_that_can_never_fit_is_dropped():
    cfg = CacheConfig(num_kv_tokens=64, num_mamba_slots=4)
    trace = identical_prompt_trace(1, 100) + identical_prompt_trace(2, 10, seed=3)
    res = simulate(trace, cfg)
    assert res["requests_dropped"] == 1 and res["num_requests"] == 2


def test_host_modules_import_no_jax():
    import subprocess
    import sys

    code = ("import sys, mambacache.bench.simulate, mambacache.cache.radix, "
            "mambacache.cache.snapshot_plan, mambacache.cache.allocator, mambacache.cache.disabled;"
            " assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_run_reports_bytes_and_shares_them(tmp_path):
    """One byte budget (--set cache.memory_bytes, --state-bytes, --kv-bytes-per-token): pools
    derived, bytes held within the budget at the peak, both kinds evicted from one budget."""
    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix_trace(60, 4, 48, 8, output_len=3, vocab_size=100))
    res = main(["--trace", str(trace), "--set", "cache.memory_bytes=20000", "--state-bytes",
                "400", "--kv-bytes-per-token", "20", "--set", "cache.page_size=4",
                "--concurrency", "3", "--check-integrity"])
    assert res["state_bytes"] == 400 and res["kv_bytes_per_token"] == 20
    assert res["num_kv_tokens"] == (20000 - 400) // 80 * 4 and res["num_mamba_slots"] == 49
    assert 0 < res["peak_bytes_held"] <= 20000
    assert res["peak_kv_bytes_held"] > 0 and res["peak_state_bytes_held"] > 0
    assert res["kv_bytes_held"] + res["state_bytes_held"] <= 20000
    assert res["snapshots_evicted"] > 0 and res["pages_evicted"] > 0
    assert 0 < res["hit_rate"] < 1 and res["requests_dropped"] == 0
    with pytest.raises(ValueError, match="cannot hold one request of the context"):
        main(["--trace", str(trace), "--set", "cache.memory_bytes=1500", "--state-bytes",
              "400", "--kv-bytes-per-token", "20"])


@pytest.mark.parametrize("sizes", [True, False])
def test_a_budget_capped_by_explicit_pools_is_logged(tmp_path, caplog, sizes):
    """--set cache.memory_bytes with both pool sizes explicit: the run is capped at the pools'
    bytes, and a warning names the cap (byte sizes given, or the preset's: the issue's
    ``--config configs/tiny_qwen3_next.toml`` case when it pinned 16,384 tokens / 64 slots)."""
    import logging

    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix_trace(4, 2, 16, 4, output_len=2, vocab_size=100))
    args = ["--trace", str(trace), "--set", "cache.memory_bytes=5000000000", "--set",
            "cache.num_kv_tokens=16384", "--set", "cache.num_mamba_slots=64"]
    if sizes:
        args += ["--state-bytes", "26800000", "--kv-bytes-per-token", "65526"]
    with caplog.at_level(logging.WARNING, logger="mambacache.cache.budget"):
        res = main(args)
    assert res["num_kv_tokens"] == 16384 and res["num_mamba_slots"] == 64
    (rec,) = [r for r in caplog.records if "capped at" in r.getMessage()]
    cap = 16384 * 65526 + 64 * 26800000 if sizes else None
    assert "cache budget 5000000000 bytes is capped" in rec.getMessage()
    assert cap is None or f"capped at {cap} bytes" in rec.getMessage()


def test_host_tier_run_hits_more_on_the_same_device_budget(tmp_path):
    """The simulator with a host tier (--set cache.host_memory_bytes): interleaved multi-turn
    chats on a device budget that holds about two of them; every copy between the tiers
    checked by the shadow runner, more hits than the device budget alone."""
    rng = np.random.default_rng(5)
    convs = [rng.integers(1, 100, 30).tolist() for _ in range(8)]
    records = []
    for _ in range(4):
        for c in range(8):
            out = rng.integers(1, 100, 6).tolist()
            records.append({"prompt": list(convs[c]), "output": out})
            convs[c] = convs[c] + out + rng.integers(1, 100, 10).tolist()
    trace = tmp_path / "t.jsonl"
    write_trace(trace, records)
    args = ["--trace", str(trace), "--set", "cache.memory_bytes=8000", "--state-bytes", "400",
            "--kv-bytes-per-token", "20", "--concurrency", "2"]
    alone = main(args)
    tier = main(args + ["--set", "cache.host_memory_bytes=60000"])
    assert "host_hit_tokens" not in alone
    assert tier["host_hit_tokens"] > 0 and tier["promotions"] > 0
    assert tier["hit_rate"] > alone["hit_rate"]
    assert 0 < tier["host_bytes_held"] <= 60000
