"""In-batch prefix dedup: requests that arrive together compute a shared uncached prefix once.

Two halves, both host only:
  * ``shared_with_waiting``: when a request is admitted, the positions where waiting requests
    (the first ``DEDUP_WINDOW`` of the queue, compared by
    prompt) share more than its cached prefix with it; the
    scheduler plans snapshots there, and publishes each as soon as the step that wrote it ran.
  * ``inflight_branch``: when a waiting request is examined, whether a running prefill will
    publish the prefix they share; if so it waits (is deferred) and hits that snapshot later.
A deferral ends as soon as the leader has computed the shared prefix (or stopped running), so a
deferred request never waits on something that cannot happen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mambacache.engine.leases.cache_manager import CacheManager
    from mambacache.engine.request import Request

#: waiting requests compared with each admitted one (bounds the host cost per admission)
DEDUP_WINDOW = 16


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _common_with(tokens: np.ndarray, other: Request) -> int:
    """``_common_prefix(tokens, other.token_ids)``, building ``token_ids`` (prompt + outputs)
    only when ``tokens`` matches the whole prompt."""
    prompt = other.prompt
    common = _common_prefix(tokens, prompt)
    if common < len(prompt) or not other.output_ids:
        return common
    return _common_prefix(tokens, other.token_ids)


def _head(req: Request, tokens: np.ndarray, head_len: int) -> bytes:
    """The bytes of ``tokens[:head_len]`` (``tokens`` = ``req.token_ids``), sliced from the
    prompt's bytes when they lie in the prompt."""
    if head_len <= req.prompt_len:
        return req.prompt_bytes[:4 * head_len]
    return tokens[:head_len].tobytes()


def shared_with_waiting(manager: CacheManager, req: Request, waiting: Iterable[Request],
                        cached_len: int) -> set[int]:
    """Page-aligned positions ``p``, ``cached_len < p < len(req.token_ids)``, where a waiting
    request's prompt leaves ``req``'s tokens (each the state that waiting request will want)."""
    tokens = req.token_ids
    out: set[int] = set()
    head_len = cached_len + manager.page_size
    if len(tokens) <= head_len:
        return out
    # cheap filter first (one C-level compare per waiting request): sharing more than
    # cached_len needs the first cached_len + page_size tokens in common
    head = _head(req, tokens, head_len)
    key = req.extra_key
    for other in [o for o in itertools.islice(waiting, DEDUP_WINDOW)
                  if o.prompt_bytes.startswith(head) and o.extra_key == key]:
        theirs = other.prompt
        common = manager.state_floor(min(_common_prefix(tokens, theirs), len(theirs) - 1))
        if cached_len < common < len(tokens):
            out.add(common)
    return out


def inflight_branch(manager: CacheManager, req: Request, running: Sequence[Request],
                    cached_len: int, branch_len: int) -> int | None:
    """``None`` if ``req`` should wait for a running prefill that will publish a longer shared
    prefix; otherwise the branch position to plan for ``req`` (past ``branch_len`` when a
    running request already computed the shared prefix without keeping a state there)."""
    if not manager.enable:
        return branch_len
    tokens = req.token_ids
    # a common prefix past cached_len (page aligned) starts with these head_len tokens: a running
    # request whose prompt does not is skipped with one C-level compare
    head_len = manager.next_page_boundary(cached_len)
    if head_len > len(tokens):  # no page boundary past cached_len below len(tokens): nothing
        return branch_len       # shared can be longer than what it hit
    head = _head(req, tokens, head_len)
    key = req.extra_key
    # a running request sharing less than head_len tokens shares at most cached_len: skipped
    # (in one comprehension: per running request of every admission)
    for other in [o for o in running if o.extra_key == key
                  and (o.prompt_len < head_len or o.prompt_bytes.startswith(head))]:
        common = manager.state_floor(min(_common_with(tokens, other), len(tokens) - 1))
        if common <= cached_len:
            continue
        lease = other.lease
        if common <= lease.num_computed or lease.prefilled or common >= other.num_tokens:
            branch_len = max(branch_len, common)
            continue
        if lease.plans(common) or lease.plan_snapshot(common):
            return None  # it waits for that snapshot
        branch_len = max(branch_len, common)  # no slot for it
    return branch_len
