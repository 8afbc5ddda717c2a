"""``scheduler.decode_steps`` (multi-step decode, ``engine/runners/multi_step.py``): K decode
iterations per dispatch give K = 1's tokens and logprobs (greedy and seeded sampling, overlap on and
off), stops inside the K iterations freeze the row on the device (the next turn's cache hit equals
cache off), a short pool runs fewer iterations, warm-up compiles the K-step programs. The
shadow fuzz with K > 1 is in ``test_engine_fuzz.py``."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.shadow.runner import ShadowRunner
from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens
from tests.shadow_helpers import shadow_engine

# small programs, compiled once by the warm-up test (the first here) and shared by the others
MS = {"cache.page_size": 4, "scheduler.max_running_requests": 4,
      "scheduler.chunked_prefill_size": 12, "scheduler.check_integrity_every_step": True}
K = 4


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rand_tokens(rng, 13)
    return [shared + rand_tokens(rng, 6), shared + rand_tokens(rng, 9), rand_tokens(rng, 11)]


def _params(sampled: bool, n: int, stops: tuple[int | None, ...] = (None,) * 3):
    out = []
    for seed, stop in zip((1, 2, 3), stops, strict=True):
        kw = {"stop_token_ids": (stop,)} if stop is not None else {}
        out.append(mc.SamplingParams(max_new_tokens=n, temperature=0.9 if sampled else 0.0,
                                     top_k=50, seed=seed, **kw))
    return out


def _multi_rows(engine) -> list[tuple[int, int]]:
    """Record (steps, max_new_tokens left) of every row the engine runs multi-step."""
    seen: list[tuple[int, int]] = []
    real = engine.runner.run_multi

    def run_multi(scheduled, iterations):
        seen.extend((s.steps, s.req.params.max_new_tokens - s.req.num_outputs)
                    for s in scheduled)
        return real(scheduled, iterations)

    engine.runner.run_multi = run_multi
    return seen


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", 65])
def test_bad_decode_steps_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"scheduler\.decode_steps must be an int in \[1, 64\]"):
        mc.EngineConfig().replace(**{"scheduler.decode_steps": bad})


def test_warmup_compiles_the_multi_step_programs_then_nothing_compiles():
    eng = make_engine(**MS, **{"scheduler.decode_steps": K})
    warm = eng.warmup(max_seq_len=64)
    # decode width {4} x pages {64}, once plain and once K-step; extend tokens {16}
    assert (warm["programs"], warm["decode_programs"]) == (3, 2), warm
    outs = eng.generate(_prompts(0), _params(False, 11))
    m = eng.metrics()
    assert m["programs_compiled"] == 0, m
    assert any(("iterations", K) in key for key in eng.runner.program_keys)
    assert all(len(o.output_token_ids) == 11 for o in outs)


@pytest.mark.parametrize("sampled", [False, True])
def test_k_steps_equal_one_step_with_stops_inside(sampled):
    """Stops (a stop token, max_new_tokens) land inside the K iterations; tokens equal K = 1's
    and logprobs are bit-identical (fp32, CPU), overlap on and off."""
    prompts = _prompts(1)
    free = make_engine(**MS).generate(prompts, _params(sampled, 14))
    # stop tokens at outputs 5 and 2 (the first sampled by a K-step dispatch, at its first
    # iteration: the row's later iterations are frozen); the third runs to its length, 14
    params = _params(sampled, 14, (free[0].output_token_ids[5], free[1].output_token_ids[2],
                                   None))
    ref = make_engine(**MS).generate(prompts, params)
    assert [o.finish_reason for o in ref] == ["stop", "stop", "length"]
    for overlap in (True, False):
        eng = make_engine(**MS, **{"scheduler.decode_steps": K, "scheduler.overlap": overlap})
        rows = _multi_rows(eng)
        outs = eng.generate(prompts, params)
        assert_same_outputs(outs, ref, atol=0.0)
        assert max(s for s, _ in rows) == K, rows  # K-step dispatches ran
        eng.check_integrity()
        assert eng.cache.stats()["slots_held"] == 0


def test_next_turn_after_a_stop_inside_k_hits_the_cache_and_equals_cache_off():
    """The finish inserts the state after the last real token (the row froze on the device):
    a follow-up turn reads it from the tree and gives cache off's outputs."""
    prompts = _prompts(2)
    free = make_engine(**MS).generate(prompts, _params(False, 12))
    params = _params(False, 12, tuple(o.output_token_ids[i] for o, i in
                                      zip(free, (5, 6, 7), strict=True)))
    off = {**MS, "cache.enable": False}
    for overlap in (True, False):
        eng = make_engine(**MS, **{"scheduler.decode_steps": K, "scheduler.overlap": overlap})
        outs = eng.generate(prompts, params)
        rng = np.random.default_rng(3)
        turn2 = [o.prompt_token_ids + o.output_token_ids + rand_tokens(rng, 5) for o in outs]
        again = eng.generate(turn2, _params(False, 6))
        # the end state of a turn is kept when its computed length is page aligned (one of
        # the three here): that turn's next one hits all of it
        hits = [a.cached_tokens - len(o.prompt_token_ids) - len(o.output_token_ids) + 1
                for a, o in zip(again, outs, strict=True)]
        assert 0 in hits, hits
        # (cache off computes the prefix in other chunks: logprobs within 1e-4, as always)
        assert_same_outputs(again, make_engine(**off).generate(turn2, _params(False, 6)))
        eng.check_integrity()


