"""Request validation (before anything is allocated) and the engine-wide integrity check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mambacache.config import EngineConfig
from mambacache.engine.request import Status
from mambacache.engine.sampling_params import SamplingParams


def validate_request(prompt: Sequence[int] | np.ndarray, params: SamplingParams,
                     extra_key: Any, model_cfg: Any, cfg: EngineConfig) -> np.ndarray:
    """The prompt as ``int32[n]``; a ``ValueError`` naming the value and the limit otherwise."""
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
    page_size = cfg.cache.page_size
    capacity = cfg.cache.num_pages * page_size
    if -(-total // page_size) > cfg.cache.num_pages:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens can never fit the KV pool of "
                         f"{capacity} tokens (cache.num_kv_tokens)")
    return arr.astype(np.int32)


def check_engine_integrity(engine: Any) -> None:
    """The cache's own check, then request ownership: every id the allocators list as held by a
    request is held by exactly one running request, and each running request is consistent;
    with speculative decoding, the scratch lanes; with the shadow runner, the tree's states and
    KV against their tokens."""
    _check_ownership(engine)
    speculative = engine.scheduler.speculative
    if speculative is not None:
        slots = {n.slot for n in _tree_nodes(engine.cache) if n.slot is not None}
        speculative.check_lanes(engine.scheduler.running, slots)
    if hasattr(engine.runner, "check_tree"):  # the data-flow oracle: tree states vs tokens
        engine.runner.check_tree(engine.cache)


def _tree_nodes(cache: Any) -> list[Any]:
    """Every node of every root of ``cache`` (none for the disabled cache)."""
    out, todo = [], list(getattr(cache, "roots", {}).values())
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children.values())
    return out


def _check_ownership(engine: Any) -> None:
    cache = engine.cache
    cache.check_integrity()
    sched = engine.scheduler
    held_slots: list[int] = []
    held_pages: list[int] = []
    page_size = engine.cfg.cache.page_size
    for req in sched.running:
        if req.status is not Status.RUNNING or req.running_slot is None:
            raise AssertionError(f"request {req.request_id} in the running list is {req.status}")
        held_slots.append(req.running_slot)
        held_slots.extend(req.pending_snapshots.values())
        held_pages.extend(req.own_page_ids.tolist())
        if len(req.page_ids) * page_size < req.num_computed:
            raise AssertionError(f"request {req.request_id}: {len(req.page_ids)} pages cannot hold "
                                 f"{req.num_computed} computed tokens")
    for req in sched.waiting:
        holds = req.running_slot is not None or len(req.own_page_ids)
        if req.status is not Status.WAITING or holds:
            raise AssertionError(f"waiting request {req.request_id} holds resources")
    for name, held, alloc in (("slot", held_slots, cache.slots), ("page", held_pages, cache.pages)):
        mine = np.sort(np.asarray(held, np.int64))
        listed = np.sort(np.asarray(alloc.held_ids(), np.int64))
        if mine.size != np.unique(mine).size:
            raise AssertionError(f"a state {name} is held by two requests: {mine.tolist()}")
        if not np.array_equal(mine, listed):
            leaked = np.setdiff1d(listed, mine).tolist()
            missing = np.setdiff1d(mine, listed).tolist()
            raise AssertionError(f"{name}s held per allocator but by no request: {leaked}; "
                                 f"held by requests but not per allocator: {missing}")
