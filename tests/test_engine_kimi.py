"""Cache on = cache off for ``tiny_kimi_linear`` (KDA + MLA over the paged latent cache +
grouped MoE): greedy tokens identical, logprobs within 1e-4 (fp32), on the adversarial workload of
``tests/test_engine_exactness.py`` (shared prefixes, identical prompts, multi-turn) with pages of
4, chunk cuts at 13 and checkpoints every 8; an identical prompt hits all but its last
page-rounded token; ``metrics()`` reports the latent pool's bytes per token next to expanded K/V.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine, load_model
from tests.engine_helpers import BASE, assert_same_outputs
from tests.test_engine_exactness import run_workload

PRESET = "tiny_kimi_linear"


@functools.cache
def kimi_model():
    return load_model(mc.EngineConfig().replace(**{"model.preset": PRESET}))


def kimi_engine(**overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{**BASE, "model.preset": PRESET, **overrides})
    return Engine(cfg, model=kimi_model())


def test_cache_on_equals_off():
    off = run_workload(kimi_engine(**{"cache.enable": False}))
    on_engine = kimi_engine(**{"cache.page_size": 4, "cache.checkpoint_interval": 8,
                               "scheduler.chunked_prefill_size": 13})
    on = run_workload(on_engine)
    assert_same_outputs(on, off)
    assert on[4].cached_tokens == on[5].cached_tokens == (46 - 1) // 4 * 4
    for out, prev in zip(on[7:], on[:4], strict=True):  # turn 2 reuses turn 1
        assert out.cached_tokens >= (len(prev.prompt_token_ids) - 1) // 4 * 4
    m = on_engine.metrics()
    # one MLA layer: latent 32 + shared key 8 fp32 values vs 4 heads x (24 + 16)
    assert (m["kv_bytes_per_token"], m["kv_bytes_per_token_expanded"]) == (40 * 4, 160 * 4)


def test_identical_prompt_hits_all_but_last_page():
    prompt = np.random.default_rng(5).integers(0, 512, 97).tolist()
    greedy = mc.SamplingParams(max_new_tokens=4)
    eng = kimi_engine(**{"cache.page_size": 16})
    first, second = eng.generate([prompt], greedy), eng.generate([prompt], greedy)
    assert second[0].cached_tokens == (97 - 1) // 16 * 16 == 96
    off = kimi_engine(**{"cache.enable": False}).generate([prompt], greedy)
    assert_same_outputs(first + second, off + off)
    eng.check_integrity()


@pytest.mark.slow  # minutes on a shared 2-core CI box: run with -m slow
def test_cache_save_restore_and_orbax_round_trip(tmp_path):
    """The latent pages (k_pages only, no v_pages) and the KDA states survive a warm restart;
    HF -> Orbax params round trip for the Kimi Linear fixture."""
    from pathlib import Path

    import jax

    from mambacache.parallel.checkpoint import convert_hf_to_orbax, restore_params
    from models.loader import load_checkpoint

    over = {"cache.page_size": 4, "cache.checkpoint_interval": 16}
    rng = np.random.default_rng(2)
    system = rng.integers(0, 512, 40).tolist()
    first = [system + rng.integers(0, 512, 9).tolist() for _ in range(2)]
    greedy = mc.SamplingParams(max_new_tokens=4)
    engine = kimi_engine(**over)
    for p in first:
        engine.generate([p], greedy)
    engine.save(str(tmp_path / "c"))
    warm, cold = kimi_engine(**over), kimi_engine(**over)
    warm.restore(str(tmp_path / "c"))
    nxt = [first[0], system + rng.integers(0, 512, 5).tolist()]
    outs_w = [warm.generate([p], greedy)[0] for p in nxt]
    outs_c = [cold.generate([p], greedy)[0] for p in nxt]
    assert all(o.cached_tokens >= 40 for o in outs_w) and outs_c[0].cached_tokens == 0
    assert_same_outputs(outs_w, outs_c)
    warm.check_integrity()

    src = Path(__file__).parent / "fixtures" / "kimi_linear"
    cfg = convert_hf_to_orbax(src, tmp_path / "orbax")
    cfg2, params = restore_params(tmp_path / "orbax")
    ref_cfg, ref = load_checkpoint(src)
    assert cfg == cfg2 == ref_cfg and cfg.family == "kimi_linear"
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # minutes on a shared 2-core CI box: run with -m slow
def test_small_latent_pool_preempts_and_stays_exact():
    """A 120-token latent pool for 6 x (20 + 30) tokens: the newest requests are preempted
    (their progress cached) and everything still equals the cache-off run."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, 20).tolist() for _ in range(6)]
    params = mc.SamplingParams(max_new_tokens=30)
    engine = kimi_engine(**{"cache.num_kv_tokens": 120,
                            "scheduler.check_integrity_every_step": True})
    outs = engine.generate(prompts, params)
    assert engine.metrics()["preemptions"] > 0
    reference = kimi_engine(**{"cache.enable": False}).generate(prompts, params)
    assert_same_outputs(outs, reference)
    engine.check_integrity()
