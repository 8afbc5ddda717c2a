"""The host tier on a growing conversation (issue 39, item 2): each re-send is the previous
prompt plus new text, so the only state it can resume from is the previous request's
``prompt_len - 1`` snapshot, a speculative state. Device eviction must demote it (the host has
room), not drop it, and the host tier must hand it back: hits from the second round on, outputs
equal to the cache off (model) and every read checked against its prefix (shadow runner)."""

from __future__ import annotations

import numpy as np
import pytest
from shadow_helpers import greedy, shadow_engine

from tests.engine_helpers import assert_same_outputs, make_engine, tiny_model

# the pools: 700 KV tokens and 6 state slots, page size 4, 2 running, 64 MiB of host
GROWING = {"cache.num_kv_tokens": 700, "cache.num_mamba_slots": 6, "cache.page_size": 4,
           "scheduler.max_running_requests": 2}
HOST = {"cache.host_memory_bytes": 64 * 2**20}


def _growing(engine, vocab: int, rounds: int = 3, convs: int = 6, new: int = 23,
             max_new_tokens: int = 6, seed: int = 39) -> list[list]:
    """``convs`` conversations of 60-120 tokens, each sent ``rounds`` times, one request at a
    time, every re-send = the previous prompt + ``new`` tokens; the outputs per round."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(60, 121))).tolist()
               for _ in range(convs)]
    rounds_out = []
    for _ in range(rounds):
        rounds_out.append([engine.generate([p], greedy(max_new_tokens))[0] for p in prompts])
        prompts = [p + rng.integers(3, vocab, new).tolist() for p in prompts]
    return rounds_out


def _assert_hits(rounds_out: list[list], metrics: dict) -> None:
    assert metrics["host_hit_tokens"] > 0, metrics
    for later in rounds_out[1:]:
        assert all(o.cached_tokens > 0 for o in later), [o.cached_tokens for o in later]


def test_shadow_growing_conversations_resume_from_the_host():
    cfg = {**GROWING, **HOST, "cache.state_bytes": 16384, "cache.kv_bytes_per_token": 512}
    eng = shadow_engine(**cfg)
    got = _growing(eng, 300)
    m = eng.metrics()
    _assert_hits(got, m)
    assert m["promotions"] > 0 and m["demotions"] > 0
    eng.check_integrity()  # idle: nothing leaked on the device or on the host


@pytest.mark.slow  # its own pool shapes: the tiny model's step compiles (~1-2 min on CPU)
def test_model_growing_conversations_exact_with_a_host_tier():
    vocab = tiny_model()[0].vocab_size
    off = _growing(make_engine(**GROWING, **{"cache.enable": False}), vocab)
    eng = make_engine(**GROWING, **HOST)
    got = _growing(eng, vocab)
    for a, b in zip(got, off, strict=True):
        assert_same_outputs(a, b)
    _assert_hits(got, eng.metrics())
    eng.check_integrity()
