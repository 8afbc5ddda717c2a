"""A real-size preset never starts a random init that cannot fit (issue 23 follow-up: an
Engine on ``qwen3_next_80b_a3b`` would otherwise try to allocate ~160 GB of random weights)."""

from __future__ import annotations

import pytest

import mambacache as mc
from mambacache.engine.runners.loading import load_model


def test_real_preset_too_large_is_a_value_error_before_allocation():
    cfg = mc.EngineConfig.load(None, overrides={"model.preset": "qwen3_next_80b_a3b",
                                                "model.dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"qwen3_next_80b_a3b.*real-size preset.*GiB"):
        load_model(cfg)
