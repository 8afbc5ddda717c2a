"""Budget table: the 7B budget mapping, the attention-only oracle, the host-only replay."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.bench.baselines import (
    AttentionOracleCache,
    budget_pools,
    budget_row,
    main,
    markdown,
)
from mambacache.cache.radix import make_cache
from mambacache.cache.replay import as_requests, replay


def _shared_prefix(groups: int, per_group: int, prefix: int, tail: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    heads = rng.integers(1, 500, (groups, prefix)).tolist()
    reqs = [{"prompt": heads[g] + rng.integers(1, 500, tail).tolist(),
             "output": rng.integers(1, 500, 3).tolist()}
            for _ in range(per_group) for g in range(groups)]
    return reqs


def test_budget_mapping():
    assert budget_pools(1) == (8193, 20)  # 1 GiB: half to 26.8 MB states, half to 65.5 KB tokens
    kv, slots = budget_pools(5)
    assert slots == 100 and kv == pytest.approx(5 * 8193, abs=5)
    with pytest.raises(ValueError, match="state slots"):
        budget_pools(0.05)
    with pytest.raises(ValueError, match="state_share"):
        budget_pools(1, state_share=1.0)


def test_oracle_hits_any_cached_prefix():
    cache = AttentionOracleCache(256, 64, 1)
    a = list(range(1, 41))
    replay(cache, as_requests([{"prompt": a, "output": [7, 8]}]))
    b = a[:30] + [99] * 10  # leaves a at 30: no state there in a hybrid tree
    assert cache.match_prefix(b).cached_len == 30
    assert cache.match_prefix(a).cached_len == 39  # identical: all but the last token
    cache.check_integrity()
    plain = make_cache(True, num_pages=256, num_slots=64, speculative_states=False)
    replay(plain, as_requests([{"prompt": a, "output": [7, 8]}]))
    assert plain.match_prefix(b).cached_len == 0


def test_defaults_between_baseline_and_oracle_on_unaligned_prefixes():
    reqs = _shared_prefix(4, 10, 50, 7)  # prefixes of 50: no multiple of the interval
    row = budget_row(reqs, 50, overrides={"cache.checkpoint_interval": 16})
    assert row["baseline"] < row["defaults"] < row["oracle"]
    # oracle: every later request of a group hits the 50-token prefix
    assert row["oracle"] == pytest.approx(36 * 50 / (40 * 57))
    # defaults: the 2nd request of a group resumes at the checkpoint at 48
    assert row["defaults"] == pytest.approx((4 * 48 + 32 * 50) / (40 * 57))
    assert "| 50 GiB |" in markdown([row])


def test_replay_under_pressure_and_never_fitting_requests():
    reqs = _shared_prefix(3, 8, 40, 9, seed=1)
    reqs.insert(5, {"prompt": list(range(1, 400)), "output": [1]})  # never fits 300 pages
    cache = make_cache(True, num_pages=300, num_slots=6)
    res = replay(cache, as_requests(reqs), checkpoint_interval=8, concurrency=3)
    assert res["dropped"] == 1 and res["prompt_tokens"] == 24 * 49
    assert 0 < res["cached_tokens"] < 21 * 40
    assert cache.slots.num_held == 0 and cache.pages.num_held == 0
    cache.check_integrity()


def test_cli(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in _shared_prefix(2, 4, 30, 5)))
    out = tmp_path / "rows.json"
    rows = main(["--trace", str(trace), "--budgets", "1,2", "--out", str(out)])
    assert [r["budget_gib"] for r in json.loads(out.read_text())] == [1.0, 2.0]
    assert all(r["baseline"] <= r["oracle"] for r in rows)


def test_agent_and_synthetic_chat_traces():
    from mambacache.bench.traces import agent_trace, synthetic_chat_trace

    recs = agent_trace(num_sessions=12, num_tools_prompts=2, tools_len=64, seed=2)
    firsts = [r for r in recs if r["turn"] == 0]
    assert len(firsts) == 12 and len({tuple(r["prompt"][:64]) for r in firsts}) == 2
    by_session: dict[int, list] = {}
    for r in recs:
        by_session.setdefault(r["session"], []).append(r)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            head = prev["prompt"] + prev["output"]
            assert nxt["prompt"][:len(head)] == head
    chat = synthetic_chat_trace(num_sessions=10, seed=1)
    assert [r["time_s"] for r in chat] == sorted(r["time_s"] for r in chat)
    assert all(2 <= len([r for r in chat if r["session"] == s]) <= 10 for s in range(10))


def test_shared_budget_columns_and_split_sweep():
    """The shared budget, the sweep of fixed splits and Marconi's LRU over one byte pool, with
    a mapping where a state is the KV of 8 tokens (so the split matters at 400 tokens)."""
    reqs = _shared_prefix(4, 10, 50, 7)
    gib = 400 * 100 / 2**30  # 400 tokens of KV at 100 bytes each
    row = budget_row(reqs, gib, state_bytes=800, kv_bytes_per_token=100)
    assert set(row["splits"]) <= {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}
    assert row["best_split"] == max(row["splits"].values())
    assert row["splits"][row["split_share"]] == row["best_split"]
    assert row["defaults"] == row["splits"][0.5]
    assert 0 < row["best_split"] and 0 < row["lru_shared"]
    assert row["shared"] >= row["best_split"] - 0.005  # the split follows the workload
    assert row["config"]["memory_bytes"] == 40_000 and row["config"]["state_bytes"] == 800
    assert "| shared budget |" in markdown([row])
