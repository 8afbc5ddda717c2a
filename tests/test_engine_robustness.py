"""Pressure, bad input, aborts and failing steps: the engine keeps serving, nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens

PARAMS = mc.SamplingParams(max_new_tokens=4)


def pressure_prompts():
    rng = np.random.default_rng(7)
    shared = [rand_tokens(rng, 24) for _ in range(4)]
    return [shared[i % 4] + rand_tokens(rng, 3 + i % 5) for i in range(64)]


def test_four_state_slots_serve_64_requests():
    prompts = pressure_prompts()
    engine = make_engine(**{"cache.num_mamba_slots": 4, "scheduler.check_integrity_every_step":
                            True})
    outs = engine.generate(prompts, PARAMS)
    reference = make_engine(**{"cache.enable": False}).generate(prompts, PARAMS)
    assert_same_outputs(outs, reference)
    assert not engine.has_unfinished()
    engine.check_integrity()
    stats = engine.cache.stats()
    assert stats["slots_held"] == 0 and stats["pages_held"] == 0


def test_small_kv_pool_preempts_and_stays_exact():
    rng = np.random.default_rng(8)
    prompts = [rand_tokens(rng, 20) for _ in range(6)]
    params = mc.SamplingParams(max_new_tokens=30)
    engine = make_engine(**{"cache.num_kv_tokens": 120, "scheduler.check_integrity_every_step":
                            True})
    outs = engine.generate(prompts, params)
    assert engine.metrics()["preemptions"] > 0
    reference = make_engine(**{"cache.enable": False}).generate(prompts, params)
    assert_same_outputs(outs, reference)
    engine.check_integrity()


BAD_INPUTS = [
    ([], PARAMS, "non-empty"),
    ([1, 2, 10**6], PARAMS, "outside the vocabulary"),
    ([1, -3], PARAMS, "outside the vocabulary"),
    ([[1, 2]], PARAMS, "1-D"),
    ([1.5, 2.0], PARAMS, "integers"),
    ([1] * 4090, PARAMS, "can never fit the KV pool"),
    ([1, 2], mc.SamplingParams(max_new_tokens=40000), "exceeds the context length"),
    ([1, 2], mc.SamplingParams(stop_token_ids=(10**6,)), "stop token id"),
]


@pytest.mark.parametrize("prompt,params,match", BAD_INPUTS)
def test_bad_input_is_value_error_and_engine_serves_after(prompt, params, match):
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    engine.check_integrity()
    out = engine.generate([[1, 2, 3]], PARAMS)[0]
    assert len(out.output_token_ids) == 4


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(max_new_tokens=0),
                                    dict(temperature=float("nan")), dict(seed=-5)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        mc.SamplingParams(**kwargs)


def test_abort_frees_everything():
    engine = make_engine()
    rid = engine.add_request(rand_tokens(np.random.default_rng(0), 30),
                             mc.SamplingParams(max_new_tokens=50))
    waiting = engine.add_request([4, 5, 6], PARAMS)
    engine.step()
    engine.step()
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and len(out.output_token_ids) >= 1
    assert engine.abort(waiting).finish_reason == "abort"
    assert engine.abort(12345) is None
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.cache.stats()["slots_held"] == 0


def test_failing_step_fails_its_requests_only(monkeypatch):
    engine = make_engine(**{"scheduler.chunked_prefill_size": 12})
    rng = np.random.default_rng(9)
    victim = engine.add_request(rand_tokens(rng, 12), PARAMS)
    survivor = engine.add_request(rand_tokens(rng, 10), PARAMS)  # no budget left: waits
    real_run = engine.runner.run
    calls = []

    def failing_run(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return real_run(scheduled)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    failed = engine.step()
    assert [o.request_id for o in failed] == [victim]
    assert failed[0].finish_reason == "error" and "kernel exploded" in failed[0].error
    engine.check_integrity()
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [o.request_id for o in done] == [survivor]
    assert done[0].finish_reason == "length" and len(done[0].output_token_ids) == 4
    engine.check_integrity()
    assert engine.cache.stats()["slots_held"] == 0
