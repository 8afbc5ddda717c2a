"""The host tier (``cache/host_tier.py``): demotion on device eviction, promotion on match,
residency, the host byte budget, the replay and the budget table's host column."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.bench.baselines import budget_row, host_markdown
from mambacache.cache.budget import ByteBudget
from mambacache.cache.from_config import make_cache_from_config
from mambacache.cache.host_tier import attach_host_tier
from mambacache.cache.radix import make_cache
from mambacache.cache.replay import as_requests, replay
from mambacache.config import CacheConfig
from tests.radix_helpers import serve

PAGE_B, SLOT_B = 100, 800  # a state is the KV of 8 tokens


def _tiered(device_bytes: int, host_bytes: int, page_size: int = 1):
    budget = ByteBudget(device_bytes, PAGE_B * page_size, SLOT_B)
    cache = make_cache(True, budget.num_pages, budget.num_slots, page_size, "lru",
                       speculative_states=False, budget=budget)
    tier = attach_host_tier(cache, host_bytes)
    seen = []
    if tier is not None:
        tier.on_transfer = seen.append
    return cache, tier, seen


def _conversations(num: int, turns: int, seed: int = 0, reply: int = 6, user: int = 10):
    """Interleaved multi-turn chats: each turn's prompt = the previous prompt + its output + a
    new user part, so every turn resumes from the previous turn's end state."""
    rng = np.random.default_rng(seed)
    convs = [rng.integers(1, 500, 20).tolist() for _ in range(num)]
    out = []
    for _ in range(turns):
        for c in range(num):
            out_ids = rng.integers(1, 500, reply).tolist()
            out.append({"prompt": list(convs[c]), "output": out_ids})
            convs[c] = convs[c] + out_ids + rng.integers(1, 500, user).tolist()
    return out


def test_eviction_demotes_and_a_match_promotes():
    cache, tier, seen = _tiered(6000, 100_000)
    a = list(range(1, 31))
    serve(cache, a, output=(7, 8))
    assert tier.residency(a + [7]) == "device"
    # fill the device with other prompts: a's end state and KV go to the host
    for k in range(4):
        serve(cache, [100 + k] * 30, output=(9, 9))
    assert tier.residency(a + [7]) == "host"
    demote = [t for t in seen if t.to_host]
    assert demote and all(len(t.device_pages) == len(t.host_pages) for t in demote)
    assert cache.match_prefix(a + [7, 50]).cached_len == 0  # not on the device
    assert tier.promote(a + [7, 50]) == 31
    assert tier.residency(a + [7]) == "both"
    promote = seen[-1]
    assert not promote.to_host and len(promote.device_pages) == 31
    assert list(promote.tokens) == a + [7]
    assert cache.match_prefix(a + [7, 50]).cached_len == 31
    assert tier.counters["tokens_promoted"] == 31
    cache.check_integrity()
    # a second eviction of the promoted prefix copies nothing: the host still has it
    before = len(seen)
    for k in range(4):
        serve(cache, [200 + k] * 30, output=(9, 9))
    assert tier.residency(a + [7]) == "host"
    assert all(t.tokens.tolist() != a + [7] for t in seen[before:])
    cache.check_integrity()


def test_speculative_states_are_not_demoted_and_small_hosts_skip():
    cache, tier, seen = _tiered(6000, 2000)  # the host holds 11 tokens + a state
    serve(cache, list(range(1, 31)), output=(7, 8))
    for k in range(4):
        serve(cache, [100 + k] * 30, output=(9, 9))
    assert tier.counters["demotions_skipped"] > 0 and tier.counters["demotions"] == 0
    assert not seen
    cache.check_integrity()


def test_replay_with_a_host_tier_hits_more_and_stays_consistent():
    records = _conversations(8, 4)
    reqs = as_requests(records)
    total = sum(len(p) for p, _ in reqs)
    small, _, _ = _tiered(12_000, 0)
    alone = replay(small, reqs)["cached_tokens"] / total
    big, _, _ = _tiered(200_000, 0)
    roomy = replay(big, reqs)["cached_tokens"] / total
    cache, tier, seen = _tiered(12_000, 188_000)
    res = replay(cache, reqs)
    assert alone < roomy
    assert res["cached_tokens"] / total >= 0.95 * roomy
    assert res["host_hit_tokens"] > 0 and tier.counters["promotions"] > 0
    cache.check_integrity()
    # the transfers add up to the byte counters
    assert sum(t.num_bytes(tier.budget) for t in seen if t.to_host) == \
        tier.counters["bytes_demoted"]
    assert sum(t.num_bytes(tier.budget) for t in seen if not t.to_host) == \
        tier.counters["bytes_promoted"]
    stats = cache.stats()
    assert stats["host_hit_tokens"] == res["host_hit_tokens"]
    assert stats["host_bytes_held"] <= 188_000


