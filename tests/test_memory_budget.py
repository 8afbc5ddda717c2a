"""One byte budget: ``ByteBudget``, ``plan_pools``, the shared accounting of the radix cache (KV and
states evicted in one order), superseded end states demoted, ``eviction = "auto"``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mambacache.cache.budget import ByteBudget, budget_from_fraction, plan_pools
from mambacache.cache.eviction import FlopAwarePolicy, LRUPolicy
from mambacache.cache.from_config import make_cache_from_config
from mambacache.cache.radix import make_cache
from mambacache.cache.replay import replay
from mambacache.config import CacheConfig

PAGE_B, SLOT_B = 10, 40  # a state = the KV of 4 tokens (page size 1)


def shared(limit: int = 200, **kw):
    b = ByteBudget(limit, PAGE_B, SLOT_B)
    return make_cache(True, b.num_pages, b.num_slots, 1, budget=b, **kw)


def put(cache, tokens: list[int], snaps: list[int]) -> None:
    """Insert ``tokens`` with states at ``snaps`` as a finished request would."""
    slots = cache.alloc_slots(len(snaps))
    pages = cache.alloc_pages(len(tokens))
    assert slots is not None and pages is not None
    cache.insert(tokens, pages, dict(zip(snaps, slots.tolist(), strict=True)))
    cache.check_integrity()


def test_byte_budget_capacities_and_errors():
    b = ByteBudget(200, PAGE_B, SLOT_B)
    assert (b.num_pages, b.num_slots) == (16, 4)  # next to one slot / one page
    with pytest.raises(ValueError, match="cannot hold one KV page"):
        ByteBudget(45, PAGE_B, SLOT_B)
    with pytest.raises(ValueError, match="page_bytes"):
        ByteBudget(200, 0, SLOT_B)
    assert budget_from_fraction(100, 30, 20, 0.5) == 25
    with pytest.raises(ValueError, match="nothing is left"):
        budget_from_fraction(100, 80, 20, 0.5)


def test_kv_pressure_evicts_a_state_and_state_pressure_evicts_kv():
    cache = shared(speculative_states=False)
    put(cache, list(range(1, 9)), [8])  # 8 pages + 1 state = 120 bytes
    put(cache, list(range(100, 104)), [4])  # 4 pages + 1 state = 80 bytes: budget full
    assert cache.free_bytes() == 0 and cache.available_pages() == 16  # page ids
    pages = cache.alloc_pages(4)  # needs 40 bytes: the older leaf goes whole (KV + state)
    assert pages is not None and cache.stats()["pages_evicted"] == 8
    assert cache.match_prefix(list(range(1, 10))).cached_len == 0
    assert cache.match_prefix(list(range(100, 105))).cached_len == 4
    cache.free_pages(pages)
    slots = cache.alloc_slots(3)  # the 120 free bytes: no eviction, 4 states held
    assert slots is not None and cache.free_bytes() >= 0
    cache.free_slots(slots)
    cache.check_integrity()
    s = cache.stats()
    assert s["memory_bytes"] == 200 and s["peak_bytes_held"] <= 200
    assert s["peak_state_bytes_held"] == 160 and s["peak_kv_bytes_held"] == 120


def test_budget_full_of_locked_bytes_gives_none():
    cache = shared(speculative_states=False)
    put(cache, list(range(1, 13)), [12])  # 160 bytes
    m = cache.match_prefix(list(range(1, 14)))
    cache.lock(m.node)
    assert cache.alloc_slots(2) is None and cache.alloc_pages(5) is None  # 40 bytes free
    assert cache.alloc_pages(4) is not None
    assert cache.available_pages() == 0 and cache.available_slots() == 0
    cache.check_integrity()


@pytest.mark.parametrize("eviction", ["lru", "flop_aware", "auto"])
def test_random_replay_keeps_the_byte_budget(eviction):
    rng = np.random.default_rng(3)
    heads = [rng.integers(1, 50, 12).tolist() for _ in range(3)]
    reqs = []
    for i in range(120):
        prompt = np.asarray(heads[i % 3] + rng.integers(1, 50, int(rng.integers(1, 8))).tolist(),
                            np.int32)
        reqs.append((prompt, np.concatenate([prompt, rng.integers(1, 50, 3)]).astype(np.int32)))
    cache = shared(1200, eviction=eviction)
    out = replay(cache, reqs, checkpoint_interval=4, concurrency=3)
    cache.check_integrity()
    s = cache.stats()
    assert s["peak_bytes_held"] <= 1200 and out["dropped"] == 0
    assert 0 < out["cached_tokens"] < out["prompt_tokens"]
    assert s["kv_bytes_held"] + s["state_bytes_held"] <= 1200


def test_a_deeper_end_demotes_the_superseded_state_and_a_hit_promotes_it():
    cache = make_cache(True, 64, 8, 1)
    put(cache, list(range(1, 9)), [8])
    put(cache, list(range(1, 17)), [16])  # the next turn resumes from 8 and ends at 16
    node8 = cache.match_prefix(list(range(1, 10))).node
    assert cache.stats()["snapshots_demoted"] == 1
    assert node8.depth == 8 and not node8.spec  # the hit promoted it again
    assert cache.stats()["snapshots_promoted"] == 1
    cache.check_integrity()
    put(cache, list(range(1, 25)), [24])  # 16 -> 24: 16 demoted, evicted before 24
    assert cache.evict_slots(1) == 1
    assert cache.match_prefix(list(range(1, 18))).cached_len == 8
    assert cache.match_prefix(list(range(1, 26))).cached_len == 24


def test_auto_eviction_follows_the_budget():
    assert isinstance(make_cache(True, 8, 4, eviction="auto").policy, LRUPolicy)
    auto = shared(eviction="auto").policy
    assert isinstance(auto, FlopAwarePolicy)
    # early, short tuning windows; a close win is enough (the shadows see the real pressure)
    assert (auto.tuner.every, auto.tuner.window, auto.tuner.margin) == (256, 128, 0.005)
    plain = make_cache(True, 8, 4, eviction="flop_aware").policy.tuner
    assert (plain.every, plain.margin) == (512, 0.02)
    assert shared(eviction="flop_aware").policy.state_tokens == SLOT_B / PAGE_B
    assert CacheConfig().eviction == "auto"


def test_alpha_inf_ranks_by_expected_saving_per_byte():
    """``alpha = inf`` (a tuner candidate): recency rank x FLOPs per byte. A deep state used
    before a shallow one outlives it; any finite alpha evicts the deep one first here, since
    recency dominates a normalised efficiency gap this small."""
    import math

    from mambacache.cache.tuning import GRID

    assert math.inf in GRID and GRID[0] == 0.0
    cache = make_cache(True, 400, 8, eviction="flop_aware", alpha=math.inf)
    deep, shallow = list(range(1, 101)), list(range(200, 211))
    for prompt in (deep, shallow):
        pages = cache.alloc_pages(len(prompt))
        cache.insert(prompt, pages, {len(prompt): cache.alloc_slot()})
    assert cache.policy.page_victims(cache, 1)[0].depth == len(shallow)
    cache.policy.set_alpha(0.25)
    assert cache.policy.page_victims(cache, 1)[0].depth == len(deep)


def test_plan_pools_sizes_and_errors():
    fixed = plan_pools(CacheConfig(num_kv_tokens=64, num_mamba_slots=4), 10, 40,
                       context_len=32, max_running=2)
    assert (fixed.num_pages, fixed.num_slots, fixed.budget) == (64, 4, None)
    cfg = CacheConfig(memory_bytes=1000, page_size=2)
    plan = plan_pools(cfg, 20, 100, context_len=32, max_running=4)
    assert plan.budget == ByteBudget(1000, 20, 100) and plan.num_pages == 45
    with pytest.raises(ValueError, match=r"one request of the context \(32 tokens = 16 pages x 20 "
                                         r"bytes\) plus 8 running state slots x 100 bytes = 1120"):
        plan_pools(cfg, 20, 100, context_len=32, max_running=8)
    kv_set = plan_pools(CacheConfig(memory_bytes=1000, num_kv_tokens=40), 10, 100,
                        context_len=32, max_running=2)
    assert (kv_set.num_pages, kv_set.num_slots) == (40, 6)
    with pytest.raises(ValueError, match="running requests need one each"):
        plan_pools(CacheConfig(memory_bytes=1000, num_kv_tokens=90), 10, 100, context_len=32,
                   max_running=2)
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(memory_bytes=10, memory_fraction=0.5)


def test_config_budget_builds_a_shared_cache():
    cfg = CacheConfig(memory_bytes=200, state_bytes=SLOT_B, kv_bytes_per_token=PAGE_B,
                      num_kv_tokens=16, num_mamba_slots=4)
    cache = make_cache_from_config(cfg)
    assert cache.budget == ByteBudget(200, PAGE_B, SLOT_B, running_share=0.5)
    assert make_cache_from_config(CacheConfig()).budget is None


def test_a_budget_set_by_replace_derives_the_pools():
    """The fixed pools' defaults (16384 tokens / 64 slots) apply only without a budget: a
    budget added to a default config by ``replace`` derives both pools, not caps them there."""
    import mambacache as mc

    cfg = mc.EngineConfig().replace(**{"cache.memory_bytes": 1 << 30})
    assert (cfg.cache.num_kv_tokens, cfg.cache.num_mamba_slots) == (0, 0)
    capped = mc.EngineConfig().replace(**{"cache.memory_bytes": 1 << 30,
                                          "cache.num_mamba_slots": 64})
    assert (capped.cache.num_kv_tokens, capped.cache.num_mamba_slots) == (0, 64)
    set_before = mc.EngineConfig().replace(**{"cache.num_kv_tokens": 4096})
    kept = set_before.replace(**{"cache.memory_fraction": 0.5})
    assert (kept.cache.num_kv_tokens, kept.cache.num_mamba_slots) == (4096, 0)
    back = cfg.replace(**{"cache.memory_bytes": 0})  # no budget again: the defaults
    assert (back.cache.num_kv_tokens, back.cache.num_mamba_slots) == (16384, 64)


def test_a_budget_capped_by_explicit_pool_sizes_is_logged(caplog):
    """Both pool sizes explicit hold fewer bytes than the budget: the cache can use only the
    cap, and a warning says so with the numbers; derived pools or a cap at the budget log
    nothing."""
    import logging

    kw = dict(context_len=8, max_running=2)
    capped = CacheConfig(memory_bytes=100_000, state_bytes=SLOT_B, kv_bytes_per_token=PAGE_B,
                         num_kv_tokens=16, num_mamba_slots=4)
    with caplog.at_level(logging.WARNING, logger="mambacache.cache.budget"):
        plan_pools(capped, PAGE_B, SLOT_B, **kw)
    (rec,) = caplog.records
    assert "capped at 320 bytes" in rec.getMessage() and "100000" in rec.getMessage()
    assert "cache.num_kv_tokens = 16" in rec.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mambacache.cache.budget"):
        plan_pools(CacheConfig(memory_bytes=100_000, state_bytes=SLOT_B,
                               kv_bytes_per_token=PAGE_B), PAGE_B, SLOT_B, **kw)
        plan_pools(CacheConfig(memory_bytes=320, state_bytes=SLOT_B, kv_bytes_per_token=PAGE_B,
                               num_kv_tokens=16, num_mamba_slots=4), PAGE_B, SLOT_B, **kw)
    assert not caplog.records


def test_the_tiny_config_derives_its_pools_from_a_budget():
    """``configs/tiny_qwen3_next.toml`` pins no pool size and no eviction: the defaults (16384
    tokens / 64 slots, LRU) without a budget, pools derived and ``auto`` with one."""
    import mambacache as mc

    plain = mc.EngineConfig.load("configs/tiny_qwen3_next.toml")
    assert (plain.cache.num_kv_tokens, plain.cache.num_mamba_slots) == (16384, 64)
    assert plain.cache.eviction == "auto"
    budget = mc.EngineConfig.load("configs/tiny_qwen3_next.toml",
                                  overrides={"cache.memory_bytes": 2 * 10**9})
    assert (budget.cache.num_kv_tokens, budget.cache.num_mamba_slots) == (0, 0)


def test_engine_sized_from_memory_bytes_stays_exact_and_within_budget():
    import mambacache as mc
    from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens

    # tiny model, fp32: a state 16,896 bytes, a token of KV 256; 32 slots explicit, the KV
    # derived from the rest: 4096 tokens (the context), reserved page and slot apart
    budget = {"cache.num_kv_tokens": 0, "cache.memory_bytes": 1_606_400}
    engine = make_engine(**budget)
    assert engine.cfg.cache.num_kv_tokens == 4096
    pools = engine.runner.pools.nbytes()
    assert pools["full"] + pools["mamba"] == 1_606_400  # reserved rows included
    # [rebalance] the split derived from the budget alone; the engine runs at a neighbour
    # (moved before anything compiles: the move with rows in use is the slow test below)
    moving = {**budget, "cache.num_mamba_slots": 0, "cache.rebalance": True}
    engine = make_engine(**moving)
    rb = engine.rebalancer
    assert len(rb.splits) >= 2 and rb.splits[rb.current] == (engine.cfg.cache.num_pages,
                                                            engine.cfg.cache.num_mamba_slots)
    rb.move_now((rb.current + 1) % len(rb.splits))
    rng = np.random.default_rng(0)
    head = rand_tokens(rng, 40)
    prompts = [head + rand_tokens(rng, 5) for _ in range(4)]
    params = mc.SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = engine.generate(prompts, params) + engine.generate(prompts, params)
    # the cache-off engine runs the same two 4-prompt batches: no 8-row step to compile
    # (75 s against 94 s back to back at load 25; the rest is the on engine's compiles)
    # at the same split: the same pool shapes, so it reuses the on engine's programs
    off_engine = make_engine(**moving, **{"cache.enable": False})
    off_engine.rebalancer.move_now(rb.current)
    off = off_engine.generate(prompts, params) + off_engine.generate(prompts, params)
    assert_same_outputs(outs, off)
    m = engine.metrics()
    assert m["cached_tokens"] > 0 and m["memory_bytes"] == 1_606_400
    assert 0 < m["peak_bytes_held"] <= 1_606_400
    assert m["pool_bytes"] <= 1_606_400 and m["split_moves"] == 1  # reserved rows included
    engine.check_integrity()
    with pytest.raises(ValueError, match="cannot hold one request of the context"):
        make_engine(**{**budget, "cache.memory_bytes": 1_000_000})


@pytest.mark.slow
def test_engine_split_moved_between_batches_stays_exact():
    """[rebalance] The device split moves between two batches with rows in the tree: the
    second batch hits rows the move copied; cache on = off; the pools stay within the budget.
    ``python -m pytest -m slow tests/test_memory_budget.py -k moved`` (about 75 s: every
    program compiles again for the moved pools)."""
    import mambacache as mc
    from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens

    budget = {"cache.num_kv_tokens": 0, "cache.num_mamba_slots": 0,
              "cache.memory_bytes": 1_606_400}
    engine = make_engine(**budget, **{"cache.rebalance": True})
    rb = engine.rebalancer
    rng = np.random.default_rng(0)
    head = rand_tokens(rng, 40)
    prompts = [head + rand_tokens(rng, 5) for _ in range(4)]
    params = mc.SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = engine.generate(prompts, params)
    before = engine.metrics()["cached_tokens"]
    target = (rb.current + 1) % len(rb.splits)
    rb.move_now(target)
    assert (engine.pools.num_pages - 1, engine.pools.num_slots - 1) == rb.splits[target]
    outs += engine.generate(prompts, params)
    assert engine.metrics()["cached_tokens"] - before >= 4 * 40  # hits after the move
    off_engine = make_engine(**budget, **{"cache.enable": False})
    off = off_engine.generate(prompts, params) + off_engine.generate(prompts, params)
    assert_same_outputs(outs, off)
    m = engine.metrics()
    assert m["pool_bytes"] <= 1_606_400 and m["split_moves"] == 1
    engine.check_integrity()


def test_layerwise_resize_keeps_rows_and_zeroes_new_ones():
    """[rebalance] ``resize_layerwise``: KV shrinks and states grow, one layer at a time; kept
    rows copied, new rows zero, dtypes kept."""
    import jax.numpy as jnp

    from mambacache.engine.runners.pools import PoolState, pool_fields, resize_layerwise
    from models.presets import get_preset

    pools = PoolState.create(get_preset("tiny_qwen3_next"), 16, 2, 4)
    pools = pools.replace(ssm=tuple(a.at[3].set(1.5) for a in pools.ssm),
                          k_pages=tuple(a.at[9].set(2.0).at[15].set(3.0) for a in pools.k_pages))
    moved = resize_layerwise(pool_fields(pools), 10, 6)
    assert (moved.num_pages, moved.num_slots) == (11, 7)
    assert float(moved.k_pages[0][9].min()) == 2.0 and float(moved.ssm[-1][3].min()) == 1.5
    assert float(jnp.abs(moved.ssm[0][5:]).max()) == 0 and moved.ssm[0].dtype == jnp.float32
    back = resize_layerwise(pool_fields(moved), 16, 4)  # page 15 was dropped: zero again
    assert float(jnp.abs(back.k_pages[0][15]).max()) == 0 and back.num_slots == 5


def test_pool_resize_keeps_rows_and_zeroes_new_ones():
    import jax.numpy as jnp

    from mambacache.engine.runners.pools import PoolState
    from models.presets import get_preset

    pools = PoolState.create(get_preset("tiny_qwen3_next"), 16, 2, 4)
    pools = pools.replace(ssm=tuple(a.at[3].set(1.5) for a in pools.ssm),
                          k_pages=tuple(a.at[9].set(2.0) for a in pools.k_pages))
    grown = pools.resized(32, 2)  # KV grows, states shrink: rows kept, new rows zero
    assert (grown.num_pages, grown.num_slots) == (33, 3)
    assert float(grown.k_pages[0][9].min()) == 2.0
    assert float(jnp.abs(grown.k_pages[0][17:]).max()) == 0
    assert float(grown.ssm[0][2].max()) == 0 and grown.ssm[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="resized needs"):
        pools.resized(0, 4)


def test_device_split_follows_the_state_size_and_keeps_running_slots():
    """Two fixed device pools: a state with the KV of ``DEVICE_TOKENS_PER_STATE`` tokens (a 7B
    hybrid's 409-token state -> 0.31 of the bytes, Qwen3-Next-80B-A3B's 3,144 -> 0.78), clamped,
    and never fewer than two slots per running request (the tiny model's 66-token state)."""
    from mambacache.cache.budget import DEVICE_TOKENS_PER_STATE, device_state_share
    from mambacache.config import EngineConfig
    from mambacache.engine.runners.pools import size_pools
    from models.presets import get_preset

    assert device_state_share(409, 1, 1) == pytest.approx(409 / (409 + DEVICE_TOKENS_PER_STATE))
    assert 0.3 < device_state_share(26_800_000, 65_526, 1) < 0.32
    assert 0.77 < device_state_share(77_266_944, 24_576, 1) < 0.79
    assert device_state_share(1, 1_000, 1) == 0.1 and device_state_share(10**9, 1, 1) == 0.9
    cfg = EngineConfig().replace(**{"cache.memory_bytes": 2_000_000, "cache.num_kv_tokens": 0,
                                    "cache.num_mamba_slots": 0})
    sized, plan = size_pools(cfg, get_preset("tiny_qwen3_next"), physical=True, context_len=4096)
    running = cfg.scheduler.max_running_requests
    assert sized.cache.num_mamba_slots == plan.num_slots >= 2 * running  # 0.1 alone gives 11
    assert plan.pool_bytes <= 2_000_000


def _bench_presets() -> list[str]:
    """The presets ``python -m mambacache.bench`` runs (``spec_tree.toml``'s workload is
    ``scripts/bench_spec_tree.py``'s own, not a bench CLI workload)."""
    from mambacache.bench.workloads import WORKLOADS
    from mambacache.config import read_toml

    paths = sorted(Path(__file__).parent.parent.glob("configs/bench/*.toml"))
    return [p.name for p in paths if read_toml(p).get("workload", {}).get("kind") in WORKLOADS]


BENCH_PRESETS = _bench_presets()


@pytest.mark.slow
@pytest.mark.parametrize("preset", BENCH_PRESETS)
def test_bench_preset_under_memory_bytes_alone(preset):
    """Every benchmark preset with only ``cache.memory_bytes`` (the bytes its two explicit pools
    took): the engine sizes itself, its first requests give the same outputs with the cache on
    and off, and ``metrics()`` shows the pools' bytes within the budget.
    ``python -m pytest -m slow tests/test_memory_budget.py -k preset_under``."""
    import mambacache as mc
    from mambacache.bench.cli import load_setup
    from mambacache.engine.engine import Engine
    from mambacache.engine.runners.pools import model_byte_sizes
    from mambacache.engine.speculative.verify import num_state_slots
    from models.presets import get_preset
    from tests.engine_helpers import assert_same_outputs

    setup = load_setup(str(Path(__file__).parent.parent / "configs/bench" / preset))
    cc, model_cfg = setup.engine.cache, get_preset(setup.engine.model.preset)
    state, kv = model_byte_sizes(setup.engine, model_cfg)
    limit = (cc.num_pages + 1) * kv * cc.page_size + (num_state_slots(setup.engine) + 1) * state
    cfg = setup.engine.replace(**{"cache.memory_bytes": limit, "cache.num_kv_tokens": 0,
                                  "cache.num_mamba_slots": 0, "model.kernels": "reference"})
    items = setup.workload.source(model_cfg.vocab_size, 0).start()[:6]
    prompts = [it.prompt for it in items]
    params = [mc.SamplingParams(max_new_tokens=min(it.max_new_tokens, 4), temperature=0.0)
              for it in items]
    outs = {}
    for on in (True, False):
        engine = Engine(cfg.replace(**{"cache.enable": on}))
        outs[on] = engine.generate(prompts, params) + engine.generate(prompts, params)
        m = engine.metrics()
        assert m["pool_bytes"] <= limit, (preset, m["pool_bytes"], limit)
        engine.check_integrity()
    assert_same_outputs(outs[True], outs[False])
