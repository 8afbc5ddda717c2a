"""Decode widths follow the running batch on a ladder of powers of two; extend steps run at the
widest (bounded programs: ``engine/step/buckets.py``)."""

from __future__ import annotations

import numpy as np
from engine_helpers import make_engine, rand_tokens

import mambacache as mc
from mambacache.engine.runners.model_runner import ModelRunner
from mambacache.engine.step.plan import SeqSpec


def _decode_rows(n: int) -> list[SeqSpec]:
    return [SeqSpec(tokens=[1], prefix_len=5, page_ids=[i + 1], read_slot=i + 1,
                    write_slot=i + 1) for i in range(n)]


def test_width_ladder_up_to_max_running():
    runner = ModelRunner(None, None, None, kernels="reference", page_size=16, max_seqs=64)
    widths = {n: runner.shapes_for(_decode_rows(n))["num_seqs"] for n in (1, 3, 4, 5, 17, 64)}
    assert widths == {1: 4, 3: 4, 4: 4, 5: 8, 17: 32, 64: 64}
    small = ModelRunner(None, None, None, kernels="reference", page_size=16, max_seqs=2)
    assert small.shapes_for(_decode_rows(2))["num_seqs"] == 2


def test_three_requests_decode_in_four_rows_with_64_allowed():
    eng = make_engine(**{"scheduler.max_running_requests": 64})
    rng = np.random.default_rng(0)
    outs = eng.generate([rand_tokens(rng, 9) for _ in range(3)],
                        mc.SamplingParams(max_new_tokens=4, temperature=0.0))
    assert all(len(o.output_token_ids) == 4 for o in outs)
    m = eng.metrics()
    # decode programs at width 4, the prefill (extend) at the one extend width, 64
    assert set(m["programs_per_width"]) == {4, 64}, m["programs_per_width"]
    decode = [k for k in eng.runner.program_keys if k[0]]
    assert decode and all(dict(k[1:])["num_seqs"] == 4 for k in decode)
    assert 0.0 <= m["device_idle_share"] < 1.0
