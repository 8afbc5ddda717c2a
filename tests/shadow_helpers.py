"""Engines on the shadow runner (no model, no device): the data-flow oracle checks every read."""

from __future__ import annotations

from typing import Any

import numpy as np

import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.engine.shadow.runner import ShadowRunner

SHADOW_BASE = {"cache.num_kv_tokens": 4000, "cache.num_mamba_slots": 32,
               "scheduler.max_running_requests": 8, "scheduler.chunked_prefill_size": 64,
               "scheduler.check_integrity_every_step": True}


def shadow_engine(runner_kwargs: dict[str, Any] | None = None, **overrides: Any) -> Engine:
    cfg = mc.EngineConfig().replace(**{**SHADOW_BASE, **overrides})
    return Engine(cfg, runner=ShadowRunner.for_config(cfg, **(runner_kwargs or {})))


def greedy(n: int) -> mc.SamplingParams:
    return mc.SamplingParams(max_new_tokens=n, temperature=0.0)


def random_prompts(vocab: int, n: int, length: int = 30, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` uniform tokens below ``vocab``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def greedy_outputs(eng: Engine, prompts: list[list[int]], n: int) -> list[tuple[list, list]]:
    """(tokens, logprobs) of each prompt, ``n`` greedy tokens."""
    return [(o.output_token_ids, o.output_logprobs) for o in eng.generate(prompts, greedy(n))]
