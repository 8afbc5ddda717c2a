"""Request validation (before anything is allocated) and the engine-wide integrity check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mambacache.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine
    from models.config import ModelConfig


def validate_request(prompt: Sequence[int] | np.ndarray, params: SamplingParams,
                     extra_key: object, model_cfg: ModelConfig,
                     kv_capacity_tokens: int) -> np.ndarray:
    """The prompt as ``int32[n]``; a ``ValueError`` naming the value and the limit otherwise.
    ``model_cfg``: any model config with ``vocab_size`` and ``max_position_embeddings``;
    ``kv_capacity_tokens``: what the whole KV pool holds (``CacheManager.kv_capacity_tokens``)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if extra_key is not None and not isinstance(extra_key, str):
        raise ValueError(f"extra_key must be a str or None, got {extra_key!r}")
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D list of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    vocab = model_cfg.vocab_size
    for name, ids in (("prompt token id", arr), ("stop token id", params.stop_token_ids)):
        ids = np.asarray(ids, np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ValueError(f"{name} {int(bad[0])} outside the vocabulary [0, {vocab})")
    total = arr.size + params.max_new_tokens
    max_pos = model_cfg.max_position_embeddings
    if total > max_pos:
        raise ValueError(f"prompt ({arr.size}) + max_new_tokens ({params.max_new_tokens}) = "
                         f"{total} exceeds the context length {max_pos}")
    if total > kv_capacity_tokens:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens can never fit the KV pool of "
                         f"{kv_capacity_tokens} tokens (cache.num_kv_tokens)")
    return arr.astype(np.int32)


def check_engine_integrity(engine: Engine) -> None:
    """The cache manager's check (the cache's own, then request ownership: every id the
    allocators list as held by a request is held by exactly one running request's lease); with
    speculative decoding, the scratch lanes; with the shadow runner, the tree's states and KV
    against their tokens."""
    engine.scheduler.check()
    check_tree = getattr(engine.runner, "check_tree", None)  # only the data-flow oracle has it
    if check_tree is not None:
        check_tree(engine.cache)
