"""An insert below a locked node (``TreeInsert.insert(below=)``, what a lease's publish and finish
do) is the insert of the whole sequence from the root: twin caches fed the same requests, one
extending below each request's node and one walking from the root, end in the same tree with the
same results at every step; the engine's finish extends the node its prefill published while a
request that matched that node meanwhile still reads it."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.cache.radix import make_cache
from mambacache.cache.state import dump_tree
from tests.shadow_helpers import greedy, shadow_engine


class _Twin:
    """One request driven on two caches: ``ext`` inserts below its node, ``ref`` from the root."""

    def __init__(self, caches, tokens, ps):
        self.tokens, self.ps = tokens, ps
        ms = [c.match_prefix(tokens) for c in caches]
        _same_match(*ms)
        self.nodes = [m.node for m in ms]
        self.cached = [m.page_ids for m in ms]
        for c, m in zip(caches, ms, strict=True):
            c.lock(m.node)
        n_pages = -(-len(tokens) // ps) - len(ms[0].page_ids)
        own = [c.alloc_pages(n_pages) for c in caches]
        assert (own[0] is None) == (own[1] is None)
        self.own = own if own[0] is not None else None

    def insert(self, caches, n, slot_pos, *, last):
        """Insert ``tokens[:n]`` (a snapshot at ``slot_pos`` if any) on both; compare."""
        ps, base = self.ps, self.nodes[0].depth
        snaps = []
        for c in caches:
            got = c.alloc_slots(1) if slot_pos else None
            snaps.append({slot_pos: int(got[0])} if got is not None else {})
        assert snaps[0] == snaps[1]
        if not last and not snaps[0]:
            return  # a lease publishes written snapshots only
        pages = [np.concatenate([cached, own]) for cached, own in
                 zip(self.cached, self.own, strict=True)]
        used = -(-n // ps)
        if not last:  # a publish keeps the rest of the pages for the request
            used = n // ps
        use_below = self.nodes[0].parent is not None and (not snaps[0] or slot_pos > base)
        if use_below:
            ext = caches[0].insert(self.tokens[base:n], pages[0][base // ps:used], snaps[0],
                                   below=self.nodes[0])
        else:
            ext = caches[0].insert(self.tokens[:n], pages[0][:used], snaps[0])
        ref = caches[1].insert(self.tokens[:n], pages[1][:used], snaps[1])
        assert (ext.kept_len, ext.accepted, ext.rejected, ext.new_pages, ext.freed_pages) == \
            (ref.kept_len, ref.accepted, ref.rejected, ref.new_pages, ref.freed_pages)
        np.testing.assert_array_equal(ext.page_ids, ref.page_ids)
        rest = [p[used:] for p in pages]
        if last:
            for c, r in zip(caches, rest, strict=True):
                if len(r):
                    c.free_pages(r)
            for c, node in zip(caches, self.nodes, strict=True):
                c.unlock(node)
            return
        assert ext.kept_len // ps == used  # a publish keeps its whole prefix
        for c, res, node in zip(caches, (ext, ref), self.nodes, strict=True):
            c.lock(res.node)
            c.unlock(node)
        self.nodes = [ext.node, ref.node]
        self.cached = [ext.page_ids, ref.page_ids]
        self.own = rest


def _same_match(a, b):
    assert (a.cached_len, a.read_slot, a.branch_len) == (b.cached_len, b.read_slot, b.branch_len)
    np.testing.assert_array_equal(a.page_ids, b.page_ids)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extension_equals_insert_from_the_root(page_size):
    """Requests sharing prefixes, several in flight at once (a publish of one between the match
    and the finish of another), some prompts identical (duplicate pages freed by the
    extension): after every insert both trees are the same and intact."""
    rng = np.random.default_rng(page_size)
    ps = page_size
    caches = [make_cache(True, num_pages=900, num_slots=24, page_size=ps) for _ in range(2)]
    prefixes = [rng.integers(0, 50, 8 * ps * k).astype(np.int32) for k in (1, 2, 3)]
    prompts: list[np.ndarray] = []
    live: list[tuple[_Twin, int]] = []  # (request, phase: 0 started, 1 published)
    for _ in range(160):
        if len(live) < 4 and rng.random() < 0.5:
            if prompts and rng.random() < 0.25:
                tokens = prompts[rng.integers(len(prompts))].copy()  # identical prompt again
            else:
                tail = rng.integers(0, 50, int(rng.integers(2, 8 * ps))).astype(np.int32)
                tokens = np.concatenate([prefixes[rng.integers(3)], tail])
            prompts.append(tokens)
            req = _Twin(caches, tokens, ps)
            if req.own is None:  # pools short: give the lock back
                for c, node in zip(caches, req.nodes, strict=True):
                    c.unlock(node)
            else:
                live.append((req, 0))
        elif live:
            i = int(rng.integers(len(live)))
            req, phase = live[i]
            depth, n = req.nodes[0].depth, len(req.tokens)
            mid = (depth // ps + 1 + int(rng.integers(max(1, (n - 1) // ps - depth // ps)))) * ps
            if phase == 0 and mid < n:
                req.insert(caches, mid, mid, last=False)
                live[i] = (req, 1)
            else:
                end = n // ps * ps
                req.insert(caches, n, end if end > 0 else 0, last=True)
                live.pop(i)
        for c in caches:
            c.check_integrity()
        assert dump_tree(caches[0]) == dump_tree(caches[1])
    assert caches[0].stats()["tree_nodes"] > 10  # the trees grew (the check compared something)


def test_extension_refuses_a_snapshot_above_its_node_and_an_evicted_node():
    cache = make_cache(True, num_pages=64, num_slots=8, page_size=1)
    tokens = np.arange(10, dtype=np.int32)
    res = cache.insert(tokens[:4], cache.alloc_pages(4), {4: int(cache.alloc_slots(1)[0])})
    slot = int(cache.alloc_slots(1)[0])
    with pytest.raises(ValueError, match="not past its depth"):
        cache.insert(tokens[4:8], cache.alloc_pages(4), {4: slot}, below=res.node)
    cache.evict_slots(8)  # the unlocked leaf goes whole
    assert not res.node.alive
    with pytest.raises(ValueError, match="evicted"):
        cache.insert(tokens[4:8], cache.alloc_pages(4), {8: slot}, below=res.node)


def test_finish_extends_the_node_its_prefill_published():
    """Request A's prefill publishes its ``prompt_len - 1`` state; B (the same prompt) matches
    that node while A decodes; A's finish inserts below that very node (no walk from the
    root) and B, still running on it, reads the right state (the shadow runner checks every
    read against its prefix)."""
    eng = shadow_engine()
    cache = eng.manager.cache
    seen = []
    insert = cache.insert

    def recording(*args, **kwargs):
        res = insert(*args, **kwargs)
        seen.append((kwargs.get("below"), res.node, res.kept_len))
        return res

    cache.insert = recording
    prompt = list(range(1, 41))
    a = eng.add_request(prompt, greedy(12))
    for _ in range(3):  # A's prefill (one chunk) and a decode step: its prefix published
        eng.step()
    published = seen[-1][1]
    assert published.depth == len(prompt) - 1 and published.alive
    b = eng.add_request(prompt, greedy(20))
    while a in eng.requests:
        eng.step()
    finish = [s for s in seen if s[0] is published]
    assert finish and finish[-1][2] > published.depth  # A's end state hangs below it
    assert eng.requests[b].lease.node is published and published.alive  # B hit it
    assert eng.requests[b].cached_tokens == len(prompt) - 1
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()
