"""``scheduler.overlap``: on the real model, a request that stops while its next row is in flight
and a read that fails; on the shadow runner, a request preempted with its last token in flight
(cheap directed cases; the shadow fuzz in test_engine_fuzz.py covers the rest both ways)."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens
from tests.shadow_helpers import greedy, shadow_engine

SYNC_OFF = {"cache.enable": False, "scheduler.overlap": False}


def test_stop_token_with_a_row_in_flight_is_exact_and_cached():
    """The stop token's row ran one step late: outputs equal the synchronous loop's, and the
    release inserts prompt + every output with the running slot as the end state, so the next
    turn hits all of it."""
    rng = np.random.default_rng(11)
    prompts = [rand_tokens(rng, 21), rand_tokens(rng, 17)]
    free = make_engine(**SYNC_OFF).generate(prompts, mc.SamplingParams(max_new_tokens=8))
    stops = [o.output_token_ids[3] for o in free]
    params = [mc.SamplingParams(max_new_tokens=8, stop_token_ids=(t,)) for t in stops]
    engine = make_engine(**{"scheduler.check_integrity_every_step": True})
    outs = engine.generate(prompts, params)
    assert_same_outputs(outs, make_engine(**SYNC_OFF).generate(prompts, params))
    assert all(o.finish_reason == "stop" for o in outs)
    assert engine.metrics()["overlap_steps"] > 0
    turn2 = [o.prompt_token_ids + o.output_token_ids + rand_tokens(rng, 5) for o in outs]
    again = engine.generate(turn2, mc.SamplingParams(max_new_tokens=3))
    for out, prev in zip(again, outs, strict=True):
        assert out.cached_tokens == len(prev.prompt_token_ids) + len(prev.output_token_ids)
    assert_same_outputs(again, make_engine(**SYNC_OFF).generate(turn2, mc.SamplingParams(
        max_new_tokens=3)))
    engine.check_integrity()
    assert engine.in_flight is None and engine.cache.stats()["slots_held"] == 0


class _Unreadable:
    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("device lost")


def test_failed_read_fails_everything_in_flight_then_serves(monkeypatch):
    rng = np.random.default_rng(12)
    engine = make_engine()
    a = engine.add_request(rand_tokens(rng, 12), mc.SamplingParams(max_new_tokens=6))
    b = engine.add_request(rand_tokens(rng, 9), mc.SamplingParams(max_new_tokens=6))
    real_run = engine.runner.run
    calls = []

    def run(scheduled):
        tokens, logprobs = real_run(scheduled)
        calls.append(len(scheduled))
        return (_Unreadable(), logprobs) if len(calls) == 2 else (tokens, logprobs)

    monkeypatch.setattr(engine.runner, "run", run)
    failed = engine.step() + engine.step() + engine.step()  # step 2's tokens are read in call 3
    assert sorted(o.request_id for o in failed) == [a, b]
    assert all(o.finish_reason == "error" and "device lost" in o.error for o in failed)
    assert not engine.has_unfinished() and engine.in_flight is None
    engine.check_integrity()
    prompt = rand_tokens(rng, 15)
    params = mc.SamplingParams(max_new_tokens=5)
    assert_same_outputs(engine.generate([prompt], params),
                        make_engine(**SYNC_OFF).generate([prompt], params))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_config_and_idle_share_reported(overlap):
    engine = make_engine(**{"scheduler.overlap": overlap})
    rng = np.random.default_rng(13)
    engine.generate([rand_tokens(rng, 10) for _ in range(3)], mc.SamplingParams(max_new_tokens=4))
    m = engine.metrics()
    assert 0.0 <= m["device_idle_share"] < 1.0
    assert (m["overlap_steps"] > 0) == overlap  # every later step was dispatched before a read
    with pytest.raises(ValueError, match="scheduler.overlap"):
        mc.EngineConfig().replace(**{"scheduler.overlap": "yes"})


def test_preempted_with_its_last_token_in_flight_finishes_waiting():
    """Shadow runner, 9 KV tokens: A (5 + 4) and B (4 + 1) fill the pool with their prefills;
    A's first decode needs a page while B's only token is still in flight, so B is preempted
    (its prompt goes to the tree) and finishes in the waiting queue when its token is read."""
    eng = shadow_engine(**{"cache.num_kv_tokens": 9, "cache.page_size": 1})
    a, b = [5, 6, 7, 8, 9], [1, 2, 3, 4]
    ids = {eng.add_request(a, greedy(4)): (a, 4), eng.add_request(b, greedy(1)): (b, 1)}
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.metrics()["preemptions"] == 1
    for out in outs:
        prompt, n = ids[out.request_id]
        assert out.finish_reason == "length"
        assert out.output_token_ids == eng.runner.expected_output(prompt, n)
    assert len(outs) == 2 and eng.in_flight is None
    eng.check_integrity()


def test_speculative_decoding_on_the_shadow_runner_runs_the_synchronous_loop():
    """The shadow runner shifts no chained rows (engine/speculative/chain.py): depth 0 there."""
    cfg = {"speculative.method": "ngram", "speculative.num_draft_tokens": 2}
    assert shadow_engine(**cfg).overlap is False
    assert shadow_engine().overlap is True
    eng = shadow_engine(**cfg)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    out = eng.generate([prompt], greedy(6))[0]
    assert out.output_token_ids == eng.runner.expected_output(prompt, 6)


class _Watched:
    """A step's output on the shadow runner that logs, when the host reads it: the step, how
    many steps were dispatched by then, whether work was left and the ``Engine.step`` call."""

    def __init__(self, array, step, engine, log):
        self.array, self.step, self.engine, self.log = array, step, engine, log

    def __array__(self, dtype=None, copy=None):
        if self.log is not None:
            self.log["reads"].append((self.step, len(self.log["dispatched"]),
                                      self.engine.has_unfinished(), len(self.log["calls"])))
        return np.asarray(self.array, dtype)


def test_a_step_is_read_after_the_next_is_dispatched_and_no_row_runs_past_its_length():
    """The overlapped loop reads step k only once step k + 1 is dispatched, unless the call had
    nothing to dispatch or nothing is left to run; and a request whose last token is in flight
    (``max_new_tokens``) gets no row: every request samples exactly its length."""
    eng = shadow_engine()
    rng = np.random.default_rng(14)
    lengths = [1, 2, 5, 9, 3, 7, 4, 6, 2, 8, 1, 5]
    prompts = [rand_tokens(rng, int(n)) for n in rng.integers(3, 40, len(lengths))]
    real_run, rows = eng.runner.run, {}
    log = {"dispatched": [], "reads": [], "calls": []}

    def run(scheduled):
        tokens, logprobs = real_run(scheduled)
        for s in scheduled:
            rows[s.req.request_id] = rows.get(s.req.request_id, 0) + s.samples
        log["dispatched"].append(len(log["calls"]))
        k = len(log["dispatched"]) - 1
        return _Watched(tokens, k, eng, log), _Watched(logprobs, k, eng, None)

    eng.runner.run = run
    ids = {eng.add_request(p, greedy(n)): (p, n) for p, n in zip(prompts, lengths, strict=True)}
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
        log["calls"].append(None)
    assert len(outs) == len(lengths) and eng.in_flight is None
    for out in outs:
        prompt, n = ids[out.request_id]
        assert out.output_token_ids == eng.runner.expected_output(prompt, n)
        assert rows[out.request_id] == n  # no row sampled past the request's length
    dispatching_calls = set(log["dispatched"])
    assert len(log["reads"]) == len(log["dispatched"])
    for k, n, left, call in log["reads"]:
        assert n >= k + 2 or call not in dispatching_calls or not left, (k, n, call)
    assert sum(n >= k + 2 for k, n, _, _ in log["reads"]) > len(log["reads"]) // 2
