"""Hypothesis stateful test: random match / insert / lock / unlock / evict against a brute-force
model (the sets of cached KV prefixes and state prefixes), ``check_integrity()`` after every step.

Match and insert results are predicted exactly from the model. Evictions (explicit, or inside
``alloc_*`` under pressure) are checked for safety instead: nothing appears from nowhere, locked
prefixes and their states survive, the amount asked for is freed when it was evictable; then the
model is synced to the tree.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mambacache.cache.radix import make_cache

# sequences share prefixes often: a prefix of one of a few bases, then a short random tail
BASES = [(0, 1, 2, 0, 1, 2, 0, 1, 2, 0), (0, 1, 2, 2, 1, 0, 0, 0, 1, 1), (1, 1, 1, 1, 2, 2, 2, 2)]
TOKENS = st.builds(
    lambda base, n, tail: list(base[:n]) + tail,
    st.sampled_from(BASES), st.integers(0, 10), st.lists(st.integers(0, 2), max_size=3),
).filter(bool)
EXTRA = st.sampled_from([None, "b"])


def tree_contents(cache):
    """(kv, states): sets of (extra_key, prefix tuple) present in the tree."""
    ps = cache.page_size
    kv, states = set(), set()
    for ek, root in cache.roots.items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                full = prefix + tuple(child.key.tolist())
                for end in range(len(prefix) + ps, len(full) + 1, ps):
                    kv.add((ek, full[:end]))
                if child.slot is not None:
                    states.add((ek, full))
                stack.append((child, full))
    return kv, states


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2]), num_pages=st.integers(6, 64),
                num_slots=st.integers(2, 10), eviction=st.sampled_from(["lru", "flop_aware"]))
    def setup(self, page_size, num_pages, num_slots, eviction):
        self.ps = page_size
        self.cache = make_cache(True, num_pages=num_pages, num_slots=num_slots,
                                page_size=page_size, eviction=eviction)
        self.kv: set = set()
        self.states: set = set()
        self.locks: list = []  # (node, extra_key, prefix)
        self.held_pages: list = []
        self.inserted: list = []  # (tokens, extra_key)

    # ----------------------------------------------------------------------------- helpers
    def sync_after_eviction(self):
        kv, states = tree_contents(self.cache)
        assert kv <= self.kv, f"KV appeared from nowhere: {kv - self.kv}"
        assert states <= self.states, f"states appeared from nowhere: {states - self.states}"
        for _, ek, prefix in self.locks:
            assert (ek, prefix) in states, f"locked state {prefix} was evicted"
            for end in range(self.ps, len(prefix) + 1, self.ps):
                assert (ek, prefix[:end]) in kv, f"locked KV {prefix[:end]} was evicted"
        self.kv, self.states = kv, states

    def predict_match(self, seq, ek):
        cap = len(seq) - 1
        cached = max((n for n in range(1, cap + 1) if (ek, seq[:n]) in self.states), default=0)
        whole = len(seq) // self.ps * self.ps
        branch = max((n for n in range(self.ps, whole + 1, self.ps) if (ek, seq[:n]) in self.kv),
                     default=0)
        return cached, branch

    # ----------------------------------------------------------------------------- rules
    @rule(seq=TOKENS, ek=EXTRA)
    def match(self, seq, ek):
        seq = tuple(seq)
        m = self.cache.match_prefix(np.array(seq, np.int32), extra_key=ek)
        assert (m.cached_len, m.branch_len) == self.predict_match(seq, ek)
        assert (m.read_slot is None) == (m.cached_len == 0)
        assert len(m.page_ids) == m.cached_len // self.ps

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def match_inserted(self, data):
        """Match a sequence inserted before, or a prefix / extension of it."""
        seq, ek = data.draw(st.sampled_from(self.inserted))
        cut = data.draw(st.integers(1, len(seq) + 2))
        seq = seq[:cut] + (1,) * max(0, cut - len(seq))
        self.match(list(seq), ek)

    @rule(seq=TOKENS, ek=EXTRA, positions=st.lists(st.integers(0, 13), max_size=4, unique=True),
          at_end=st.booleans(), spec=st.booleans())
    def insert(self, seq, ek, positions, at_end, spec):
        if at_end and len(seq) not in positions:
            positions = positions + [len(seq)]
        seq, ps = tuple(seq), self.ps
        tokens = np.array(seq, np.int32)
        self.inserted.append((seq, ek))
        m = self.cache.match_prefix(np.append(tokens, 99), extra_key=ek)  # the tree's own pages
        self.cache.lock(m.node)
        own = self.cache.alloc_pages(-(-len(seq) // ps) - m.cached_len // ps)
        if own is None:
            slots = None
        elif spec:  # speculative: as many as free + speculative states allow, never more
            firm = self.firm_states()
            slots = self.cache.alloc_speculative_slots(len(positions))
            assert firm <= tree_contents(self.cache)[1], "a speculative alloc evicted a firm state"
            positions = positions[:len(slots)]
        else:
            slots = self.cache.alloc_slots(len(positions))
        self.cache.unlock(m.node)
        self.sync_after_eviction()
        if slots is None:
            if own is not None:
                self.cache.free_pages(own)
            return
        whole = len(seq) // ps * ps
        accepted = sorted(p for p in positions
                          if p % ps == 0 and 0 < p <= whole and (ek, seq[:p]) not in self.states)
        on_path = [n for n in range(ps, whole + 1, ps) if (ek, seq[:n]) in self.states]
        kept = max(on_path + accepted + [0])
        res = self.cache.insert(tokens, np.concatenate([m.page_ids, own]),
                                dict(zip(positions, slots.tolist(), strict=True)), extra_key=ek)
        assert list(res.accepted) == accepted
        assert sorted(res.rejected) == sorted(set(positions) - set(accepted))
        assert res.kept_len == kept
        assert len(res.page_ids) == kept // ps
        self.states.update((ek, seq[:p]) for p in accepted)
        self.kv.update((ek, seq[:n]) for n in range(ps, kept + 1, ps))
        assert tree_contents(self.cache) == (self.kv, self.states)

    @rule(seq=TOKENS, ek=EXTRA)
    def lock(self, seq, ek):
        seq = tuple(seq)
        m = self.cache.match_prefix(np.array(seq, np.int32), extra_key=ek)
        if m.cached_len:
            self.cache.lock(m.node)
            self.locks.append((m.node, ek, seq[:m.cached_len]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(num=st.integers(1, 20))
    def evict_pages(self, num):
        before = self.cache.evictable_pages()
        freed = self.cache.evict_pages(num)
        assert freed >= min(num, before)
        self.sync_after_eviction()

    def firm_states(self) -> set:
        """(extra_key, prefix) of every state that is not speculative."""
        out = set()
        for ek, root in self.cache.roots.items():
            stack = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for child in node.children.values():
                    full = prefix + tuple(child.key.tolist())
                    if child.slot is not None and not child.spec:
                        out.add((ek, full))
                    stack.append((child, full))
        return out

    @rule(num=st.integers(1, 6))
    def evict_slots(self, num):
        before = self.cache.evictable_slots()
        spec = sum(1 for n in self.cache.lru_spec if n.mamba_lock_ref == 0)
        firm = self.firm_states()
        freed = self.cache.evict_slots(num)
        assert freed >= min(num, before)
        if num <= spec:  # speculative states go first
            assert firm <= tree_contents(self.cache)[1], "a firm state went before a speculative"
        self.sync_after_eviction()

    @rule(num=st.integers(1, 6))
    def hold_pages(self, num):
        got = self.cache.alloc_pages(num)
        if got is not None:
            self.held_pages.append(got)
        self.sync_after_eviction()

    @precondition(lambda self: self.held_pages)
    @rule()
    def release_held(self):
        self.cache.free_pages(self.held_pages.pop())

    @invariant()
    def integrity(self):
        if hasattr(self, "cache"):
            self.cache.check_integrity()
            assert self.cache.pages.num_held == sum(len(h) for h in self.held_pages)
            assert self.cache.slots.num_held == 0


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50,
                                          deadline=None)
TestRadixMachine = RadixMachine.TestCase
