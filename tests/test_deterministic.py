"""``model.deterministic`` (issue 28): in bf16, a request's tokens and logprobs are identical
(``==``) whether it runs alone, cache off, chunked prefill 256, or among other requests with the
cache on (shared prefixes, an identical prompt), chunked prefill 13, page size 4; with
``speculative.method`` ``"none"``, ``"ngram"`` (chains and trees) and ``"mtp"``, seeded top-k
/ top-p sampling, preemption, and both runs at tensor parallel 2.

The default family without drafts and the sampler's unit checks run in CI; the family sweeps
(same check, more compiles) behind ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine, load_model, prefill_grid
from mambacache.engine.sampling.sampler import SamplingBatch, sample
from mambacache.engine.step.buckets import DETERMINISTIC_MIN_ROWS, Buckets
from pallas_kernels import ops
from pallas_kernels._common import l2norm
from pallas_kernels.fixed_order import prefix_sum, tree_sum
from tests.multidevice import finish_worker, start_worker
from tests.shadow_helpers import greedy, random_prompts, shadow_engine

GREEDY = mc.SamplingParams(max_new_tokens=5)
#: seeded sampling with top-k and top-p (the sampler's sort, softmax and cumulative sum)
SAMPLED = mc.SamplingParams(max_new_tokens=5, temperature=0.9, top_k=40, top_p=0.9, seed=7)
SLOW = pytest.mark.slow
PRESETS = ("tiny_qwen3_next", "tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_nemotron_h",
           "tiny_granite_4_h", "tiny_kimi_linear")
MTP_PRESETS = ("tiny_qwen3_next", "tiny_qwen3_5", "tiny_qwen3_5_moe")  # families with an MTP head
CASES = [("tiny_qwen3_next", "none")] + [  # (preset, speculative.method)
    pytest.param(p, m, marks=SLOW) for m in ("none", "ngram") for p in PRESETS
    if (p, m) != ("tiny_qwen3_next", "none")]


@functools.cache
def _model(preset: str, method: str = "none", branch_scale: float = 1.0):
    return load_model(mc.EngineConfig().replace(**{
        "model.preset": preset, "model.dtype": "bfloat16", "speculative.method": method,
        "model.init_branch_scale": branch_scale}))


def _engine(preset: str, **overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{
        "model.preset": preset, "model.dtype": "bfloat16", "model.kernels": "reference",
        "model.deterministic": True, "cache.num_kv_tokens": 1024, "cache.num_mamba_slots": 24,
        "scheduler.max_running_requests": 8, **overrides})
    return Engine(cfg, model=_model(preset, cfg.speculative.method,
                                    cfg.model.init_branch_scale))


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 512, 30).tolist()
    prompts = [shared + rng.integers(0, 512, n).tolist() for n in (7, 12)]
    prompts.append(rng.integers(0, 512, 20).tolist())
    others = [rng.integers(0, 512, n).tolist() for n in (9, 33)]
    return prompts + [prompts[0]], others


@pytest.mark.parametrize("preset,method", CASES)
def test_alone_equals_batched_chunked_cached(preset, method):
    if method == "none":
        check_alone_equals_batched(preset)
        return
    # shrunk branches: greedy output falls into cycles that prompt lookup drafts (a random
    # model at scale 1 never repeats itself, so no draft would ever be accepted)
    metrics = check_alone_equals_batched(preset, mc.SamplingParams(max_new_tokens=24), **{
        "speculative.method": method, "model.init_branch_scale": 0.2})
    assert metrics["spec_accepted_tokens"] > 0, metrics


@SLOW
@pytest.mark.parametrize("preset", PRESETS)
def test_draft_tree_alone_equals_batched(preset):
    """ngram drafts as a tree (``speculative.topk`` 2: one verify row per branch; page size 1
    in both runs, which trees need)."""
    metrics = check_alone_equals_batched(
        preset, mc.SamplingParams(max_new_tokens=24),
        batched={"scheduler.check_integrity_every_step": True},
        **{"speculative.method": "ngram", "speculative.topk": 2, "cache.page_size": 1,
           "model.init_branch_scale": 0.2})
    assert metrics["spec_accepted_tokens"] > 0 and metrics["cached_tokens"] > 0, metrics


@SLOW
@pytest.mark.parametrize("preset,method", [(p, m) for m in ("none", "ngram") for p in PRESETS])
def test_sampled_alone_equals_batched(preset, method):
    """Seeded sampling with top-k / top-p: the same tokens and logprobs alone or batched (the
    batch's other requests greedy); with ngram drafts, verified by sampling (temperature 0.05
    on the shrunk model: at 0.3 its samples broke the cycles and most families accepted no
    draft; the bits were == either way)."""
    if method == "none":
        check_alone_equals_batched(preset, SAMPLED)
        return
    metrics = check_alone_equals_batched(
        preset, dataclasses.replace(SAMPLED, max_new_tokens=24, temperature=0.05),
        **{"speculative.method": method, "model.init_branch_scale": 0.2})
    assert metrics["spec_accepted_tokens"] > 0, metrics


@SLOW
@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_mtp_alone_equals_batched(preset):
    metrics = check_alone_equals_batched(preset, **{"speculative.method": "mtp"})
    assert metrics["spec_accepted_tokens"] > 0, metrics


@SLOW
@pytest.mark.parametrize("preset", PRESETS)
def test_preempted_alone_equals_batched(preset):
    """The batched run's KV pool (96 tokens) is too small for its requests: the newest are
    preempted (progress cached), resumed, and still give the bits they give alone."""
    metrics = check_alone_equals_batched(
        preset, mc.SamplingParams(max_new_tokens=16),
        batched={"cache.num_kv_tokens": 96, "scheduler.check_integrity_every_step": True})
    assert metrics["preemptions"] > 0, metrics


@SLOW
@pytest.mark.parametrize("preset", PRESETS)
def test_alone_equals_batched_at_tensor_parallel_2(preset):
    """Both runs at TP 2 (4 forced CPU devices, in a subprocess)."""
    worker = ("import json\n"
              "from tests.test_deterministic import check_alone_equals_batched\n"
              f"check_alone_equals_batched({preset!r}, **{{'parallel.tensor_parallel': 2}})\n"
              "print(json.dumps({'ok': True}))\n")
    assert finish_worker(start_worker(worker), f"tp2 {preset}", timeout=1500) == {"ok": True}


PALLAS_PRESETS = ("tiny_qwen3_next", "tiny_nemotron_h", "tiny_kimi_linear")


@SLOW
@pytest.mark.parametrize("family", ["tpu", "gpu"])
@pytest.mark.parametrize("preset", PALLAS_PRESETS)
def test_pallas_alone_equals_batched(preset, family, monkeypatch):
    """The issue's check with ``model.kernels = "pallas"`` (interpreted on CPU): prompts past
    the grid (a 70-token shared prefix), chunked prefill 64 (the grid, the least allowed)
    batched; the shared prefix and the identical prompt hit at the grid point 64."""
    monkeypatch.setenv("PALLAS_FAMILY", family)
    check_pallas_alone_equals_batched(preset)


@SLOW
@pytest.mark.parametrize("family", ["gpu", "tpu"])
@pytest.mark.parametrize("preset", PALLAS_PRESETS)
def test_pallas_alone_equals_batched_at_tensor_parallel_2(preset, family):
    """The Pallas check with both runs at TP 2 (every kernel op per device in shard_map; 4
    forced CPU devices, in a subprocess)."""
    worker = ("import json\n"
              "from tests.test_deterministic import check_pallas_alone_equals_batched\n"
              f"check_pallas_alone_equals_batched({preset!r}, "
              "**{'parallel.tensor_parallel': 2})\n"
              "print(json.dumps({'ok': True}))\n")
    proc = start_worker(worker, env={"PALLAS_FAMILY": family})
    assert finish_worker(proc, f"pallas tp2 {preset} {family}", timeout=1500) == {"ok": True}


@SLOW
@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_pallas_alone_equals_batched_multi_step(family, monkeypatch):
    """The Pallas check with the batched run decoding 4 iterations per dispatch
    (``scheduler.decode_steps``; the one-at-a-time run decodes one per step)."""
    monkeypatch.setenv("PALLAS_FAMILY", family)
    engine = check_pallas_alone_equals_batched("tiny_qwen3_next",
                                               batched={"scheduler.decode_steps": 4})
    keys = engine.runner.program_keys  # no warm-up: a program compiled is a program run
    assert any(("iterations", 4) in key for key in keys), keys


def check_pallas_alone_equals_batched(preset: str, batched: dict | None = None,
                                      **overrides) -> Engine:
    """The issue's check with ``model.kernels = "pallas"`` (the family from ``PALLAS_FAMILY``;
    ``overrides`` in both runs, ``batched`` in the batched one); asserts the hits at the grid
    point 64. Returns the batched engine."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 512, 70).tolist()
    prompts = [shared + rng.integers(0, 512, n).tolist() for n in (7, 60)]
    prompts += [rng.integers(0, 512, 20).tolist(), prompts[0]]
    others = [rng.integers(0, 512, n).tolist() for n in (9, 33)]
    pallas = {"model.kernels": "pallas", "cache.num_kv_tokens": 2048, **overrides}
    alone = _engine(preset, **{"cache.enable": False, "cache.page_size": 4,
                               "scheduler.chunked_prefill_size": 256, **pallas})
    a = [alone.generate([p], GREEDY)[0] for p in prompts]
    engine = _engine(preset, **{"cache.page_size": 4, "scheduler.chunked_prefill_size": 64,
                                **pallas, **(batched or {})})
    engine.generate([prompts[0][:72], others[0]], GREEDY)  # the shared prefix is cached
    b = engine.generate(prompts + others, GREEDY)[:len(prompts)]
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids, (preset, x.request_id)
        assert x.output_logprobs == y.output_logprobs, (preset, x.request_id)
    assert [o.cached_tokens for o in b] == [64, 64, 0, 64], [o.cached_tokens for o in b]
    engine.check_integrity()
    return engine


