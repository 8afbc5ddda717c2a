"""Parity of the Mamba2 hybrids (Nemotron-H, Granite 4.0-H) with transformers through the pools,
on the committed fixtures of ``scripts/make_mamba2_fixtures.py`` (dt clamp biting on 12-17% of
(token, head), every norm / A_log / dt_bias / D / conv bias randomised).

Same harness and tolerances as ``tests/test_parity.py`` (packed ragged batches, pages of 4,
slots out of order): fp32 within 1e-4 with greedy tokens identical (prefill, split prefill
through the pools, 16 greedy decode steps); bf16 within that file's mean / p90 bounds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_parity import (
    FP32_TOL,
    assert_bf16_close,
    fixture,
    max_err,
    run_greedy,
    run_prefill,
    run_split,
    split_prompts,
    step_fn,
)

NAMES = ("nemotron_h", "granitemoehybrid")


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_split_fp32(name):
    cfg, params, exp = fixture(name, "float32")
    prompts = split_prompts(exp)
    _, logits = run_prefill(params, cfg, prompts, jnp.float32)
    assert max_err(logits, exp["prefill_logits"]) < FP32_TOL
    split = run_split(params, cfg, prompts, exp["split_points"], jnp.float32)
    assert max_err(split, exp["split_logits"]) < FP32_TOL


@pytest.mark.parametrize("name", NAMES)
def test_greedy_fp32(name):
    cfg, params, exp = fixture(name, "float32")
    steps = exp["greedy_tokens"].shape[1]
    tokens, logits = run_greedy(params, cfg, split_prompts(exp), steps, jnp.float32)
    np.testing.assert_array_equal(tokens, exp["greedy_tokens"])
    assert max_err(logits, exp["greedy_logits"]) < FP32_TOL


@pytest.mark.parametrize("name", NAMES)
def test_bf16_within_tolerance(name):
    cfg, params, exp = fixture(name, "bfloat16")
    _, logits = run_prefill(params, cfg, split_prompts(exp), jnp.bfloat16)
    assert_bf16_close(logits, exp["prefill_logits"])
    hf_mean = np.abs(exp["prefill_logits_bf16"] - exp["prefill_logits"]).mean()
    assert np.abs(logits - exp["prefill_logits"]).mean() < 2 * hf_mean + 0.01


@pytest.mark.parametrize("name, family", [
    ("nemotron_h", "tpu"), ("nemotron_h", "gpu"),
    pytest.param("granitemoehybrid", "tpu", marks=pytest.mark.slow)])  # ~35 s: slow
def test_pallas_kernels_fp32(name, family, monkeypatch):
    """The model on the Pallas SSD / conv / attention kernels of ``family`` (interpreted on CPU)
    and, for Granite, the grouped (``ragged_dot``) MoE equals transformers like the references
    do: split prefill, 16 greedy steps."""
    monkeypatch.setenv("PALLAS_FAMILY", family)
    step_fn.cache_clear()  # compiled steps read PALLAS_FAMILY when tracing
    cfg, params, exp = fixture(name, "float32")
    prompts = split_prompts(exp)
    split = run_split(params, cfg, prompts, exp["split_points"], jnp.float32, kernels="pallas")
    assert max_err(split, exp["split_logits"]) < FP32_TOL
    steps = exp["greedy_tokens"].shape[1]
    tokens, logits = run_greedy(params, cfg, prompts, steps, jnp.float32, kernels="pallas")
    np.testing.assert_array_equal(tokens, exp["greedy_tokens"])
    assert max_err(logits, exp["greedy_logits"]) < FP32_TOL
    step_fn.cache_clear()
