"""Speculative decoding bookkeeping on the shadow runner (no model): every read of a verify step
checked by the data-flow oracle, the tree checked against its token paths after every step,
outputs identical to ``method = "none"``; rollback, preemption, aborts, failing steps, cache
on and off, pages 1 and 4. Planted rollback bugs must be found."""

from __future__ import annotations

import numpy as np
import pytest
from shadow_helpers import greedy, greedy_outputs, random_prompts, shadow_engine

import mambacache as mc
from mambacache.config import SpeculativeConfig
from mambacache.engine.leases.lease import Lease
from mambacache.engine.shadow.runner import DataflowError
from mambacache.engine.speculative.drafters import MtpDrafter, NgramDrafter, make_drafter
from mambacache.engine.speculative.verify import SpecDecoder

VOCAB = 12
ORACLE = {"markov": 1, "vocab_size": VOCAB}  # outputs cycle: prompt lookup hits


def _engine(method: str = "ngram", runner: dict | None = None, **overrides):
    return shadow_engine({**ORACLE, **(runner or {})},
                         **{"speculative.method": method, **overrides})


def test_ngram_drafter():
    d = NgramDrafter(SpeculativeConfig(method="ngram", ngram_min=1, ngram_max=3))
    assert d.propose(np.array([7, 1, 2, 9, 4, 1, 2]), 3) == [9, 4, 1]  # suffix [1, 2]
    assert d.propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 5) == [3, 1, 2, 3, 1]  # periodic
    assert d.propose(np.array([5, 5, 5]), 4) == [5, 5, 5, 5]
    assert d.propose(np.array([1, 2, 3]), 4) == []
    # the longest suffix wins over a later shorter match
    assert d.propose(np.array([1, 2, 8, 5, 2, 6, 1, 2]), 1) == [8]
    only3 = NgramDrafter(SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=3))
    assert only3.propose(np.array([7, 1, 2, 9, 4, 1, 2]), 3) == []
    assert isinstance(make_drafter(SpeculativeConfig(method="mtp")), MtpDrafter)


def test_config_validation():
    cfg = mc.EngineConfig()
    assert cfg.speculative.method == "none" and not cfg.speculative.enabled
    for key, value, msg in (("method", "eagle", "speculative.method"),
                            ("num_draft_tokens", 0, "num_draft_tokens"),
                            ("num_draft_tokens", 17, "exceeds 16"),
                            ("ngram_min", 4, "ngram_min \\(4\\) exceeds")):
        with pytest.raises(ValueError, match=msg):
            cfg.replace(**{f"speculative.{key}": value})
    with pytest.raises(ValueError, match="init_branch_scale"):
        cfg.replace(**{"model.init_branch_scale": 0.0})
    with pytest.raises(ValueError, match="random init only"):
        cfg.replace(**{"model.init_branch_scale": 0.5, "model.path": "/some/dir"})


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("cache", [True, False])
def test_same_outputs_as_none(page, cache):
    prompts = random_prompts(VOCAB, 6)
    kw = {"cache.page_size": page, "cache.enable": cache}
    ref = greedy_outputs(_engine("none", **kw), prompts, 40)
    eng = _engine(**kw)
    assert greedy_outputs(eng, prompts, 40) == ref
    assert [o for o, _ in ref] == [eng.runner.expected_output(p, 40) for p in prompts]
    m = eng.metrics()
    assert m["spec_tokens_per_verify"] > 1.5 and m["spec_accepted_tokens"] > 0
    assert 0 < m["spec_accept_rate"] <= 1
    eng.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
def test_followup_hits_verified_prefix(page):
    eng = _engine(**{"cache.page_size": page})
    prompt = random_prompts(VOCAB, 1)[0]
    first = eng.generate([prompt], greedy(21))[0]
    assert eng.metrics()["spec_verify_steps"] > 0
    computed = len(prompt) + 21 - 1  # the last sampled token is never fed
    follow = prompt + first.output_token_ids + [3, 4]
    second = eng.generate([follow], greedy(4))[0]
    assert second.cached_tokens == computed // page * page
    eng.check_integrity()  # check_tree: every state and KV of the tree is of its own path


