"""Shared engine fixtures: one model, engines that share compiled programs."""

from __future__ import annotations

import functools

import numpy as np

import mambacache as mc
from mambacache.engine.engine import Engine, load_model

BASE = {"cache.num_kv_tokens": 4000, "cache.num_mamba_slots": 32,
        "scheduler.max_running_requests": 8, "scheduler.chunked_prefill_size": 64,
        "model.kernels": "reference"}


@functools.cache
def tiny_model():
    return load_model(mc.EngineConfig())


def make_engine(**overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{**BASE, **overrides})
    return Engine(cfg, model=tiny_model())


def rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    vocab = tiny_model()[0].vocab_size
    return rng.integers(0, vocab, n).tolist()


def assert_same_outputs(outs_a, outs_b, atol: float = 1e-4) -> None:
    assert len(outs_a) == len(outs_b)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert a.output_token_ids == b.output_token_ids, (a.request_id, a.output_token_ids,
                                                          b.output_token_ids)
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=atol, rtol=0)


def spec_prompts() -> list[list[int]]:
    """Two prompts sharing a 19-token prefix and one apart (the speculative engine tests')."""
    rng = np.random.default_rng(7)
    shared = rand_tokens(rng, 19)
    return [shared + rand_tokens(rng, 6), shared + rand_tokens(rng, 11), rand_tokens(rng, 9)]


def spec_params(sampled: bool, max_new_tokens: int) -> list[mc.SamplingParams]:
    """Greedy, or seeded top-k 50 sampling at temperature 0.9, for ``spec_prompts``."""
    if not sampled:
        return [mc.SamplingParams(max_new_tokens=max_new_tokens)] * 3
    return [mc.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, top_k=50, seed=s)
            for s in (1, 2, 3)]
