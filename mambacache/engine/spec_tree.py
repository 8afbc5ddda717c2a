"""[speculative, ``topk`` > 1] Draft trees: one verify row per branch, the winner by slot choice.

A tree is a list of branches, each a draft chain; branches differ in their first draft (the
drafters propose distinct first tokens), so the tree is a root (the request's last token) with
up to ``topk`` children, each the head of its own chain. Every branch is verified as a row of
its own, ``[last token, its drafts]``, the plain verify row of ``engine/speculative.py``:
  * all rows read the request's state slot (nobody writes it this step); each writes the state
    after each of its offsets to its own targets, consecutive runs of the lane's pool (running
    slot + scratch lane minus the slot read), so no slot is written twice;
  * branch 0 writes its KV into the request's own pages, branch ``b`` >= 1 into pages of its
    own (``Lease.take_branch_pages``) for positions ``start..start + m_b``; they read the
    request's pages below ``start`` only. Page size 1 (``EngineConfig`` checks), so the
    accepted branch's pages take the place of the request's own position by position
    (``Lease.settle_branches``): no KV copy;
  * the root token is computed once per branch (``topk - 1`` redundant tokens per tree).

Acceptance (``pick_branch``): each row samples its positions with the request's own key per
output index, so every row's ``t_0`` is the target's next token; the branch whose first draft
equals it (at most one: first drafts are distinct) is followed as a chain, the others'
tokens are dropped. That is the chain's exact rule applied to the path the target takes:
greedy outputs and seeded samples are those without speculation. No branch matches: branch 0
emits ``t_0``. The winner's state slot becomes the running state, as for a chain; only
verified tokens reach the tree (the request's ``token_ids`` grow by them alone).

Host only (numpy). The step loop runs trees synchronously (``Engine``: no overlap with
``topk`` > 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mambacache.engine.step_plan import ScheduledSeq

if TYPE_CHECKING:
    from mambacache.engine.request import Request


def tree_rows(req: Request, start: int, tree: Sequence[Sequence[int]],
              pool: Sequence[int], pages: Sequence[np.ndarray]) -> ScheduledSeq:
    """The rows of ``tree`` (``len(pages) + 1`` branches used) from position ``start``: the first
    row, with the others in its ``branches``. ``pool``: the slots the rows may write, the
    request's state slot excluded, at least ``sum(len(branch) + 1)`` of them."""
    rows: list[ScheduledSeq] = []
    at = 0
    for b, drafts in enumerate(tree[:len(pages) + 1]):
        m = len(drafts)
        targets = tuple(pool[at:at + m + 1])
        if len(targets) != m + 1:
            raise AssertionError(f"tree of {[len(d) for d in tree]} drafts: {len(pool)} slots")
        at += m + 1
        s = ScheduledSeq(req, start, start + 1, write_slot=targets[m])
        s.drafts, s.targets, s.branch = tuple(int(d) for d in drafts), targets, b
        if b:
            s.branch_pages = pages[b - 1]
        rows.append(s)
    rows[0].branches = tuple(rows[1:])
    return rows[0]


def row_pages(s: ScheduledSeq) -> np.ndarray:
    """The page ids a tree row runs on: the request's below ``start``, then its branch's."""
    if s.branch_pages is None:
        return s.req.lease.page_ids
    return np.concatenate([s.req.lease.page_ids[:s.start], s.branch_pages])


def pick_branch(drafts: Sequence[tuple[int, ...]], tokens: Sequence[np.ndarray]) -> int:
    """The branch the target follows: the one whose drafts its own row's tokens accept
    furthest (ties and no match: the lowest index). ``tokens[b][j]``: row ``b``'s token after
    its position ``j``."""
    best, best_a = 0, 0
    for b, (d, t) in enumerate(zip(drafts, tokens, strict=True)):
        a = 0
        while a < len(d) and int(t[a]) == d[a]:
            a += 1
        if a > best_a:
            best, best_a = b, a
    return best


def first_distinct(candidates: Sequence[Sequence[int]], topk: int) -> list[list[int]]:
    """Up to ``topk`` of ``candidates`` (non-empty draft chains, best first) with distinct
    first tokens, in order."""
    out: list[list[int]] = []
    seen: set[int] = set()
    for c in candidates:
        if c and c[0] not in seen:
            seen.add(c[0])
            out.append(list(c))
            if len(out) == topk:
                break
    return out
