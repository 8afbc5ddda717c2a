"""The ``mtp`` drafter (``models/mtp.py``, ``engine/speculative/drafters.py``) on the tiny model
(fp32, reference kernels): the tokens of ``method = "none"`` exactly, logprobs within 1e-4; the
drafts the step makes equal a from-scratch computation (target forward over the verified tokens, the
MTP layer over every position, the chain); a checkpoint's ``mtp.*`` tensors load.

A random MTP head never agrees with a random target, which would leave acceptance untested.
So the model here is close to a bigram model (its layers scaled by 0.3: the next token depends
mostly on the current one) and the seeded head predicts that bigram's next step
(``with_seeded_mtp``): drafts are accepted at varying offsets, and the attention over the MTP's
own paged K/V still matters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.engine.runners.loading import load_model
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import build_forward_batch
from mambacache.engine.step.plan import SeqSpec
from models.model import forward
from models.mtp import accepted_counts, mtp_layer, with_seeded_mtp
from models.presets import get_preset
from tests.engine_helpers import BASE, assert_same_outputs

K = 3
NEW = 14


@functools.cache
def bigram_model():
    """(cfg, params): the tiny model with its layers scaled by 0.3 and the seeded MTP head,
    which for such a model predicts the token after next (``with_seeded_mtp``)."""
    cfg, params = load_model(mc.EngineConfig().replace(**{"model.init_branch_scale": 0.3}))
    return with_seeded_mtp(cfg, params, seed=5)


def _engine(**overrides) -> Engine:
    cfg = mc.EngineConfig().replace(**{**BASE, **overrides})
    return Engine(cfg, model=bigram_model())


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 500, 17).tolist()
    return [shared + rng.integers(1, 500, 5).tolist(), shared + rng.integers(1, 500, 12).tolist(),
            rng.integers(1, 500, 8).tolist()]


@pytest.fixture(scope="module")
def reference():
    sp = mc.SamplingParams(max_new_tokens=NEW)
    return _engine(**{"cache.enable": False}).generate(_prompts(), sp)


MTP = {"speculative.method": "mtp", "speculative.num_draft_tokens": K,
       "scheduler.check_integrity_every_step": True}


@pytest.mark.parametrize("overrides", [
    {"cache.page_size": 4, "scheduler.chunked_prefill_size": 13},
    pytest.param({"cache.page_size": 1, "cache.num_kv_tokens": 60, "cache.num_mamba_slots": 3},
                 marks=pytest.mark.slow),
    pytest.param({"cache.page_size": 1, "speculative.topk": 4}, marks=pytest.mark.slow),
], ids=["page4-chunk13", "page1-preempt", "page1-topk4"])
def test_same_as_none(reference, overrides):
    eng = _engine(**MTP, **overrides)
    outs = eng.generate(_prompts(), mc.SamplingParams(max_new_tokens=NEW))
    assert_same_outputs(outs, reference, atol=1e-4)
    m = eng.metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"], m
    assert m["spec_tokens_per_verify"] > 1.5, m
    if overrides.get("speculative.topk", 1) > 1:  # trees: the head's alternatives were taken
        assert m["spec_verify_rows"] > m["spec_verify_steps"] and m["spec_branch_wins"] > 0, m
    eng.check_integrity()


BUCKET = 64  # tokens and pages of the from-scratch batches (one compile for every call)


@functools.cache
def _ref_fns():
    cfg, params = bigram_model()
    fwd = jax.jit(functools.partial(forward, cfg=cfg, kernels="reference", return_hidden=True))
    layer = jax.jit(lambda *a: mtp_layer(cfg, params["mtp"], params["embed"], *a, "reference",
                                         None))
    return fwd, layer


def _reference_drafts(tokens: list[int], k: int) -> list[int]:
    """Drafts to follow ``tokens`` (the last one not computed yet), from scratch: the target
    over ``tokens[:-1]``, the MTP over every position, then the chain (fresh pools, one
    sequence, page size 1)."""
    cfg, params = bigram_model()
    fwd, layer = _ref_fns()
    n = len(tokens) - 1
    pools = PoolState.create(cfg, BUCKET, 1, 2, extra_kv_layers=1)
    pages = list(range(1, BUCKET + 1))

    def batch(toks, prefix):
        spec = SeqSpec(tokens=toks, prefix_len=prefix, page_ids=pages, read_slot=0,
                       write_slot=1, logits="all")
        return build_forward_batch([spec], 1, num_tokens=BUCKET, num_seqs=1,
                                   num_pages_per_seq=BUCKET, num_snapshots=1, num_logits=BUCKET)

    b = batch(tokens[:-1], 0)
    pools, _, hidden = fwd(params, pools, b)
    nxt = jnp.zeros(BUCKET, jnp.int32).at[:n].set(jnp.asarray(tokens[1:], jnp.int32))
    g, *kv = layer(nxt, hidden, pools.k_pages[-1], pools.v_pages[-1], b)
    h = jnp.broadcast_to(g[n - 1], g.shape)
    drafts = [int(jnp.argmax(h[0] @ params["lm_head"]))]
    for i in range(1, k):
        b = batch([drafts[-1]], n - 1 + i)
        h, *kv = layer(b.input_ids, h, *kv, b)
        drafts.append(int(jnp.argmax(h[0] @ params["lm_head"])))
    return drafts


def test_drafts_match_from_scratch():
    """Step by step (prefill, verify rows, a cache hit of the same prompt), each request's
    drafts for its next step are the from-scratch ones for its verified tokens."""
    eng = _engine(**MTP, **{"cache.page_size": 4})
    prompt = _prompts()[0]
    checked = 0
    for _ in range(2):  # the second request hits the first one's prefix
        rid = eng.add_request(prompt, mc.SamplingParams(max_new_tokens=8))
        while eng.has_unfinished():
            eng.step()
            req = eng.requests.get(rid)
            drafts = eng.scheduler.speculative.drafter._drafts.get(rid)
            if req is None or drafts is None or req.finish_reason is not None:
                continue
            assert drafts == _reference_drafts(req.token_ids.tolist(), K), (rid, checked)
            checked += 1
    assert checked >= 4
    assert eng.metrics()["cached_tokens"] > 0


def test_accepted_counts():
    """The device's accepted count: the run of agreeing drafts from ``first``, stopping at a
    position with no draft (the row's last) or at the first disagreement."""
    drafts = jnp.asarray([5, 6, 7, -1, 9, -1, 3, 4, -1], jnp.int32)
    target = jnp.asarray([5, 6, 1, 2, 9, 8, 3, 4, 4], jnp.int32)
    first = jnp.asarray([0, 4, 6, -1], jnp.int32)
    np.testing.assert_array_equal(accepted_counts(drafts, target, first, 3), [2, 1, 2, 0])


def test_needs_an_mtp_head():
    cfg = mc.EngineConfig().replace(**{**BASE, **MTP})
    from tests.engine_helpers import tiny_model

    with pytest.raises(ValueError, match="MTP head"):
        Engine(cfg, model=tiny_model())
    with pytest.raises(ValueError, match="MTP head"):
        with_seeded_mtp(get_preset("tiny_nemotron_h"), tiny_model()[1])
    with pytest.raises(ValueError, match="num_mtp_layers"):
        dataclasses.replace(tiny_model()[0], num_mtp_layers=2)


def test_abort_and_failing_step(reference):
    """An abort after verify rows and a step that raises leave nothing behind (lanes, slots,
    pages, drafts), and the next request is still exact."""
    eng = _engine(**MTP, **{"cache.page_size": 4})
    sp = mc.SamplingParams(max_new_tokens=NEW)
    rids = [eng.add_request(p, sp) for p in _prompts()]
    while eng.metrics()["spec_verify_steps"] < 2:
        eng.step()
    eng.abort(rids[2])
    real, calls = eng.runner.run, []

    def flaky(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 2:
            raise RuntimeError("planted step failure")
        return real(scheduled)

    eng.runner.run = flaky
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert any(o.finish_reason == "error" for o in outs), outs
    assert not eng.scheduler.speculative.drafter._drafts
    eng.check_integrity()
    again = eng.generate([_prompts()[0]], sp)
    assert_same_outputs(again, reference[:1])
    eng.check_integrity()