def test_adaptive_drafts_cut_the_waste_of_misses():
    """Outputs that never repeat (the default oracle): drafts keep missing. Adaptive drafting
    proposes one after a miss instead of k; outputs are the same either way."""
    prompts = random_prompts(VOCAB, 4)
    outs, drafted = [], []
    for adaptive in (False, True):
        eng = shadow_engine({"vocab_size": VOCAB}, **{"speculative.method": "ngram",
                                                      "speculative.adaptive": adaptive})
        outs.append(greedy_outputs(eng, prompts, 30))
        m = eng.metrics()
        assert m["spec_verify_steps"] > 0 and m["spec_accept_rate"] < 0.5, m
        drafted.append(m["spec_draft_tokens"] / m["spec_verify_steps"])
    assert outs[0] == outs[1]
    assert drafted[1] < 0.6 * drafted[0], drafted


def test_chunk_cuts_and_preemption():
    prompts = random_prompts(VOCAB, 8, length=37, seed=1)
    kw = {"cache.page_size": 4, "cache.num_kv_tokens": 100, "cache.num_mamba_slots": 5,
          "scheduler.chunked_prefill_size": 7, "scheduler.max_running_requests": 6}
    ref = greedy_outputs(_engine("none", **kw), prompts, 30)
    eng = _engine(**kw)
    assert greedy_outputs(eng, prompts, 30) == ref
    assert eng.metrics()["preemptions"] > 0 and eng.metrics()["spec_verify_steps"] > 0
    eng.check_integrity()


def test_abort_mid_verify_frees_everything():
    eng = _engine(**{"cache.page_size": 4})
    rids = [eng.add_request(p, greedy(60)) for p in random_prompts(VOCAB, 4)]
    while eng.metrics()["spec_verify_steps"] < 6:
        eng.step()
    for rid in rids[:2]:
        assert eng.abort(rid).finish_reason == "abort"
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    eng.check_integrity()  # idle: no leaked page, slot or lane
    assert eng.scheduler.speculative.free_lanes() == list(range(8))
    for out in outs:
        assert out.output_token_ids == eng.runner.expected_output(out.prompt_token_ids, 60)


@pytest.mark.parametrize("lose", [False, True])
def test_failing_verify_step(lose):
    eng = _engine(runner={"fail_step": lambda step: step == 12, "lose_pools_on_failure": lose},
                  **{"cache.page_size": 4})
    outs = eng.generate(random_prompts(VOCAB, 5), greedy(40))
    assert any(o.finish_reason == "error" for o in outs)
    for out in outs:
        if out.finish_reason == "length":
            assert out.output_token_ids == eng.runner.expected_output(out.prompt_token_ids, 40)
    eng.check_integrity()
    assert eng.scheduler.speculative.free_lanes() == list(range(8))
    assert eng.metrics()["failed_steps"] == 1


def test_stop_token_inside_accepted_drafts():
    prompt = random_prompts(VOCAB, 1)[0]
    probe = _engine("none")
    expected = probe.runner.expected_output(prompt, 40)
    stop = expected[17]
    cut = expected[:expected.index(stop) + 1]
    eng = _engine()
    out = eng.generate([prompt], mc.SamplingParams(max_new_tokens=40, temperature=0.0,
                                                   stop_token_ids=[stop]))[0]
    assert out.output_token_ids == cut and out.finish_reason == "stop"
    eng.check_integrity()


