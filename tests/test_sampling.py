"""The sampler: an all-greedy step (no vocabulary sort) returns what the per-row path returns,
and a mixed step still samples its temperature > 0 rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mambacache as mc
from mambacache.engine.sampling import SamplingBatch, _sample_row, sample


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