def test_a_short_pool_runs_fewer_iterations_never_fails():
    """Pages for K tokens are not there: the row runs the iterations its pages hold (shadow
    runner, every read checked, integrity after each step)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 1000, 13).tolist() for _ in range(3)]
    cfg = {"cache.page_size": 4, "cache.num_kv_tokens": 72, "cache.enable": False,
           "scheduler.max_running_requests": 3}
    params = mc.SamplingParams(max_new_tokens=10, temperature=0.0)
    eng = shadow_engine(**cfg, **{"scheduler.decode_steps": 8})
    rows = _multi_rows(eng)
    outs = eng.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == [eng.runner.expected_output(p, 10)
                                                  for p in prompts]
    assert any(steps < min(8, left) for steps, left in rows), rows  # fewer: the pool's
    eng.check_integrity()


@pytest.mark.parametrize("page", [1, 4, 16])
def test_shadow_long_outputs_stops_and_turns(page):
    """K = 16 on the oracle: long outputs, stops anywhere, follow-up turns reading what the
    finishes inserted (``check_tree`` after every step), equal to K = 1."""
    rng = np.random.default_rng(page)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(5, 40, 8)]
    stop_at = rng.integers(0, 60, 8).tolist()
    outs = {}
    for k in (1, 16):
        eng = shadow_engine(**{"cache.page_size": page, "scheduler.decode_steps": k,
                               "scheduler.max_running_requests": 4})
        expected = [eng.runner.expected_output(p, 60) for p in prompts]
        params = [mc.SamplingParams(max_new_tokens=60, temperature=0.0,
                                    stop_token_ids=(e[int(i)],))
                  for e, i in zip(expected, stop_at, strict=True)]
        first = eng.generate(prompts, params)
        turn2 = [o.prompt_token_ids + o.output_token_ids + [7, 8] for o in first]
        second = eng.generate(turn2, mc.SamplingParams(max_new_tokens=40, temperature=0.0))
        outs[k] = [o.output_token_ids for o in first + second]
        assert isinstance(eng.runner, ShadowRunner)
        eng.check_integrity()
    assert outs[16] == outs[1]


@pytest.mark.parametrize("kind", ["host_stops", "penalty", "many_stops"])
def test_rows_stopped_on_the_host_run_one_token_per_step(kind):
    """Stop strings at the server (``host_stops``), penalties (counts change per token), more
    stop ids than the device checks: the steps they are in run K = 1, outputs unchanged."""
    special = {"host_stops": {"host_stops": True}, "penalty": {"presence_penalty": 0.5},
               "many_stops": {"stop_token_ids": tuple(range(990, 998))}}[kind]
    eng = shadow_engine(**{"scheduler.decode_steps": 8})
    rows = _multi_rows(eng)
    plain = mc.SamplingParams(max_new_tokens=20, temperature=0.0)
    eng.generate([[5, 6, 7], [8, 9]], [plain, mc.SamplingParams(max_new_tokens=20, **special)])
    assert rows == []
    eng.generate([[5, 6, 7]], plain)  # alone: K-step dispatches
    assert rows and max(s for s, _ in rows) == 8


def test_bad_host_stops_is_a_value_error():
    with pytest.raises(ValueError, match="host_stops must be a bool"):
        mc.SamplingParams(host_stops="yes")