def _fuzz(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 2, 4]))
    prompts = random_prompts(VOCAB, int(rng.integers(3, 9)), int(rng.integers(5, 30)), seed)
    n = int(rng.integers(5, 40))
    kv = (max(map(len, prompts)) + n + 16 + int(rng.integers(0, 80))) // page * page
    lose, fail_at = bool(rng.random() < 0.5), int(rng.integers(5, 60))
    eng = _engine(runner={"fail_step": lambda step: step == fail_at,
                          "lose_pools_on_failure": lose},
                  **{"cache.page_size": page, "cache.num_kv_tokens": kv,
                     "cache.num_mamba_slots": int(rng.integers(1, 12)),
                     "cache.enable": bool(rng.random() < 0.8),
                     "scheduler.chunked_prefill_size": int(rng.integers(1, 20)),
                     "scheduler.max_running_requests": int(rng.integers(1, 6)),
                     "speculative.num_draft_tokens": int(rng.integers(1, 7)),
                     "speculative.topk": int(rng.choice([1, 1, 2, 4]))})  # trees, any page
    outs = eng.generate(prompts, greedy(n))
    for out in outs:
        if out.finish_reason == "length":
            assert out.output_token_ids == eng.runner.expected_output(out.prompt_token_ids, n)
    eng.check_integrity()


def test_fuzz_speculative():
    for seed in range(24):
        _fuzz(seed)


def _state_one_late(orig):
    def accept(self, s, tokens, stops):
        emitted = orig(self, s, tokens, stops)
        if emitted < len(s.targets):  # the rollback picks the state one offset too late
            s.req.lease.state_slot = s.targets[emitted]
        return emitted
    return accept


def _emit_one_more(orig):
    def accept(self, s, tokens, stops):
        emitted = orig(self, s, tokens, stops)
        if emitted <= len(s.drafts):  # a rejected draft slips through as verified
            s.req.output_ids.append(int(s.drafts[emitted - 1]))
        return emitted
    return accept


def _no_end_copy(orig):
    def release(self, req, *, end_snapshot):
        orig(self, req, end_snapshot=end_snapshot)
        self.slot_copies.clear()  # the tree adopts a running slot without the final state
    return release


def _keep_rejected_boundaries(orig):
    def settle(self, start, end, n):
        return orig(self, start, end, end)  # as if every draft was accepted
    return settle


@pytest.mark.parametrize("plant", [("accept", _state_one_late), ("accept", _emit_one_more),
                                   ("release", _no_end_copy),
                                   ("settle_window", _keep_rejected_boundaries)])
def test_planted_rollback_bugs_are_found(monkeypatch, plant):
    name, bug = plant
    owner = Lease if name == "settle_window" else SpecDecoder
    monkeypatch.setattr(owner, name, bug(getattr(owner, name)))
    with pytest.raises((DataflowError, AssertionError)):
        for seed in range(24):
            _fuzz(seed)


def test_bench_compares_speculative_on_off():
    from mambacache.bench.cli import load_setup, mode_configs
    from mambacache.bench.report import format_table, markdown_rows

    setup = load_setup("configs/bench/spec_ngram.toml")
    cfgs = mode_configs(setup.engine)
    assert list(cfgs) == ["spec_on", "spec_off"]
    assert cfgs["spec_on"].speculative.method == "ngram" and cfgs["spec_on"].cache.enable
    assert cfgs["spec_off"].speculative.method == "none" and cfgs["spec_off"].cache.enable
    assert list(mode_configs(mc.EngineConfig())) == ["cache_on", "cache_off"]
    stats = {"request_throughput": 2.0, "input_throughput": 1.0, "output_throughput": 3.0,
             "ttft_mean": 0.1, "ttft_p99": 0.2, "tpot_mean": 0.01, "hit_rate": 0.0,
             "ideal_hit_rate": 0.0, "computed_prefill_tokens": 10, "spec_tokens_per_verify": 3.5}
    result = {"modes": ["spec_on", "spec_off"], "spec_on": stats,
              "spec_off": {**stats, "output_throughput": 1.5, "spec_tokens_per_verify": 0.0},
              "ratios": {"output_throughput": 2.0, "request_throughput": 1.0}, "warmup_s": 1.0,
              "warmup_programs_compiled": 3, "runs": {"spec_on": [{}], "spec_off": [{}]},
              "config": "configs/bench/spec_ngram.toml"}
    table = format_table(result)
    assert "spec on" in table and "tokens per verify row" in table and "2.000x" in table
    assert [r.split(" | ")[1] for r in markdown_rows(result)] == ["spec on", "spec off"]
