"""Compiles counted from JAX's own events; warm-up compiles the whole program set and leaves the
engine as it was; after it no request within the bounds compiles."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_helpers import assert_same_outputs, make_engine, rand_tokens, tiny_model

import mambacache as mc
from mambacache.engine.runners.compiles import CompileCounter, count_compiles
from mambacache.engine.runners.warmup import engine_buckets
from mambacache.engine.speculative.verify import max_rows
from mambacache.engine.step.buckets import Buckets, StepShape
from mambacache.engine.step.plan import SeqSpec

# pool shapes no other test uses: every program of this engine is compiled here first
UNIQUE = {"cache.page_size": 3, "cache.num_kv_tokens": 3000, "cache.num_mamba_slots": 20,
          "scheduler.max_running_requests": 4, "scheduler.chunked_prefill_size": 16}
GREEDY = mc.SamplingParams(max_new_tokens=5, temperature=0.0)


def test_counter_counts_backend_compiles_per_scope():
    f = jax.jit(lambda x: x * 3 - 1)
    outer = CompileCounter()
    with outer.track(), count_compiles() as inner:
        f(np.ones(3, np.float32))
        f(np.ones(3, np.float32))  # cached: no compile
        f(np.ones(7, np.float32))  # a new shape
    assert inner.compiles == 2 == outer.compiles
    assert inner.by_function == {"jit(<lambda>)": 2}
    assert inner.seconds > 0
    f(np.ones(9, np.float32))  # outside any scope
    assert outer.compiles == 2


def test_program_set_is_finite_and_covers_every_step_shape():
    b = Buckets(page_size=1, max_seqs=16, max_seq_len=440, max_step_tokens=528,
                max_snapshots=34)
    shapes = b.program_set()
    assert b.page_ladder() == [128, 512]
    assert sum(s.decode for s in shapes) == 3 * 2  # widths 4, 8, 16 x pages 128, 512
    extend = sorted({s.num_tokens for s in shapes if not s.decode})
    assert extend == [16, 32, 64, 128, 256, 512, 1024] and len(shapes) == 6 + 7 * 2
    rng = np.random.default_rng(0)
    for _ in range(200):  # random steps within the bounds land in the set
        n = int(rng.integers(1, 17))
        decode = bool(rng.integers(0, 2))
        seqs = []
        for _ in range(n):
            prefix = int(rng.integers(0, 430))
            ext = 1 if decode else int(rng.integers(1, 528 // n + 1))
            ext = min(ext, 440 - prefix)
            snaps = [] if decode else [(ext, 1)]
            seqs.append(SeqSpec(tokens=[0] * ext, prefix_len=prefix,
                                page_ids=list(range(prefix + ext)), read_slot=0,
                                write_slot=0, snapshots=snaps))
        assert b.shape(seqs, decode, n) in shapes
    longer = SeqSpec(tokens=[0], prefix_len=600, page_ids=list(range(601)), read_slot=0,
                     write_slot=0)
    assert b.shape([longer], True, 1) == StepShape(True, 4, 4, 1024, 8, 4)  # outside: bounded
    with pytest.raises(ValueError, match="max_seq_len"):
        Buckets(page_size=1, max_seqs=4, max_seq_len=0, max_step_tokens=8)


def test_warmup_compiles_the_set_then_requests_compile_nothing():
    eng = make_engine(**UNIQUE)
    rng = np.random.default_rng(1)
    warm = eng.warmup(max_seq_len=40)
    # widths {4} x pages {64}, tokens {16, 32} (16 + 4 decode rows): all new pool shapes
    assert (warm["programs"], warm["decode_programs"], warm["extend_programs"]) == (3, 1, 2)
    assert warm["compiles"] == 3 and warm["compile_s"] > 0
    prompts = [rand_tokens(rng, n) for n in (5, 30, 17, 33)]
    first = eng.generate(prompts, GREEDY)
    m = eng.metrics()
    assert m["programs_compiled"] == 0 and m["step_programs"] >= 2, m
    steps = m["num_steps"]
    again = eng.warmup(max_seq_len=40)  # idle with a full cache: already warm, nothing moves
    assert again["compiles"] == 0
    eng.check_integrity()
    assert eng.metrics()["num_steps"] == steps
    second = eng.generate(prompts, GREEDY)  # hits read the cached states the warm-up spared
    assert all(o.cached_tokens >= len(p) - 3 for o, p in zip(second, prompts, strict=True))
    assert_same_outputs(first, second)
    assert eng.metrics()["programs_compiled"] == 0
    eng.generate([rand_tokens(rng, 200)], GREEDY)  # past 64 pages of 3: a new page bucket
    m = eng.metrics()
    assert m["programs_compiled"] >= 1 and m["compile_s"] > 0, m
    eng.check_integrity()


def test_warmup_needs_an_idle_engine():
    eng = make_engine()
    eng.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="idle"):
        eng.warmup()


@pytest.mark.parametrize("method,topk", [("mtp", 1), ("ngram", 1), ("ngram", 4)])
def test_verify_steps_land_in_the_warmed_set(method, topk):
    """A step of verify rows only (every running request drafting k tokens, a target state at
    each draft and a planned snapshot in its window) is one of the warmed shapes: with too few
    snapshot rows in the set, the first such step after warm-up compiled (issue 29)."""
    k, running = 3, 4
    cfg = mc.EngineConfig().replace(**{
        "cache.page_size": 1, "scheduler.max_running_requests": running,
        "scheduler.chunked_prefill_size": 16, "speculative.method": method,
        "speculative.num_draft_tokens": k, "speculative.topk": topk})
    model_cfg = tiny_model()[0]
    b = engine_buckets(cfg, model_cfg, max_rows(cfg), max_seq_len=64)
    shapes = set(b.program_set())
    rows = [SeqSpec(tokens=[0] * (1 + k), prefix_len=40, page_ids=list(range(44)),
                    read_slot=0, write_slot=0,
                    snapshots=[(j, j) for j in range(1, k + 1)] + [(k + 1, 9)])
            for _ in range(running * topk)]
    assert b.shape(rows, False, len(rows) * (1 + k)) in shapes
