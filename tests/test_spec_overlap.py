"""Speculative decoding overlapped with the host (``engine/speculative/chain.py``, issue 30): a
request's next row is dispatched before its verify row is read, shifted on the device by the
verify's outcome (MTP: drafts made on the device); ngram rows wait for their tokens and verify
the synchronous loop's drafts (issue 39). Outputs equal the synchronous loop's (greedy tokens,
fp32 logprobs within 1e-4; seeded sampling), most MTP verify steps overlap, a stop inside
accepted drafts keeps the tree exact, and the next turn hits the verified prefix.

The ngram and MTP cases run the near-bigram model of ``test_mtp.py`` (its greedy output falls
into cycles, so prompt lookup hits, and its seeded MTP head agrees often)."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine
from tests.engine_helpers import assert_same_outputs, spec_params, spec_prompts, tiny_model
from tests.test_mtp import _engine
from tests.test_speculative_engine import _spec_engine, references  # noqa: F401

CFG = {"cache.page_size": 4, "scheduler.chunked_prefill_size": 13,
       "speculative.num_draft_tokens": 3, "scheduler.check_integrity_every_step": True}


def _run(method: str, overlap: bool, prompts: list[list[int]], new: int):
    eng = _engine(**CFG, **{"speculative.method": method, "scheduler.overlap": overlap})
    return eng, eng.generate(prompts, mc.SamplingParams(max_new_tokens=new))


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_overlapped_equals_synchronous(method):
    """One request (so verify rows = verify steps), then a follow-up turn that hits it."""
    prompt = np.random.default_rng(3).integers(1, 500, 21).tolist()
    sync, ref = _run(method, False, [prompt], 24)
    eng, outs = _run(method, True, [prompt], 24)
    assert_same_outputs(outs, ref, atol=1e-4)
    m, ms = eng.metrics(), sync.metrics()
    assert ms["overlap_steps"] == 0 and eng.loop.depth == 1
    assert m["spec_verify_steps"] > 3 and m["spec_accepted_tokens"] > 0, m
    if method == "mtp":  # drafts made on the device: the next row is chained
        assert m["overlap_steps"] >= m["spec_verify_steps"] / 2, m
    else:  # drafts made on the host: each verify waits for its tokens (the synchronous rows)
        keys = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")
        assert {k: m[k] for k in keys} == {k: ms[k] for k in keys}
    follow = [prompt + outs[0].output_token_ids + [7, 8, 9]]
    again = eng.generate(follow, mc.SamplingParams(max_new_tokens=6))
    assert again[0].cached_tokens >= len(prompt), again[0].cached_tokens
    assert_same_outputs(again, sync.generate(follow, mc.SamplingParams(max_new_tokens=6)))
    eng.check_integrity()
    assert eng.in_flight is None and eng.cache.stats()["slots_held"] == 0


def test_stops_inside_drafts_sampled(references):  # noqa: F811
    """Seeded sampling with a stop token that lands inside accepted drafts while the chained
    row runs: the synchronous loop's tokens, and the follow-up turn computes the same."""
    ref = references[True]
    params = [mc.SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=p.seed,
                                stop_token_ids=(o.output_token_ids[6],))
              for p, o in zip(spec_params(True, 12), ref, strict=True)]
    out, pools = {}, {"cache.page_size": 4, "scheduler.chunked_prefill_size": 13}
    for overlap in (False, True):
        eng = _spec_engine(ref, **pools, **{"scheduler.overlap": overlap})
        out[overlap] = eng.generate(spec_prompts(), params)
        eng.check_integrity()
    assert_same_outputs(out[True], out[False], atol=1e-4)
    assert [o.finish_reason for o in out[True]] == [o.finish_reason for o in out[False]]
    assert any(o.finish_reason == "stop" for o in out[True])
    assert eng.metrics()["overlap_steps"] > 0
    turn2 = [o.prompt_token_ids + o.output_token_ids + [11, 12] for o in out[True]]
    sp = mc.SamplingParams(max_new_tokens=3)
    assert_same_outputs(eng.generate(turn2, sp),
                        _spec_engine(ref, **pools, **{"cache.enable": False}).generate(turn2, sp))
    eng.check_integrity()


def _item1_prompts() -> list[list[int]]:
    """Issue 39's workload: a 9-token pattern five times plus 4 tokens (prompt lookup hits),
    and two prompts without a pattern (ids in [3, 300))."""
    rng = np.random.default_rng(77)
    pat = rng.integers(3, 300, 9).tolist()
    return [pat * 5 + pat[:4], rng.integers(3, 300, 20).tolist(),
            rng.integers(3, 300, 40).tolist()]


def _item1_engine(**overrides):
    cfg = mc.EngineConfig.load("configs/tiny_qwen3_next.toml", overrides={
        "cache.page_size": 4, "scheduler.chunked_prefill_size": 37, **overrides})
    return Engine(cfg, model=tiny_model())


@pytest.mark.parametrize("adaptive", [True, False])
def test_ngram_drafts_under_overlap(adaptive):
    """Issue 39 item 1: ngram under overlap (the default) drafted nothing (each chained row
    guessed its bonus; the guess missed). Overlapped, the engine verifies the same drafts on
    the same steps as the synchronous loop, with the outputs of both and of no speculation."""
    prompts, sp = _item1_prompts(), mc.SamplingParams(max_new_tokens=20)
    spec = {"speculative.method": "ngram", "speculative.num_draft_tokens": 4,
            "speculative.adaptive": adaptive}
    runs = {}
    for overlap in (True, False):
        eng = _item1_engine(**spec, **{"scheduler.overlap": overlap})
        runs[overlap] = eng, eng.generate(prompts, sp)
    off = _item1_engine().generate(prompts, sp)
    (eng, outs), (sync, ref) = runs[True], runs[False]
    assert eng.loop.depth == 1 and sync.loop.depth == 0
    assert_same_outputs(outs, ref, atol=1e-4)
    assert_same_outputs(outs, off, atol=1e-4)
    m, ms = eng.metrics(), sync.metrics()
    assert m["spec_verify_steps"] > 0, m
    keys = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_rows")
    assert {k: m[k] for k in keys} == {k: ms[k] for k in keys}
    eng.check_integrity()
    assert eng.in_flight is None