def check_alone_equals_batched(preset: str, params: mc.SamplingParams = GREEDY,
                               batched: dict | None = None, **overrides) -> dict:
    """The issue's check for ``preset`` (``overrides`` in both runs, ``batched`` in the
    batched run only: then its cache hits are not asserted). The batch's other requests are
    greedy. Returns the batched engine's metrics."""
    prompts, others = _prompts()
    alone = _engine(preset, **{"cache.enable": False, "cache.page_size": 4,
                               "scheduler.chunked_prefill_size": 256, **overrides})
    a = [alone.generate([p], params)[0] for p in prompts]
    engine = _engine(preset, **{"cache.page_size": 4, "scheduler.chunked_prefill_size": 13,
                                **overrides, **(batched or {})})
    engine.generate([prompts[0][:34], others[0]], GREEDY)  # the shared prefix is cached
    b = engine.generate(prompts + others,
                        [params] * len(prompts) + [GREEDY] * len(others))[:len(prompts)]
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids, (preset, x.request_id)
        assert x.output_logprobs == y.output_logprobs, (preset, x.request_id)
    if not batched:
        assert b[0].cached_tokens == 32 and b[3].cached_tokens >= 32, [o.cached_tokens for o in b]
    engine.check_integrity()
    return engine


def test_fixed_order_rows_do_not_depend_on_the_row_count():
    """fp32 l2norm of rows 0..39: XLA's reduce rounds them differently at T = 64 and T = 256 on
    CPU; the fixed-order tree does not (and equals a plain sum to rounding)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((256, 2, 16)), jnp.float32)

    def rows(on: bool, t: int) -> np.ndarray:
        fn = jax.jit(functools.partial(l2norm, fixed_order=on))
        return np.asarray(fn(x[:t])[:40])

    assert all(np.array_equal(rows(True, t), rows(True, 64)) for t in (128, 256))
    np.testing.assert_allclose(rows(True, 64), rows(False, 64), rtol=1e-6)
    np.testing.assert_allclose(tree_sum(x[..., :5])[..., 0], x[..., :5].sum(-1), atol=1e-5)


_fixed_sample = jax.jit(functools.partial(sample, fixed_order=True))


def test_sampler_rows_do_not_depend_on_the_batch():
    """Under ``fixed_order`` a row's token and logprob are the same (``==``) whatever the row
    count and whatever the other rows sample (greedy rows among sampled ones take the sort
    path); the fixed prefix sum equals ``cumsum`` to rounding."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((64, 128)) * 3, jnp.float32)

    def run(n: int, sampled_rows: int) -> tuple[np.ndarray, np.ndarray]:
        ps = [SAMPLED if i < sampled_rows else GREEDY for i in range(n)]
        sb = SamplingBatch.from_params(ps, list(range(n)), n)
        tokens, logprobs = _fixed_sample(logits[:n], sb)
        return np.asarray(tokens)[:32], np.asarray(logprobs)[:32]

    ref_tokens, ref_logprobs = run(32, 16)
    tokens, logprobs = run(64, 16)
    assert np.array_equal(tokens, ref_tokens) and np.array_equal(logprobs, ref_logprobs)
    greedy_tokens, greedy_logprobs = run(32, 0)  # every row greedy: no sort
    assert np.array_equal(greedy_tokens[16:], ref_tokens[16:])
    assert np.array_equal(greedy_logprobs[16:], ref_logprobs[16:])
    x = jax.nn.softmax(logits, -1)
    np.testing.assert_allclose(prefix_sum(x, fixed_order=True), jnp.cumsum(x, -1), atol=1e-6)


