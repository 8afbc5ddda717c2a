"""The hand-driven loop of examples/manual_loop.py agrees with the Engine (cache off)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

import mambacache as mc
from tests.engine_helpers import make_engine


def load_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "manual_loop.py"
    spec = importlib.util.spec_from_file_location("manual_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_manual_loop_matches_engine():
    server = load_example().ManualServer()
    rng = np.random.default_rng(5)
    system = rng.integers(0, server.cfg.vocab_size, 30).tolist()
    prompts = [system + rng.integers(0, server.cfg.vocab_size, 4).tolist() for _ in range(3)]
    results = [server.generate(p, max_new_tokens=3) for p in prompts]
    assert [cached for _, cached in results] == [0, 0, 30]
    server.cache.check_integrity()
    expected = make_engine(**{"cache.enable": False}).generate(
        prompts, mc.SamplingParams(max_new_tokens=3))
    assert [out for out, _ in results] == [o.output_token_ids for o in expected]