def test_paged_tree_with_a_host_tier():
    records = _conversations(6, 3, seed=1, reply=5, user=11)  # ends on page boundaries
    cache, tier, _ = _tiered(12_000, 200_000, page_size=4)
    res = replay(cache, as_requests(records), checkpoint_interval=8, concurrency=3)
    assert res["host_hit_tokens"] > 0
    cache.check_integrity()


def test_config_and_table_column():
    with pytest.raises(ValueError, match="host_memory_bytes"):
        CacheConfig(host_memory_bytes=-1)
    with pytest.raises(ValueError, match="state slot"):  # no byte sizes to count a host budget in
        make_cache_from_config(CacheConfig(host_memory_bytes=10**6))
    cfg = CacheConfig(host_memory_bytes=10**6, state_bytes=SLOT_B, kv_bytes_per_token=PAGE_B)
    assert make_cache_from_config(cfg).host_tier.budget.limit_bytes == 10**6
    assert make_cache_from_config(CacheConfig()).host_tier is None
    row = budget_row(_conversations(8, 4), 12_000 / 2**30, state_bytes=SLOT_B,
                     kv_bytes_per_token=PAGE_B, host_gibs=(188_000 / 2**30,), shared_only=True)
    (host_hit,) = row["host"].values()
    assert host_hit > row["shared"]
    assert "+ host" in host_markdown([row])


def _growing(num: int = 6, sends: int = 3, seed: int = 39) -> list[dict]:
    """Each conversation re-sent ``sends`` times, every re-send the previous prompt + 23 new
    tokens (not its output): only the ``prompt_len - 1`` state is on the next prompt's path."""
    rng = np.random.default_rng(seed)
    convs = [rng.integers(1, 500, int(rng.integers(60, 121))).tolist() for _ in range(num)]
    out = []
    for _ in range(sends):
        out += [{"prompt": list(c), "output": rng.integers(1, 500, 6).tolist()} for c in convs]
        convs = [c + rng.integers(1, 500, 23).tolist() for c in convs]
    return out


def test_speculative_states_are_demoted_when_the_host_has_room():
    got = {}
    for host_bytes in (0, 1_000_000):
        budget = ByteBudget(20_000, PAGE_B * 4, SLOT_B)  # about one conversation on the device
        cache = make_cache(True, budget.num_pages, budget.num_slots, 4, "lru", budget=budget)
        tier = attach_host_tier(cache, host_bytes)
        got[host_bytes] = replay(cache, as_requests(_growing()))
        cache.check_integrity()
    assert got[0]["cached_tokens"] == 0  # the bets were dropped: nothing to resume from
    assert tier.counters["speculative_demotions"] > 0
    tiered = got[1_000_000]
    assert tiered["host_hit_tokens"] > 0 and tiered["cached_tokens"] == tiered["host_hit_tokens"]


def test_a_speculative_demotion_never_pushes_out_a_firm_host_state():
    budget = ByteBudget(100_000, PAGE_B, SLOT_B)
    cache = make_cache(True, budget.num_pages, budget.num_slots, 1, "lru", budget=budget)
    tier = attach_host_tier(cache, 4000)  # one firm state with the KV of its 31 tokens
    a, b = list(range(1, 31)), list(range(100, 130))
    serve(cache, a, output=(7, 8))
    serve(cache, b, output=(7, 8))
    assert tier.demote(cache.locate(a + [7])[2])  # firm: 31 pages + a state = 3,900 bytes
    bet = cache.locate(b[:29])[2]  # b's prompt_len - 1 snapshot
    assert bet.spec
    assert not tier.demote(bet)  # 100 bytes free and no bet on the host to replace
    assert tier.counters["demotions_skipped"] == 1
    assert tier.residency(a + [7]) == "both" and tier.residency(b[:29]) == "device"
    tier.check()


def test_host_order_is_saving_per_byte():
    """The host tree ranks by expected saving per byte: a deep state outlives a shallow one
    demoted after it; the device's LRU would drop the deep one first."""
    from mambacache.cache.eviction import make_policy

    budget = ByteBudget(10**6, PAGE_B, SLOT_B)
    host = make_cache(True, budget.num_pages, budget.num_slots, 1, "saving_per_byte",
                      speculative_states=False, budget=budget)
    deep, shallow = list(range(1, 201)), list(range(500, 505))
    for prompt in (deep, shallow):
        pages = host.alloc_pages(len(prompt))
        host.insert(prompt, pages, {len(prompt): int(host.alloc_slots(1)[0])})
    first = host.policy.byte_victims(host, 1)[0]
    assert first.depth == len(shallow)
    assert make_policy("lru").byte_victims(host, 1)[0].depth == len(deep)
    with pytest.raises(ValueError, match="attn_quadratic_tokens"):
        make_policy("saving_per_byte", attn_quadratic_tokens=0)
