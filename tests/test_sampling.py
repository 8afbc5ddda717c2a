"""The sampler: an all-greedy step (no vocabulary sort) returns what the per-row path returns,
and a mixed step still samples its temperature > 0 rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
import mambacache.engine.sampling.params
from mambacache.engine.sampling.sampler import SamplingBatch, _sample_row, sample


def _logits(rows: int = 6, vocab: int = 97) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)) * 3, jnp.float32)


def test_all_greedy_step_equals_the_per_row_path():
    logits = _logits()
    sb = SamplingBatch.from_params([mc.SamplingParams()] * 5 + [None], list(range(6)), 6)
    tokens, logprobs = jax.jit(sample)(logits, sb)
    ref = jax.vmap(_sample_row)(logits, sb.temperature, sb.top_k, sb.top_p, sb.seed, sb.step)
    np.testing.assert_array_equal(tokens, ref[0])
    np.testing.assert_allclose(logprobs, ref[1], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))


def test_mixed_step_samples_its_tempered_rows():
    logits = _logits(rows=2)
    hot = mc.SamplingParams(temperature=5.0, seed=1)
    seen = set()
    for step in range(40):
        sb = SamplingBatch.from_params([mc.SamplingParams(), hot], [step, step], 2)
        tokens, _ = jax.jit(sample)(logits, sb)
        assert int(tokens[0]) == int(jnp.argmax(logits[0]))
        seen.add(int(tokens[1]))
    assert len(seen) > 5, seen


# ---- validation (issue 24): every field bounded and typed, numpy ints in, bools out --------
def test_sampling_params_accept_numpy_ints_and_reject_bools_strings_floats():
    p = mc.SamplingParams(max_new_tokens=np.int64(8), top_k=np.int32(5), seed=np.uint16(3),
                          temperature=np.float32(0.5), stop_token_ids=[np.int64(7), 9])
    assert (p.max_new_tokens, p.top_k, p.seed, p.stop_token_ids) == (8, 5, 3, (7, 9))
    assert type(p.max_new_tokens) is int and type(p.temperature) is float
    bad = [  # (kwargs, words of the message)
        ({"max_new_tokens": True}, ["max_new_tokens", "int", "True"]),
        ({"max_new_tokens": 0}, ["max_new_tokens", "[1, 1048576]", "0"]),
        ({"temperature": "0.5"}, ["temperature", "number", "'0.5'"]),
        ({"temperature": float("nan")}, ["temperature", "[0, 100]"]),
        ({"top_k": 2**40}, ["top_k", "1099511627776", str(mc.engine.sampling.params.TOP_K_LIMIT)]),
        ({"top_k": -1}, ["top_k", "[0, 1048576]"]),
        ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
        ({"seed": 2**31}, ["seed", "[0, 2147483647]", "2147483648"]),
        ({"stop_token_ids": (3.7,)}, ["stop_token_ids[0]", "int", "3.7"]),
        ({"stop_token_ids": (True,)}, ["stop_token_ids[0]", "int"]),
        ({"stop_token_ids": (-1,)}, ["stop_token_ids[0]", "[0, 2147483647]"]),
        ({"stop_token_ids": "ab"}, ["stop_token_ids", "sequence"]),
        ({"stop_token_ids": tuple(range(2000))}, ["stop_token_ids", "2000", "1024"]),
        ({"ignore_eos": 1}, ["ignore_eos", "bool"]),
    ]
    for kwargs, words in bad:
        with pytest.raises(ValueError) as info:
            mc.SamplingParams(**kwargs)
        msg = str(info.value)
        assert "SamplingParams(" not in msg, msg  # names the field, does not dump the object
        for word in words:
            assert word in msg, (kwargs, msg)


def test_a_row_that_cannot_be_packed_as_is_still_packs():
    """Even a SamplingParams whose checks were bypassed packs (top_k clipped: a top_k at or
    past the vocabulary is no limit), so one row can never fail its step's packing."""
    wild = mc.SamplingParams(temperature=1.0)
    object.__setattr__(wild, "top_k", 2**40)
    sb = SamplingBatch.from_params([mc.SamplingParams(), wild], [0, 0], 4)
    assert sb.top_k.dtype == np.int32 and int(sb.top_k[1]) == np.iinfo(np.int32).max
    tokens, _ = jax.jit(sample)(_logits(rows=4), sb)
    assert tokens.shape == (4,)


def test_a_step_with_a_wild_row_completes_for_every_row():
    """Issue 24: a top_k of 2^40 in one row overflowed int32 when the step was packed, and the
    failed step failed all of its requests. Now every request of the step finishes normally."""
    from engine_helpers import make_engine

    engine = make_engine()
    wild = mc.SamplingParams(max_new_tokens=3, temperature=1.0, seed=1)
    object.__setattr__(wild, "top_k", 2**40)  # past the checks, as a buggy caller could
    outs = engine.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                           [mc.SamplingParams(max_new_tokens=3), wild,
                            mc.SamplingParams(max_new_tokens=3)])
    assert [o.finish_reason for o in outs] == ["length"] * 3, [o.error for o in outs]
    assert engine.metrics()["failed_steps"] == 0