def test_pallas_is_accepted_and_what_its_grid_cannot_serve_is_refused():
    """``kernels = "pallas"`` runs deterministic on a prefill grid; ``"auto"`` runs the
    references on CPU (the Pallas kernels elsewhere); speculative decoding and a chunked
    prefill below the grid are ``ValueError``s naming the value."""
    cfg = mc.EngineConfig().replace(**{"model.kernels": "pallas", "model.deterministic": True})
    # the mode no longer changes the kernels' choice: resolve_impl takes no mode
    assert ops.resolve_impl("pallas") == "pallas"
    assert ops.resolve_impl("auto") == "reference"  # on CPU
    assert prefill_grid(cfg) == ops.DETERMINISTIC_GRID
    assert prefill_grid(cfg.replace(**{"model.kernels": "auto"})) == 0
    assert prefill_grid(cfg.replace(**{"model.deterministic": False})) == 0
    with pytest.raises(ValueError, match="chunked_prefill_size \\(13\\) must be >= .* \\(64\\)"):
        prefill_grid(cfg.replace(**{"scheduler.chunked_prefill_size": 13}))
    with pytest.raises(ValueError, match="speculative.method 'ngram'"):
        prefill_grid(cfg.replace(**{"speculative.method": "ngram"}))


def test_grid_cuts_prefills_and_keeps_prompt_states_on_it():
    """[deterministic, Pallas] on the shadow runner (no model): every prefill row starts on the
    grid and ends on it or at the prompt's end, a token past the prompt goes alone (a
    preempted request's recomputation), and hits land on the grid within the previous prompt:
    a follow-up turn hits 128 of its 158 cached tokens, and an identical prompt 128."""
    grid = ops.DETERMINISTIC_GRID
    rows: list[tuple[int, int, int]] = []  # (prompt_len, start, end) of the pallas run's rows

    def engine(kernels: str) -> Engine:
        eng = shadow_engine(**{"model.kernels": kernels, "model.deterministic": True,
                               "cache.page_size": 4, "scheduler.chunked_prefill_size": 100})
        run = eng.runner.run

        def recording(scheduled):
            if kernels == "pallas":
                rows.extend((s.req.prompt_len, s.start, s.end) for s in scheduled)
            return run(scheduled)

        eng.runner.run = recording
        return eng

    first = random_prompts(1000, 1, length=150)[0]
    cached = {}
    for kernels in ("reference", "pallas"):
        eng = engine(kernels)
        out = eng.generate([first], greedy(8))[0]
        follow = first + out.output_token_ids + random_prompts(1000, 1, length=30, seed=1)[0]
        again = eng.generate([follow, first], greedy(8))
        cached[kernels] = [o.cached_tokens for o in again]
        eng.check_integrity()
    assert cached == {"reference": [156, 148], "pallas": [2 * grid, 2 * grid]}, cached
    for prompt_len, start, end in rows:
        if start >= prompt_len:
            assert end == start + 1, (prompt_len, start, end)
        else:
            assert start % grid == 0 and (end % grid == 0 or end == prompt_len), (start, end)
    assert {(150, 0, 64), (150, 64, 150)} <= set(rows), rows  # budget 100: 64, then the rest


