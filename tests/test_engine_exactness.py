"""Cache on = cache off: greedy tokens identical, logprobs within 1e-4 (fp32); with
``scheduler.overlap`` on (the default) and off, against the synchronous cache-off reference."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens

GREEDY = mc.SamplingParams(max_new_tokens=6)


def run_workload(engine, seed: int = 0):
    """Shared system prompts, identical prompts, then multi-turn continuations."""
    rng = np.random.default_rng(seed)
    sys_a, sys_b = rand_tokens(rng, 37), rand_tokens(rng, 22)
    first = [sys_a + rand_tokens(rng, 9), sys_a + rand_tokens(rng, 14), sys_b + rand_tokens(rng, 5),
             sys_b + rand_tokens(rng, 11)]
    outs = engine.generate(first, GREEDY)
    outs += engine.generate([first[0], first[0], sys_a + rand_tokens(rng, 3)], GREEDY)
    turn2 = [o.prompt_token_ids + o.output_token_ids + rand_tokens(rng, 6) for o in outs[:4]]
    outs += engine.generate(turn2, GREEDY)
    engine.check_integrity()
    return outs


@pytest.fixture(scope="module")
def reference_outputs():
    return run_workload(make_engine(**{"cache.enable": False, "scheduler.overlap": False}))


# (page size, checkpoint interval, chunk, overlap): every combination overlapped, two of them
# synchronous as well (each case costs a workload run, not compiles: shapes are the same)
CASES = [(p, c, k, True) for p in (1, 4) for c in (0, 8) for k in (13, 64)] + [
    (4, 8, 13, False), (1, 0, 64, False)]


@pytest.mark.parametrize("page_size,checkpoint_interval,chunk,overlap", CASES)
def test_cache_on_equals_off(reference_outputs, page_size, checkpoint_interval, chunk, overlap):
    _cache_on_equals_off(reference_outputs, page_size, checkpoint_interval, chunk, overlap)


def _cache_on_equals_off(reference_outputs, page_size, checkpoint_interval, chunk, overlap,
                         **extra):
    """The workload on a cached engine (``extra``: more config keys) equals the reference."""
    engine = make_engine(**{"cache.page_size": page_size,
                            "cache.checkpoint_interval": checkpoint_interval,
                            "scheduler.chunked_prefill_size": chunk,
                            "scheduler.overlap": overlap, **extra})
    outs = run_workload(engine)
    assert_same_outputs(outs, reference_outputs)
    m = engine.metrics()
    assert m["cached_tokens"] > 0, m
    # the repeated first prompt hits all but its last token, rounded to a page
    assert outs[4].cached_tokens == outs[5].cached_tokens == (46 - 1) // page_size * page_size
    for out, prev in zip(outs[7:], outs[:4], strict=True):  # turn 2 reuses turn 1
        assert out.cached_tokens >= (len(prev.prompt_token_ids) - 1) // page_size * page_size
    return engine


@pytest.mark.parametrize("page_size,checkpoint_interval,chunk,overlap",
                         [(4, 8, 13, True), (1, 0, 64, False)])
def test_cache_on_equals_off_with_separate_sampler(reference_outputs, page_size,
                                                   checkpoint_interval, chunk, overlap):
    """``compile.separate_sampler`` on (``engine/runners/sampler_program.py``) against the fused
    cache-off reference: the same tokens and logprobs."""
    engine = _cache_on_equals_off(reference_outputs, page_size, checkpoint_interval, chunk,
                                  overlap, **{"compile.separate_sampler": "on"})
    assert engine.runner.separate_sampler


def test_sampled_decoding_same_on_and_off():
    rng = np.random.default_rng(3)
    prefix = rand_tokens(rng, 30)
    prompts = [prefix + rand_tokens(rng, 4) for _ in range(3)] + [prefix]
    params = [mc.SamplingParams(max_new_tokens=5, temperature=0.8, top_k=40, top_p=0.9, seed=s)
              for s in range(4)]
    on = make_engine()  # overlapped
    off = make_engine(**{"cache.enable": False, "scheduler.overlap": False})
    outs_on = on.generate(prompts, params) + on.generate(prompts, params)
    outs_off = off.generate(prompts, params) + off.generate(prompts, params)
    assert_same_outputs(outs_on, outs_off)
    assert outs_on[4].cached_tokens > 0
    # the seed matters: same prompt, other seed -> the sampled tokens differ somewhere
    other = on.generate([prompts[0]] * 3, [mc.SamplingParams(max_new_tokens=5, temperature=1.0,
                                                             seed=s) for s in (10, 11, 12)])
    assert len({tuple(o.output_token_ids) for o in other}) > 1
