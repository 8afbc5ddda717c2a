"""The five scheduler defects of issue 11, each as the example that showed it, on the shadow
runner (every read is checked against the prefix it needs; step invariants run every step)."""

from __future__ import annotations

import numpy as np
import pytest
from shadow_helpers import greedy, shadow_engine

import mambacache as mc


def _expect(engine, prompts, n):
    return [engine.runner.expected_output(p, n) for p in prompts]


@pytest.mark.parametrize("prompt_len", [16, 40])
@pytest.mark.parametrize("together", [True, False])
def test_one_token_last_chunk_never_reads_a_freed_slot(together, prompt_len):
    """Defect 1: page 4, chunk 13, the same 16-token prompt twice: the second request's last
    prefill chunk is one token on a page boundary; it must not go through the decode path, and
    no row may read a slot that the tree rejected and freed."""
    eng = shadow_engine(**{"cache.page_size": 4, "scheduler.chunked_prefill_size": 13})
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 1000, prompt_len).tolist()  # 40 = 3 x 13 + 1: a 1-token chunk
    other = rng.integers(1, 1000, 23).tolist()
    if together:
        outs = eng.generate([prompt, prompt, other], greedy(6))
    else:
        outs = eng.generate([prompt], greedy(6)) + eng.generate([prompt, other], greedy(6))
    assert [o.output_token_ids for o in outs] == _expect(eng, [prompt, prompt, other], 6)
    eng.check_integrity()


def test_two_prefills_do_not_deadlock():
    """Defect 2: 60-token pool, chunk 64; the tree holds X and Y (20 tokens each); D, P1 = X +
    25 tokens and P2 = Y + 24 tokens added together must all finish (before: ``schedule()``
    returned [] forever once D finished)."""
    eng = shadow_engine(**{"cache.num_kv_tokens": 60, "scheduler.chunked_prefill_size": 64})
    rng = np.random.default_rng(2)
    x, y = rng.integers(1, 1000, 20).tolist(), rng.integers(1, 1000, 20).tolist()
    eng.generate([x], greedy(1))
    eng.generate([y], greedy(1))
    d = rng.integers(1, 1000, 16).tolist()
    p1 = x + rng.integers(1, 1000, 25).tolist()
    p2 = y + rng.integers(1, 1000, 24).tolist()
    outs = eng.generate([d, p1, p2], [greedy(3), greedy(1), greedy(1)])
    assert [o.output_token_ids for o in outs] == [eng.runner.expected_output(d, 3),
                                                  eng.runner.expected_output(p1, 1),
                                                  eng.runner.expected_output(p2, 1)]
    eng.check_integrity()


def test_single_state_slot_admits_a_follow_up():
    """Defect 3: with one state slot, a prompt extending a cached one is admitted (the matched
    state is the only slot: the request starts from scratch rather than waiting forever)."""
    eng = shadow_engine(**{"cache.num_mamba_slots": 1})
    rng = np.random.default_rng(3)
    first = rng.integers(1, 1000, 30).tolist()
    out1 = eng.generate([first], greedy(4))[0]
    follow = first + out1.output_token_ids + rng.integers(1, 1000, 7).tolist()
    out2 = eng.generate([follow], greedy(4))[0]
    assert out2.output_token_ids == eng.runner.expected_output(follow, 4)
    eng.check_integrity()


@pytest.mark.parametrize("chunk", [13, 64])
def test_one_token_last_chunk_keeps_planned_snapshots(chunk):
    """Defect 4: page 4, the same 40-token prompt twice: the second caches 36 tokens whatever
    the chunk size (before: 0 with chunk 13, whose last chunk is a single token)."""
    eng = shadow_engine(**{"cache.page_size": 4, "scheduler.chunked_prefill_size": chunk})
    prompt = np.random.default_rng(4).integers(1, 1000, 40).tolist()
    eng.generate([prompt], greedy(2))
    again = eng.generate([prompt], greedy(2))[0]
    assert again.cached_tokens == 36
    assert again.output_token_ids == eng.runner.expected_output(prompt, 2)


@pytest.mark.parametrize("chunk", [16, 64, 7])
def test_requests_arriving_together_compute_a_shared_prefix_once(chunk):
    """Defect 5: four requests sharing a 40-token uncached prefix (12-token tails) compute it
    once: 40 + 4 x 12 = 88 prefill tokens with any chunk size (before: 128 with chunk 64, 168
    with chunk 16)."""
    eng = shadow_engine(**{"scheduler.chunked_prefill_size": chunk})
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 1000, 40).tolist()
    prompts = [shared + rng.integers(1, 1000, 12).tolist() for _ in range(4)]
    outs = eng.generate(prompts, greedy(2))
    assert eng.metrics()["computed_prefill_tokens"] == 88
    assert [o.cached_tokens for o in outs] == [0, 40, 40, 40]
    assert [o.output_token_ids for o in outs] == _expect(eng, prompts, 2)


def test_no_progress_is_an_error_naming_the_stuck_requests():
    eng = shadow_engine()
    eng.scheduler.schedule = lambda: []  # a scheduler that never schedules anything
    with pytest.raises(RuntimeError, match=r"no progress in 2 steps: running \[\]; waiting 1"):
        eng.generate([[1, 2, 3]], greedy(2))


def test_page_boundary_decodes_keep_the_decode_program():
    """With page_size 4, decode steps that end on a page boundary write their state to a fresh
    slot as the row's write slot: >= 90% of pure-decode steps run the decode program."""
    eng = shadow_engine(**{"cache.page_size": 4})
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 1000, n).tolist() for n in (9, 17, 30)]
    outs = eng.generate(prompts, greedy(40))
    m = eng.metrics()
    assert m["pure_decode_steps"] > 30
    assert m["decode_program_share"] >= 0.9, m
    assert [o.output_token_ids for o in outs] == _expect(eng, prompts, 40)
    # and the newest boundary state was kept: the full conversation hits all but <= 4 tokens
    follow = prompts[0] + outs[0].output_token_ids + [5, 6]
    hit = eng.generate([follow], greedy(1))[0]
    assert hit.cached_tokens == (len(follow) - 1) // 4 * 4


def test_metrics_report_decode_share_none_before_decoding():
    eng = shadow_engine()
    assert eng.metrics()["decode_program_share"] is None
    assert isinstance(mc.SamplingParams(), mc.SamplingParams)