def test_grid_recomputes_a_preempted_request_one_token_past_its_prompt():
    """[deterministic, Pallas] a KV pool too small for 4 requests: the preempted ones resume
    from a grid state and recompute their outputs one token per row (the oracle checks every
    read)."""
    grid = ops.DETERMINISTIC_GRID
    eng = shadow_engine(**{"model.kernels": "pallas", "model.deterministic": True,
                           "cache.page_size": 4, "scheduler.chunked_prefill_size": 100,
                           "cache.num_kv_tokens": 300})
    rows, run = [], eng.runner.run

    def recording(scheduled):
        rows.extend((s.req.prompt_len, s.start, s.end) for s in scheduled)
        return run(scheduled)

    eng.runner.run = recording
    eng.generate(random_prompts(1000, 4, length=90), greedy(30))
    eng.check_integrity()
    assert eng.metrics()["preemptions"] > 0
    for prompt_len, start, end in rows:
        assert (end == start + 1) if start >= prompt_len else (
            start % grid == 0 and (end % grid == 0 or end == prompt_len)), (start, end)


def test_min_rows_pads_every_program():
    b = Buckets(page_size=4, max_seqs=32, max_seq_len=256, max_step_tokens=64,
                min_rows=DETERMINISTIC_MIN_ROWS)
    assert b.widths() == [32] and b.token_ladder() == [32, 64]
    assert min(s.num_tokens for s in b.program_set()) == DETERMINISTIC_MIN_ROWS
    with pytest.raises(ValueError, match="min_rows"):
        Buckets(page_size=4, max_seqs=8, max_seq_len=256, max_step_tokens=64, min_rows=32)
