"""Hit rates of the engine with requests sent one after another (DESIGN.md targets)."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from tests.engine_helpers import make_engine, rand_tokens

ONE = mc.SamplingParams(max_new_tokens=1)
LONG = {"cache.num_kv_tokens": 16384, "scheduler.chunked_prefill_size": 256}


def sequential(engine, prompts, params=ONE):
    return [engine.generate([p], params)[0] for p in prompts]


def test_identical_prompts_hit_all_but_last_token():
    engine = make_engine(**LONG)
    prompt = rand_tokens(np.random.default_rng(0), 1000)
    outs = sequential(engine, [prompt] * 8)
    assert [o.cached_tokens for o in outs] == [0] + [999] * 7
    assert len({tuple(o.output_token_ids) for o in outs}) == 1
    m = engine.metrics()
    assert m["computed_prefill_tokens"] == 1000 + 7
    engine.check_integrity()


@pytest.mark.parametrize("checkpoint_interval", [0, 256])
def test_system_prompt_with_distinct_questions(checkpoint_interval):
    engine = make_engine(**LONG, **{"cache.checkpoint_interval": checkpoint_interval})
    rng = np.random.default_rng(1)
    system = rand_tokens(rng, 1024)
    outs = sequential(engine, [system + rand_tokens(rng, 64) for _ in range(5)])
    first_hit = 1 if checkpoint_interval else 2
    assert all(o.cached_tokens >= 1024 for o in outs[first_hit:]), [o.cached_tokens for o in outs]
    assert outs[0].cached_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_caches_previous_prompt_and_output(page_size):
    engine = make_engine(**{"cache.page_size": page_size})
    rng = np.random.default_rng(2)
    prompt = rand_tokens(rng, 50)
    params = mc.SamplingParams(max_new_tokens=7)
    prev_len = None
    for _ in range(4):
        out = engine.generate([prompt], params)[0]
        if prev_len is not None:
            want = (prev_len - 1) // page_size * page_size
            assert out.cached_tokens == want, (out.cached_tokens, prev_len)
        prev_len = len(prompt) + len(out.output_token_ids)
        prompt = prompt + out.output_token_ids + rand_tokens(rng, 9)
    engine.check_integrity()


def test_concurrent_shared_prefix_dedup():
    """Requests that arrive together and share an uncached prefix: the first computes it, the
    rest wait for it and hit (in-batch prefix dedup)."""
    engine = make_engine()
    rng = np.random.default_rng(4)
    system = rand_tokens(rng, 40)
    outs = engine.generate([system + rand_tokens(rng, 6) for _ in range(4)], ONE)
    assert outs[0].cached_tokens == 0
    assert all(o.cached_tokens >= 40 for o in outs[1:]), [o.cached_tokens for o in outs]
    assert engine.metrics()["computed_prefill_tokens"] < 40 * 2 + 4 * 6
