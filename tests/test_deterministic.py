"""``model.deterministic`` (issue 28): in bf16, a request's tokens and logprobs are identical
(``==``) whether it runs alone, cache off, chunked prefill 256, or among other requests with the
cache on (shared prefixes, an identical prompt), chunked prefill 13, page size 4; with
``speculative.method`` ``"none"`` and ``"ngram"``.

The default family without drafts runs in CI; the other cases (same test, more compiles) behind
``-m slow``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.buckets import DETERMINISTIC_MIN_ROWS, Buckets
from mambacache.engine.engine import Engine, load_model
from pallas_kernels._common import l2norm
from pallas_kernels.fixed_order import fixed_order, tree_sum
from tests.multidevice import finish_worker, start_worker

GREEDY = mc.SamplingParams(max_new_tokens=5)
SLOW = pytest.mark.slow
PRESETS = ("tiny_qwen3_next", "tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_nemotron_h",
           "tiny_granite_4_h", "tiny_kimi_linear")
CASES = [("tiny_qwen3_next", "none")] + [  # (preset, speculative.method)
    pytest.param(p, m, marks=SLOW) for m in ("none", "ngram") for p in PRESETS
    if (p, m) != ("tiny_qwen3_next", "none")]


@functools.cache
def _model(preset: str):
    return load_model(mc.EngineConfig().replace(**{"model.preset": preset,
                                                   "model.dtype": "bfloat16"}))


def _engine(preset: str, **overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{
        "model.preset": preset, "model.dtype": "bfloat16", "model.kernels": "reference",
        "model.deterministic": True, "cache.num_kv_tokens": 1024, "cache.num_mamba_slots": 24,
        "scheduler.max_running_requests": 8, **overrides})
    return Engine(cfg, model=_model(preset))


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 512, 30).tolist()
    prompts = [shared + rng.integers(0, 512, n).tolist() for n in (7, 12)]
    prompts.append(rng.integers(0, 512, 20).tolist())
    others = [rng.integers(0, 512, n).tolist() for n in (9, 33)]
    return prompts + [prompts[0]], others


@pytest.mark.parametrize("preset,method", CASES)
def test_alone_equals_batched_chunked_cached(preset, method):
    check_alone_equals_batched(preset, **{"speculative.method": method})


@SLOW
def test_alone_equals_batched_at_tensor_parallel_2():
    """Both runs at TP 2 (4 forced CPU devices, in a subprocess)."""
    worker = ("import json\n"
              "from tests.test_deterministic import check_alone_equals_batched\n"
              "check_alone_equals_batched('tiny_qwen3_next', **{'parallel.tensor_parallel': 2})\n"
              "print(json.dumps({'ok': True}))\n")
    assert finish_worker(start_worker(worker), "tp2", timeout=1500) == {"ok": True}


def check_alone_equals_batched(preset: str, **overrides) -> None:
    """The issue's check for ``preset`` (``overrides`` in both runs)."""
    prompts, others = _prompts()
    alone = _engine(preset, **{"cache.enable": False, "cache.page_size": 4,
                               "scheduler.chunked_prefill_size": 256, **overrides})
    a = [alone.generate([p], GREEDY)[0] for p in prompts]
    batched = _engine(preset, **{"cache.page_size": 4, "scheduler.chunked_prefill_size": 13,
                                 **overrides})
    batched.generate([prompts[0][:34], others[0]], GREEDY)  # the shared prefix is cached
    b = batched.generate(prompts + others, GREEDY)[:len(prompts)]
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids, (preset, x.request_id)
        assert x.output_logprobs == y.output_logprobs, (preset, x.request_id)
    assert b[0].cached_tokens == 32 and b[3].cached_tokens >= 32, [o.cached_tokens for o in b]
    batched.check_integrity()


def test_fixed_order_rows_do_not_depend_on_the_row_count():
    """fp32 l2norm of rows 0..39: XLA's reduce rounds them differently at T = 64 and T = 256 on
    CPU; the fixed-order tree does not (and equals a plain sum to rounding)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((256, 2, 16)), jnp.float32)

    def rows(on: bool, t: int) -> np.ndarray:
        def fn(a):
            with fixed_order(on):
                return l2norm(a)
        return np.asarray(jax.jit(fn)(x[:t])[:40])

    assert all(np.array_equal(rows(True, t), rows(True, 64)) for t in (128, 256))
    np.testing.assert_allclose(rows(True, 64), rows(False, 64), rtol=1e-6)
    np.testing.assert_allclose(tree_sum(x[..., :5])[..., 0], x[..., :5].sum(-1), atol=1e-5)


def test_min_rows_pads_every_program():
    b = Buckets(page_size=4, max_seqs=32, max_seq_len=256, max_step_tokens=64,
                min_rows=DETERMINISTIC_MIN_ROWS)
    assert b.widths() == [32] and b.token_ladder() == [32, 64]
    assert min(s.num_tokens for s in b.program_set()) == DETERMINISTIC_MIN_ROWS
    with pytest.raises(ValueError, match="min_rows"):
        Buckets(page_size=4, max_seqs=8, max_seq_len=256, max_step_tokens=64, min_rows=32)
