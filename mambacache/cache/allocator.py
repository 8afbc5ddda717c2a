"""Id allocators for KV pages and recurrent-state slots (host side, numpy only).

An ``IdAllocator`` hands out the ids ``1..num_ids`` (id 0 is reserved: KV page 0 is the dump
page, state slot 0 the zero state). Every id is in exactly one of three states, tracked in an
``int8`` status array so that ownership can be audited at any time:

* ``FREE``: on the free list (a numpy stack; ``alloc``/``free`` are one slice each, O(1) calls
  plus O(n) vectorised work for n ids);
* ``HELD``: handed out by ``alloc`` to a request (running slot, planned snapshot slots, KV pages
  of the tokens it computes). ``held_ids()`` lists them; that is how ``check_integrity`` accounts
  for ids held by running requests without the engine passing them in;
* ``TREE``: owned by the radix tree (``adopt`` moves HELD -> TREE, ``release`` TREE -> FREE).

An id limit (``set_limit``, the device split moving: ``engine/runners/rebalance.py``): ids above
``limit`` are never handed out. A FREE id above it leaves the free list (``FENCED``); a HELD or
TREE id above it stays as it is until it is given back, then it is FENCED instead of FREE.
``in_use_above_limit()`` counts those, so a shrink knows when no id above the new rows is in use.
Raising the limit returns FENCED ids to the free list. Without a limit below ``num_ids`` the
give-back paths cost one comparison more.

Misuse raises ``ValueError``: an id outside ``1..num_ids`` (foreign), a double free (id already
FREE), freeing a tree-owned id through the request path, or duplicate ids in one call.
``alloc`` never raises on a short pool: it returns ``None`` (back-pressure).
"""

from __future__ import annotations

import numpy as np

FREE, HELD, TREE, RESERVED, FOREIGN, FENCED = 0, 1, 2, 3, 4, 5
_STATE_NAMES = {FREE: "free", HELD: "held by a request", TREE: "owned by the tree",
                RESERVED: "reserved", FOREIGN: "foreign", FENCED: "above the id limit"}
_BYTE = {k: bytes([k]) for k in _STATE_NAMES}
_INT32 = np.dtype(np.int32)  # compared by identity (cheaper than dtype ==)
# dtype objects, not types: ``astype(np.intp)`` resolves the type on every call (~0.2 us)
_INTP, _UINT32 = np.dtype(np.intp), np.dtype(np.uint32)
_SMALL = 8  # calls with at most this many ids take a pure-Python path (numpy costs ~1 us a call)


