"""[speculative, ``topk`` > 1] Draft trees: one verify row per branch, the winner by slot choice.

A tree is a list of up to ``topk`` branches, each a draft chain of at most ``k`` tokens, all
distinct paths from the root (the request's last token): ngram branches are the continuations
of different earlier occurrences of the suffix (they may share a prefix and part later), the
MTP head's are its greedy chain plus its next most likely first tokens. Every branch is
verified as a row of its own, ``[last token, its drafts]``, the plain verify row of
``engine/speculative/verify.py``:
  * all rows read the request's state slot (nobody writes it this step); each writes the state
    after each of its offsets to its own targets, consecutive runs of the lane's pool (running
    slot + scratch lane minus the slot read), so no slot is written twice;
  * branch 0 writes its KV into the request's own pages, branch ``b`` >= 1 into pages of its
    own (``Lease.take_branch_pages``): those of positions ``start..start + m_b``, from the page
    of ``start`` on (``row_pages``). A row reads the request's pages below that page only; the
    tokens of that page before ``start`` (page size > 1) are copied into the branch's first
    page before the step (``page_copies``, ``Runner.copy_pages``: one page per branch, only
    when ``start`` is inside a page). The accepted branch's pages take the place of the
    request's own from that page on (``Lease.settle_branches``): no copy after the read;
  * page size > 1: page-boundary snapshots inside the window are branch 0's (planned like a
    chain's, written by its row only), kept if it wins (``SpecDecoder.choose_branch``);
  * the cost: the root token and any prefix branches share are computed once per branch (a
    tree verifies ``sum(m_b + 1)`` tokens per request: ``spec_verify_width``).

Acceptance (``pick_branch``): each row samples its positions with the request's own key per
output index, so along any path every row draws the target's token at that position: the
branch whose drafts its row accepts furthest is the path the target took (branches that tie
share that path up to their first rejection, the same tokens), and it is followed exactly as a
chain is; the other rows' tokens are dropped. Greedy outputs and seeded samples are those
without speculation. The winner's state slot becomes the running state, as for a chain; only
verified tokens reach the tree (the request's ``token_ids`` grow by them alone).

Host only (numpy). The step loop runs trees synchronously (``Engine``: no overlap with
``topk`` > 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from mambacache.engine.step.plan import ScheduledSeq

if TYPE_CHECKING:
    from mambacache.engine.request import Request


def plan_tree(req: Request, tree: list[list[int]], mtp_room: int, page_size: int,
              take_lane: Callable[[], None]) -> ScheduledSeq | None:
    """The rows of ``tree`` from ``req``'s next position: its pages grown to the deepest branch
    (+ ``mtp_room`` for the MTP head's chained K/V, if free), a lane taken (``take_lane``) and
    pages for as many branches past the first as the pool has free. None (nothing taken but
    pages the request keeps) if no second branch gets pages, or a snapshot is planned in the
    window (a path would write it, whichever the target takes)."""
    start, lease = req.num_computed, req.lease
    depth = max(len(d) for d in tree)
    if any(start < pos <= start + depth + 1 for pos in lease.pending_snapshots):
        return None
    if mtp_room:
        lease.grow(start + 1 + depth + mtp_room)
    if not lease.grow(start + 1 + depth):
        return None
    ps = page_size
    pages = []
    for drafts in tree[1:]:  # the pages of positions start..start + m_b
        got = lease.take_branch_pages(-(-(start + len(drafts) + 1) // ps) - start // ps)
        if got is None:
            break
        pages.append(got)
    if not pages:
        return None
    lease.plan_window_snapshots(start + 1, start + len(tree[0]) + 2)  # [page > 1] branch 0's
    take_lane()
    pool = [s for s in (lease.running_slot, *lease.scratch_slots) if s != lease.state_slot]
    return tree_rows(req, start, tree, pool, pages)


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


def row_pages(s: ScheduledSeq, page_size: int) -> np.ndarray:
    """The page ids a tree row runs on: the request's below the page of ``start``, then its
    branch's."""
    if s.branch_pages is None:
        return s.req.lease.page_ids
    return np.concatenate([s.req.lease.page_ids[:s.start // page_size], s.branch_pages])


def page_copies(rows: Sequence[ScheduledSeq], page_size: int) -> list[tuple[int, int]]:
    """(src, dst) KV pages to copy before a step with these rows runs: for each branch row
    whose ``start`` is inside a page, the request's page of ``start`` (its tokens before
    ``start``) into the branch's first page."""
    out = []
    for s in rows:
        if s.branch_pages is not None:
            page, offset = divmod(s.start, page_size)
            if offset:
                out.append((int(s.req.lease.page_ids[page]), int(s.branch_pages[0])))
    return out


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
