"""Cache on = cache off for the Mamba2 hybrids (``tiny_nemotron_h``, ``tiny_granite_4_h``):
greedy tokens identical, logprobs within 1e-4 (fp32), on the adversarial workload of
``tests/test_engine_exactness.py`` (shared prefixes, identical prompts, multi-turn) with pages
of 4, chunk cuts at 13 and checkpoints every 8; then an identical 161-token prompt hits all
but its last page-rounded token (160) on the same engines (no new programs).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine, load_model
from tests.engine_helpers import BASE, assert_same_outputs
from tests.test_engine_exactness import run_workload

PRESETS = ("tiny_nemotron_h", "tiny_granite_4_h")


@functools.cache
def model(preset: str):
    return load_model(mc.EngineConfig().replace(**{"model.preset": preset}))


def engine(preset: str, **overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{**BASE, "model.preset": preset, **overrides})
    return Engine(cfg, model=model(preset))


@pytest.mark.parametrize("preset", PRESETS)
def test_cache_on_equals_off(preset):
    off_engine = engine(preset, **{"cache.enable": False})
    on_engine = engine(preset, **{"cache.page_size": 4, "cache.checkpoint_interval": 8,
                                  "scheduler.chunked_prefill_size": 13})
    off, on = run_workload(off_engine), run_workload(on_engine)
    assert_same_outputs(on, off)
    assert on[4].cached_tokens == on[5].cached_tokens == (46 - 1) // 4 * 4
    for out, prev in zip(on[7:], on[:4], strict=True):  # turn 2 reuses turn 1
        assert out.cached_tokens >= (len(prev.prompt_token_ids) - 1) // 4 * 4
    # an identical 161-token prompt hits all but its last page-rounded token
    prompt = np.random.default_rng(5).integers(0, 512, 161).tolist()
    greedy = mc.SamplingParams(max_new_tokens=4)
    first, second = on_engine.generate([prompt], greedy), on_engine.generate([prompt], greedy)
    assert second[0].cached_tokens == (161 - 1) // 4 * 4 == 160
    assert_same_outputs(first + second, off_engine.generate([prompt], greedy) * 2)
    on_engine.check_integrity()


@pytest.mark.slow  # two more engines per preset; run with -m slow
@pytest.mark.parametrize("preset", PRESETS)
def test_page_size_one_and_preemption(preset):
    """Pages of 1 (a snapshot may land on any token) and a KV pool so small that requests
    are preempted: cache on still equals cache off."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, 20).tolist() for _ in range(6)]
    params = mc.SamplingParams(max_new_tokens=30)
    eng = engine(preset, **{"cache.page_size": 1, "cache.num_kv_tokens": 120,
                            "scheduler.check_integrity_every_step": True})
    outs = eng.generate(prompts, params)
    assert eng.metrics()["preemptions"] > 0
    assert_same_outputs(outs, engine(preset, **{"cache.enable": False}).generate(prompts, params))
    eng.check_integrity()