class IdAllocator:
    """Free list of ``num_ids`` ids (``1..num_ids``); ``name`` appears in error messages."""

    def __init__(self, num_ids: int, name: str = "id"):
        if not isinstance(num_ids, int | np.integer) or num_ids < 1:
            raise ValueError(f"{name} allocator needs num_ids >= 1, got {num_ids!r}")
        self.name = name
        self.num_ids = int(num_ids)
        # Pop from the end: low ids are handed out first.
        self._stack = np.arange(self.num_ids, 0, -1, dtype=np.int32)
        self._top = self.num_ids
        # status of ids 0..num_ids, then FOREIGN entries so that a negative or too large id
        # looked up by fancy indexing lands on FOREIGN (or raises IndexError) instead of wrapping
        # The status lives in a bytearray: Python indexes it at Python speed (the small-count
        # paths below), numpy views the same bytes for the vectorised paths.
        self._status_bytes = bytearray([FOREIGN]) * (2 * self.num_ids + 2)
        self._status = np.frombuffer(self._status_bytes, dtype=np.int8)
        self._status[1:self.num_ids + 1] = FREE
        self._status[0] = RESERVED
        self._mark = np.zeros(self.num_ids + 1, dtype=np.int32)
        self._arange = np.arange(self.num_ids + 1, dtype=np.int32)
        self._num_held = 0
        self._num_tree = 0
        self.limit = self.num_ids  # ids above it are never handed out (``set_limit``)
        self._num_fenced = 0

    # ----------------------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_held(self) -> int:
        return self._num_held

    @property
    def num_tree(self) -> int:
        return self._num_tree

    @property
    def num_fenced(self) -> int:
        """Ids above the limit that are not in use (off the free list)."""
        return self._num_fenced

    @property
    def num_usable(self) -> int:
        """Ids that are free, held or in the tree: ``num_ids - num_fenced``."""
        return self.num_ids - self._num_fenced

    def share_protected(self, locked: int) -> float:
        """``(locked + num_held) / num_usable``: the share of the pool protected from eviction,
        given the ``locked`` ids the tree pins (``CacheBase.usage``, every step)."""
        return (locked + self._num_held) / (self.num_ids - self._num_fenced)

    def in_use_above_limit(self) -> int:
        """Ids above ``limit`` still held by a request or owned by the tree."""
        return self.num_ids - self.limit - self._num_fenced

    def set_limit(self, limit: int) -> None:
        """Hand out ids ``1..limit`` only from now on (module docstring): FREE ids above it
        leave the free list, FENCED ids at or below it return to it."""
        if not isinstance(limit, int | np.integer) or not 1 <= limit <= self.num_ids:
            raise ValueError(f"{self.name} limit must be in [1, {self.num_ids}], got {limit!r}")
        limit = int(limit)
        free = self._stack[:self._top]
        keep = free[free <= limit]
        self._status[free[free > limit].astype(_INTP)] = FENCED
        back = np.flatnonzero(self._status[1:limit + 1] == FENCED).astype(np.int32) + 1
        self._status[back.astype(_INTP)] = FREE
        stack = np.concatenate([back[::-1], keep])  # low ids stay on top
        self._stack[:len(stack)] = stack
        self._top = len(stack)
        self.limit = limit
        self._num_fenced = int(np.count_nonzero(self._status[:self.num_ids + 1] == FENCED))

    def held_ids(self) -> np.ndarray:
        """``int32[k]``: the ids currently handed out to requests, sorted."""
        return np.flatnonzero(self._status[:self.num_ids + 1] == HELD).astype(np.int32)

    def status_of(self, ids: np.ndarray) -> np.ndarray:
        """``int8[n]``: FREE / HELD / TREE / RESERVED of each id (ids must be in range)."""
        return self._status[self._validated(ids, "query")]

    # ----------------------------------------------------------------------------- transitions
    def alloc(self, num: int) -> np.ndarray | None:
        """``int32[num]`` fresh ids (now HELD), or ``None`` if fewer than ``num`` are free."""
        if num < 0:
            raise ValueError(f"{self.name} alloc of a negative count {num}")
        top = self._top
        if num > top:
            return None
        ids = self._stack[top - num:top].copy()
        self._top = top - num
        if num <= _SMALL:
            status = self._status_bytes
            for i in ids.tolist():
                status[i] = HELD
        else:
            self._status[ids.astype(_INTP)] = HELD  # intp: put() converts int32 slower
        self._num_held += num
        return ids

    def alloc_one(self) -> int | None:
        """``alloc(1)`` as a Python int (a decode row's page at page size 1, every step): no
        array made; None if none is free."""
        top = self._top - 1
        if top < 0:
            return None
        i = int(self._stack[top])
        self._top = top
        self._status_bytes[i] = HELD
        self._num_held += 1
        return i

    def free(self, ids) -> None:
        """Return ids a request holds (HELD -> FREE). ``ids``: int32 array or list of ints."""
        ids = self._transition(ids, HELD, FREE, "free")
        if len(ids):
            self._push(ids)
        self._num_held -= len(ids)

    def adopt(self, ids) -> None:
        """The tree takes ownership of ids a request held (HELD -> TREE)."""
        ids = self._transition(ids, HELD, TREE, "adopt")
        self._num_held -= len(ids)
        self._num_tree += len(ids)

    def release(self, ids) -> None:
        """The tree gives ids back to the free list (TREE -> FREE), e.g. on eviction."""
        ids = self._transition(ids, TREE, FREE, "release")
        self._push(ids)
        self._num_tree -= len(ids)

    # ----------------------------------------------------------------------------- internals
    def _validated(self, ids, verb: str) -> np.ndarray:
        arr = ids if type(ids) is np.ndarray and ids.dtype == np.int32 else np.asarray(ids)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size and (int(arr.min()) < 1 or int(arr.max()) > self.num_ids):
            bad = arr[(arr < 1) | (arr > self.num_ids)]
            raise ValueError(
                f"{self.name} {verb}: foreign id(s) {bad.tolist()[:8]}, valid ids are "
                f"1..{self.num_ids}"
            )
        return arr.astype(np.int32, copy=False)

    def _transition(self, ids, expected: int, new: int, verb: str) -> np.ndarray:
        if type(ids) is list and len(ids) <= _SMALL:
            return self._transition_small(ids, expected, new, verb)
        if type(ids) is not np.ndarray or ids.dtype is not _INT32 or ids.ndim != 1:
            ids = self._validated(ids, verb)
        n = ids.size
        if n <= _SMALL:
            if n:
                self._transition_small(ids.tolist(), expected, new, verb)
            return ids
        # Index with intp (numpy converts int32 indices on every use); through uint32 a negative
        # id becomes huge and raises IndexError, num_ids < id <= 2 num_ids + 1 lands on FOREIGN.
        idx = ids.view(_UINT32).astype(_INTP)
        status_arr = self._status
        try:
            status = status_arr[idx]
        except IndexError:
            status = None
        if status is None or status.tobytes() != _BYTE[expected] * n:
            self._validated(ids, verb)  # raises on a foreign id
            self._raise_status(ids, status, expected, verb)
        # duplicates: scatter positions, gather back; a repeated id keeps only its last position
        positions, mark = self._arange[:n], self._mark
        mark[idx] = positions
        if mark[idx].tobytes() != positions.tobytes():
            raise ValueError(f"{self.name} {verb}: duplicate ids in {ids.tolist()[:16]}")
        status_arr[idx] = new
        return ids

    def _transition_small(self, ids: list, expected: int, new: int, verb: str) -> np.ndarray:
        """Python path for a few ids given as a list (snapshot slots): no numpy temporaries."""
        status, n = self._status_bytes, self.num_ids
        for i in ids:
            if type(i) is not int or not 1 <= i <= n:
                self._validated(ids, verb)  # raises on a foreign id
            if status[i] != expected:
                arr = np.asarray(ids, dtype=np.int32)
                self._raise_status(arr, self._status[arr], expected, verb)
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise ValueError(f"{self.name} {verb}: duplicate ids in {ids}")
        for i in ids:
            status[i] = new
        return ids  # type: ignore[return-value]

    def release_one(self, i: int) -> None:
        """``release_trusted`` of a single id (a state slot on eviction)."""
        self._num_tree -= 1
        if i > self.limit:
            self._status_bytes[i] = FENCED
            self._num_fenced += 1
            return
        self._status_bytes[i] = FREE
        self._stack[self._top] = i
        self._top += 1

    def _raise_status(self, arr: np.ndarray, status: np.ndarray, expected: int, verb: str):
        i = int(np.flatnonzero(status != expected)[0])
        what = "double free" if status[i] == FREE else "wrong owner"
        raise ValueError(
            f"{self.name} {verb}: {what}: id {int(arr[i])} is "
            f"{_STATE_NAMES[int(status[i])]}, expected {_STATE_NAMES[expected]}"
        )

    def release_trusted(self, ids: np.ndarray) -> None:
        """``release`` without checks, for ids the tree itself hands back (eviction); the
        integrity check audits them."""
        n = len(ids)
        if n <= _SMALL:
            status = self._status_bytes
            for i in ids.tolist():
                status[i] = FREE
        else:
            self._status[ids.astype(_INTP)] = FREE
        self._push(ids)
        self._num_tree -= n

    def _push(self, ids: np.ndarray) -> None:
        if self.limit < self.num_ids:  # ids above the limit are fenced, not freed
            ids = self._fence(ids)
        n, top = len(ids), self._top
        if n <= _SMALL:  # item assignment beats a numpy slice call for a few ids
            stack = self._stack
            for j, i in enumerate(ids.tolist() if type(ids) is np.ndarray else ids):
                stack[top + j] = i
        else:
            self._stack[top:top + n] = ids
        self._top = top + n

    def _fence(self, ids) -> np.ndarray:
        """``ids`` at or below the limit; those above it become FENCED."""
        arr = np.asarray(ids, np.int32)
        high = arr > self.limit
        if not high.any():
            return arr
        self._status[arr[high].astype(_INTP)] = FENCED
        self._num_fenced += int(high.sum())
        return arr[~high]

    def check(self) -> None:
        """Audit the free list against the status array; ``AssertionError`` on any mismatch."""
        free_ids = self._stack[:self._top]
        counts = np.bincount(self._status[:self.num_ids + 1], minlength=6)
        if len(np.unique(free_ids)) != len(free_ids):
            raise AssertionError(f"{self.name} free list holds duplicate ids")
        if len(free_ids) and not (self._status[free_ids] == FREE).all():
            raise AssertionError(f"{self.name} free list holds ids that are not FREE")
        if counts[FREE] != self._top:
            raise AssertionError(
                f"{self.name}: {counts[FREE]} ids are FREE but the free list holds {self._top}"
            )
        if counts[HELD] != self._num_held or counts[TREE] != self._num_tree:
            raise AssertionError(
                f"{self.name}: status counts held={counts[HELD]} tree={counts[TREE]} differ from "
                f"counters held={self._num_held} tree={self._num_tree}"
            )
        if counts[RESERVED] != 1 or self._status[0] != RESERVED or counts[FOREIGN] or (
                self._status[self.num_ids + 1:] != FOREIGN).any():
            raise AssertionError(f"{self.name}: id 0 must be the only reserved id")
        if counts[FENCED] != self._num_fenced or (
                self._status[1:self.limit + 1] == FENCED).any() or (
                self._status[self.limit + 1:self.num_ids + 1] == FREE).any():
            raise AssertionError(f"{self.name}: {counts[FENCED]} ids FENCED (counter "
                                 f"{self._num_fenced}); only ids above the limit {self.limit} "
                                 "may be, and none of those FREE")
        if self._top + self._num_held + self._num_tree + self._num_fenced != self.num_ids:
            raise AssertionError(
                f"{self.name}: free {self._top} + held {self._num_held} + tree {self._num_tree} "
                f"+ fenced {self._num_fenced} != total {self.num_ids}"
            )
