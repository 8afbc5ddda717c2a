"""The host tier in the engine: multi-turn conversations on a device pool too small for them,
served from host-resident states and KV, exact against the cache off (model) and checked read by
read (shadow runner: every copy between the tiers against the prefix it claims)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from shadow_helpers import greedy, shadow_engine

from mambacache.cache.host_tier import HostTier
from mambacache.engine.shadow_runner import DataflowError
from tests.engine_helpers import assert_same_outputs, make_engine, tiny_model

SHADOW_TIER = {"cache.num_kv_tokens": 160, "cache.num_mamba_slots": 6,
               "cache.state_bytes": 16, "cache.kv_bytes_per_token": 1,
               "scheduler.max_running_requests": 3}


def _conversations(engine, turns: int, convs: int, first: int, user: int, new: int,
                   seed: int = 3, vocab: int = 1000, per_step=None):
    """``convs`` interleaved chats, each turn = the previous prompt + its answer + a user part;
    returns every output in order."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, first).tolist() for _ in range(convs)]
    outs = []
    for _ in range(turns):
        got = engine.generate(prompts, greedy(new))
        outs += got
        prompts = [p + o.output_token_ids + rng.integers(1, vocab, user).tolist()
                   for p, o in zip(prompts, got, strict=True)]
    return outs


@pytest.mark.parametrize("overlap,page_size", [(True, 1), (False, 4)])
def test_shadow_multi_turn_served_from_the_host(overlap, page_size):
    cfg = {**SHADOW_TIER, "cache.page_size": page_size, "scheduler.overlap": overlap}
    tier = shadow_engine(**cfg, **{"cache.host_memory_bytes": 100_000})
    plain = shadow_engine(**cfg)
    outs = _conversations(tier, 4, 6, 30, 7, 5)
    base = _conversations(plain, 4, 6, 30, 7, 5)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in base]
    m, p = tier.metrics(), plain.metrics()
    assert m["host_hit_tokens"] > 0 and m["promotions"] > 0 and m["demotions"] > 0
    assert m["computed_prefill_tokens"] < p["computed_prefill_tokens"]
    assert tier.runner.transfers == m["promotions"] + m["demotions"]
    assert 0 < m["host_usage"] <= 1 and m["bytes_promoted"] > 0
    tier.check_integrity()  # idle: nothing leaked, on the device or on the host


def test_shadow_finds_a_promotion_of_the_wrong_state(monkeypatch):
    orig = HostTier._issue

    def wrong(self, t):  # a promotion that reads the neighbouring host slot
        if not t.to_host:
            t = type(t)(**{**t.__dict__, "host_slot": t.host_slot + 1})
        return orig(self, t)

    monkeypatch.setattr(HostTier, "_issue", wrong)
    eng = shadow_engine(**SHADOW_TIER, **{"cache.host_memory_bytes": 100_000})
    with pytest.raises(DataflowError, match="promoted state"):
        _conversations(eng, 4, 6, 30, 7, 5)


def test_model_multi_turn_exact_with_a_host_tier():
    """The tiny model, fp32: a device pool that holds about one conversation and a host tier:
    tokens identical to the cache off, logprobs within 1e-4; computed prefill tokens and the
    time per run against the same cache without the tier, side by side."""
    small = {"cache.num_kv_tokens": 192, "cache.num_mamba_slots": 6, "cache.page_size": 4,
             "scheduler.max_running_requests": 3}
    vocab = tiny_model()[0].vocab_size
    runs, outs = {}, {}
    for name, extra in (("off", {"cache.enable": False}), ("device", {}),
                        ("tier", {"cache.host_memory_bytes": 50_000_000})):
        eng = make_engine(**small, **extra)
        t0 = time.perf_counter()
        outs[name] = _conversations(eng, 3, 4, 40, 9, 7, vocab=vocab)
        runs[name] = (eng.metrics(), time.perf_counter() - t0)
        eng.check_integrity()
    assert_same_outputs(outs["tier"], outs["off"])
    assert_same_outputs(outs["device"], outs["off"])
    tier, device = runs["tier"][0], runs["device"][0]
    assert tier["host_hit_tokens"] > 0
    assert tier["computed_prefill_tokens"] < device["computed_prefill_tokens"]
    assert tier["bytes_promoted"] > 0 and tier["load_wait_s"] >= 0
    print({k: (v[0]["computed_prefill_tokens"], round(v[1], 2)) for k, v in runs.items()})



def test_metrics_endpoint_exports_the_tier():
    from mambacache.serve.metrics import ServerMetrics

    eng = shadow_engine(**SHADOW_TIER, **{"cache.host_memory_bytes": 100_000})
    _conversations(eng, 3, 6, 30, 7, 5)
    m = eng.metrics()
    text = ServerMetrics().render(m).decode()
    assert f"mambacache_host_hit_tokens_total {float(m['host_hit_tokens'])}" in text
    assert "mambacache_host_promoted_bytes_total" in text
    assert f"mambacache_host_pool_usage {float(m['host_usage'])}" in text
