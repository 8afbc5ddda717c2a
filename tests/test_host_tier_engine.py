"""The host tier in the engine: multi-turn conversations on a device pool too small for them,
served from host-resident states and KV, exact against the cache off (model) and checked read by
read (shadow runner: every copy between the tiers against the prefix it claims)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from shadow_helpers import greedy, shadow_engine

from mambacache.cache.host_tier import HostTier
from mambacache.engine.shadow.runner import DataflowError
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


@pytest.mark.slow  # ~3 min at load (own pool shapes: the step compiles); CI keeps the shadow
# tests above and the runner's exact round trip below
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
    assert "mambacache_host_load_wait_steps_total" in text


def test_warm_transfer_programs_then_no_compile(monkeypatch):
    """``host_pools.warm`` compiles every width a transfer can take and changes no row: a
    demotion and a promotion after it compile nothing and round-trip the rows exactly."""
    import jax
    import jax.numpy as jnp

    from mambacache.cache.host_tier import Transfer
    from mambacache.engine.runners import host_pools
    from mambacache.engine.runners.compiles import CompileCounter
    from mambacache.engine.runners.host_pools import HostPools, warm
    from mambacache.engine.runners.pools import PoolState

    model_cfg = tiny_model()[0]
    pools = PoolState.create(model_cfg, num_pages=40, page_size=2, num_slots=4)
    rng = np.random.default_rng(0)
    pools = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), pools)
    pools = pools.replace(conv=tuple(a.at[0].set(0) for a in pools.conv),
                          ssm=tuple(a.at[0].set(0) for a in pools.ssm))
    before = jax.device_get(pools)
    pools = warm(pools, 20)
    after = jax.device_get(pools)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after),
                    strict=True):
        np.testing.assert_array_equal(a[1:], b[1:])  # only the dump page / zero slot touched
    monkeypatch.setattr(host_pools, "PRUNE_MIN_ROWS", 0)
    counter, host = CompileCounter(), HostPools()
    host.max_batch_pages = 32
    tokens = np.arange(40, dtype=np.int32)
    with counter.track():  # two demotions, gathered by one program when the pools are written
        host.transfer(pools, Transfer(True, np.arange(1, 21, dtype=np.int32),
                                      np.arange(5, 25, dtype=np.int32), 3, 1, tokens))
        host.transfer(pools, Transfer(True, np.arange(31, 36, dtype=np.int32),
                                      np.arange(30, 35, dtype=np.int32), 1, 2, tokens[:10]))
        host.flush(pools)
        assert host.gathers == 1 and not host.slots  # copying: nothing waited for it
        # a promotion of host rows still copying lands them first, then starts its load
        host.transfer(pools, Transfer(False, np.arange(21, 41, dtype=np.int32),
                                      np.arange(5, 25, dtype=np.int32), 2, 1, tokens))
        assert set(host.slots) == {1, 2}
        while not host.load_ready(2):
            time.sleep(0.001)
        pools = host.finish_load(pools, 2)
    assert counter.compiles == 0
    got = jax.device_get(pools)
    np.testing.assert_array_equal(got.k_pages[0][21:41], before.k_pages[0][1:21])
    np.testing.assert_array_equal(got.ssm[0][2], before.ssm[0][3])
    np.testing.assert_array_equal(host.pages[32][1][0], before.v_pages[0][33])
    assert got.ssm[0].dtype == np.float32 and host.slots[2][1][0].dtype == np.float32
    # host ids reused before the new owner's rows landed: a promotion reads the new rows
    ids = np.arange(40, 44, dtype=np.int32)
    host.transfer(pools, Transfer(True, np.arange(1, 5, dtype=np.int32), ids, 3, 7, tokens[:8]))
    host.flush(pools)
    host.land(block=True)  # the old owner's rows are filed under host slot 7 / pages 40-43
    host.transfer(pools, Transfer(True, np.arange(10, 14, dtype=np.int32), ids, 1, 7, tokens[:8]))
    host.transfer(pools, Transfer(False, np.arange(21, 25, dtype=np.int32), ids, 2, 7, tokens[:8]))
    got = jax.device_get(host.finish_load(pools, 2))
    np.testing.assert_array_equal(got.ssm[0][2], before.ssm[0][1])
    np.testing.assert_array_equal(got.k_pages[0][21:25], before.k_pages[0][10:14])
    # landing walks the rows once they have doubled (here: at once) and drops the ids the host
    # tree no longer holds
    keep = lambda p, s: (p >= 50, s == 9)  # noqa: E731
    host.transfer(pools, Transfer(True, np.arange(1, 3, dtype=np.int32),
                                  np.arange(50, 52, dtype=np.int32), 1, 9, tokens[:4]), keep)
    host.flush(pools)
    host.land(keep, block=True)
    assert set(host.pages) == {50, 51} and set(host.slots) == {9}


@pytest.mark.parametrize("platform,kinds,want", [
    ("cpu", ["device", "pinned_host", "unpinned_host"], None),  # CPU: numpy rows
    ("gpu", ["device", "pinned_host", "unpinned_host"], "pinned_host"),
    ("tpu", ["device", "pinned_host"], "pinned_host"),
    ("gpu", ["device"], None),  # no pinned host memory offered: numpy rows
])
def test_host_memory_kind_follows_the_device(platform, kinds, want):
    from types import SimpleNamespace

    from mambacache.engine.runners.host_pools import host_memory_kind

    dev = SimpleNamespace(platform=platform, addressable_memories=lambda: [
        SimpleNamespace(kind=k) for k in kinds])
    assert host_memory_kind(dev) == want
    import jax

    assert host_memory_kind(jax.devices()[0]) is None  # this CPU backend


def _host_only_turn(eng, rng, convs: int = 6, first: int = 30):
    """Chats run until one's next turn starts with a prefix the host holds and the device does
    not; returns that turn's prompt."""
    tier = eng.cache.host_tier
    prompts = [rng.integers(1, 1000, first).tolist() for _ in range(convs)]
    for _ in range(4):
        got = eng.generate(prompts, greedy(5))
        prompts = [p + o.output_token_ids for p, o in zip(prompts, got, strict=True)]
        for p in prompts:
            if tier.residency(p[:-1]) == "host":
                return p + rng.integers(1, 1000, 7).tolist()
        prompts = [p + rng.integers(1, 1000, 7).tolist() for p in prompts]
    raise AssertionError("no prefix was demoted")


