"""Live parity: fresh random transformers models (new seeds), saved, loaded, compared in fp32.

Runs only where torch and transformers are importable (CI does not install them). Reuses the
fixture generator (``scripts/make_parity_fixtures.py``) and the pool harness of
``test_parity.py``; the configs equal the fixtures', so the jitted steps are shared.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_parity import FP32_TOL, max_err, run_greedy, run_prefill, run_split  # noqa: E402

from models import load_checkpoint  # noqa: E402

SCRIPT = Path(__file__).parents[1] / "scripts" / "make_parity_fixtures.py"


def _generator():
    spec = importlib.util.spec_from_file_location("make_parity_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.live_parity
@pytest.mark.parametrize("name, seed", [("qwen3_next", 1234), ("qwen3_5", 2345),
                                        ("qwen3_5_moe", 3456)])
def test_fresh_random_model_matches_transformers(name, seed, tmp_path):
    gen = _generator()
    model = gen.build_model(name, seed)
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [np.asarray(p, np.int32) for p in gen.prompts(seed, model.config.vocab_size)]
    exp = gen.record(model, [p.tolist() for p in prompts], num_decode=8)
    cfg, params = load_checkpoint(tmp_path, jnp.float32)
    _, logits = run_prefill(params, cfg, prompts, jnp.float32)
    assert max_err(logits, exp["prefill_logits"]) < FP32_TOL
    split = run_split(params, cfg, prompts, exp["split_points"], jnp.float32)
    assert max_err(split, exp["split_logits"]) < FP32_TOL
    tokens, greedy = run_greedy(params, cfg, prompts, 8, jnp.float32)
    np.testing.assert_array_equal(tokens, exp["greedy_tokens"])
    assert max_err(greedy, exp["greedy_logits"]) < FP32_TOL
