"""Which state snapshots a request keeps: ONE plan, used by the engine and the simulator alike.

Positions are token counts: position ``p`` is "the state after the first ``p`` tokens". Every
position is rounded DOWN to a page boundary (the tree keeps whole pages only).

* ``plan_snapshots``: during prefill, the positions strictly between ``cached_len`` and
  ``prompt_len``: the branch point (``branch_len``, where the prompt leaves the tree), the state
  after ``prompt_len - 1`` tokens (so an identical prompt later hits all but its last token), and
  every ``checkpoint_interval`` tokens (absolute multiples, so requests agree on positions).
* ``end_snapshot_position``: the end of a finished request, the state after
  ``prompt_len + output_len - 1`` tokens (the last sampled token is never fed to the model).
* ``assign_snapshot_slots``: one slot per planned position; positions that get none are skipped
  and counted (``cache.record_skipped``). The branch point is FIRM: its slot comes from
  ``cache.alloc_slots`` (evicting per the policy). ``prompt_len - 1`` and the checkpoints are
  SPECULATIVE (nothing shows yet that they will be hit; in chat they never are): their slots come
  from ``cache.alloc_speculative_slots``: free slots (and, for ``prompt_len - 1`` only, the slot
  of the least recently used other speculative state), never by evicting a branch point or a
  request end (but with a host tier that has room, ``prompt_len - 1`` may: the state evicted
  is demoted, not lost); the tree keeps them as speculative states, evicted first until a hit or a
  divergence promotes them. ``prompt_len - 1`` is served
  before the checkpoints, which go from the deepest down. A cache built with
  ``speculative_states=False`` plans neither (states only at branch points and request ends).
"""

from __future__ import annotations

from typing import Any


def _floor(pos: int, page_size: int) -> int:
    return pos // page_size * page_size


def plan_snapshots(prompt_len: int, cached_len: int, branch_len: int, page_size: int,
                   checkpoint_interval: int = 0) -> list[int]:
    """Sorted unique snapshot positions ``p``, ``cached_len < p < prompt_len``, page aligned."""
    if page_size < 1 or checkpoint_interval < 0:
        raise ValueError(f"page_size must be >= 1 and checkpoint_interval >= 0, got "
                         f"{page_size} and {checkpoint_interval}")
    if not 0 <= cached_len <= branch_len or cached_len > max(prompt_len - 1, 0):
        raise ValueError(f"need 0 <= cached_len ({cached_len}) <= branch_len ({branch_len}) and "
                         f"cached_len <= prompt_len - 1 ({prompt_len - 1})")
    cands = {branch_len // page_size * page_size, (prompt_len - 1) // page_size * page_size}
    if checkpoint_interval:
        step = checkpoint_interval
        first = (cached_len // step + 1) * step
        if first < prompt_len:  # usually none past a long cached prefix: skip the generator
            cands.update(_floor(p, page_size) for p in range(first, prompt_len, step))
    out = [p for p in cands if cached_len < p < prompt_len]
    out.sort()
    return out


def end_snapshot_position(total_len: int, page_size: int) -> int:
    """Position of the end snapshot of a request of ``total_len = prompt + output`` tokens."""
    if total_len < 1 or page_size < 1:
        raise ValueError(f"need total_len >= 1 and page_size >= 1, got {total_len}, {page_size}")
    return _floor(total_len - 1, page_size)


def end_snapshot_is_running_state(total_len: int, page_size: int) -> bool:
    """True when the running state after ``total_len - 1`` tokens IS the end snapshot (aligned),
    so the engine can hand its running slot to ``insert`` instead of freeing it."""
    return (total_len - 1) % page_size == 0 and total_len > 1


def assign_snapshot_slots(cache: Any, positions: list[int], branch_len: int | None = None,
                          prompt_len: int | None = None, page_size: int = 1) -> dict[int, int]:
    """``{position: slot}`` for the positions that got a slot; the rest are counted as skipped.

    The position equal to ``branch_len`` (rounded down to a page) is firm, every other one
    speculative (see the module docstring).
    """
    if not positions:
        return {}
    branch = branch_len // page_size * page_size if branch_len is not None else None
    last = (prompt_len - 1) // page_size * page_size if prompt_len is not None else None
    firm = [p for p in positions if p == branch]
    spec = [p for p in positions if p != branch] if cache.speculative_states else []
    out: dict[int, int] = {}
    if firm:
        got = cache.alloc_slot()
        if got is None:
            cache.record_skipped(1)
        else:
            out[firm[0]] = got
    if spec:
        if len(spec) > 1:
            spec.sort(key=lambda p: (p != last, -p))
        # only prompt_len - 1 may push out an older speculative state; checkpoints take free
        # slots (under pressure a request would otherwise churn through many evictions)
        got = cache.alloc_speculative_slots(len(spec), evict=int(spec[0] == last))
        if len(got) < len(spec):
            cache.record_skipped(len(spec) - len(got))
        if len(got):
            out.update(zip(spec, got.tolist(), strict=False))  # shallowest go without
    return out