@pytest.mark.parametrize("abort", [False, True])
def test_a_load_in_flight_does_not_stop_other_requests(abort):
    """A promotion's load lands 3 steps after it is issued: its request waits (its lease held,
    nothing computed) while another request keeps stepping; no step reads the state before it
    lands (the oracle and ``check_step``, every step). Aborting it with the load in flight
    releases everything: idle, nothing is locked, held or in flight."""
    eng = shadow_engine(runner_kwargs={"load_latency": lambda slot: 3},
                        **SHADOW_TIER, **{"cache.host_memory_bytes": 100_000})
    rng = np.random.default_rng(5)
    turn = _host_only_turn(eng, rng)
    other = eng.add_request(rng.integers(1, 1000, 12).tolist(), greedy(20))
    eng.step()  # the other request starts
    rid = eng.add_request(turn, greedy(4))
    eng.step()  # admission promotes: the load is issued
    req = eng.requests[rid]
    assert eng.manager.loads_in_flight() == 1 and req.lease.held
    before = eng.requests[other].num_computed
    eng.step()
    assert req.lease.num_computed == req.cached_tokens > 0  # waits for its load
    assert eng.requests[other].num_computed > before  # the other one stepped
    if abort:
        eng.abort(rid)
        assert eng.manager.loads_in_flight() == 1  # the other request still runs
        eng.abort(other)  # idle now: the load is finished, its node unlocked
        assert eng.manager.loads_in_flight() == 0
    else:
        for _ in range(8):
            eng.step()
        assert len(req.output_ids) == 4  # it ran once its load landed
        while eng.has_unfinished():
            eng.step()
    eng.check_integrity()
    assert not eng.has_unfinished() and eng.cache.locked_slots() == 0
    m = eng.metrics()
    assert m["host_hit_tokens"] > 0 and m["load_wait_steps"] >= 1


def test_integrity_check_covers_the_host_tree():
    """The engine's integrity check audits the host tree's copies too (the shadow runner's
    ``check_host_tree``): a host state that no longer holds its node's prefix is found."""
    eng = shadow_engine(**SHADOW_TIER, **{"cache.host_memory_bytes": 100_000})
    _conversations(eng, 2, 6, 30, 7, 5)
    eng.check_integrity()
    host = eng.cache.host_tier.host
    slot = next(n.slot for n in host.lru_state)
    length, key = eng.runner.host_slot[slot]
    eng.runner.host_slot[slot] = (length, key + 1)
    with pytest.raises(DataflowError, match="host slot"):
        eng.check_integrity()
