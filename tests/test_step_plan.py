"""``step_hazards``: the cross-row rule that makes in-place kernels safe."""

from __future__ import annotations

from mambacache.engine.step.plan import SeqSpec, is_decode_step, step_hazards


def _row(prefix, n, pages, read, write, snaps=()):
    return SeqSpec(tokens=[1] * n, prefix_len=prefix, page_ids=pages, read_slot=read,
                   write_slot=write, snapshots=snaps)


def test_disjoint_rows_and_own_reads_are_safe():
    a = _row(4, 2, [1, 2], read=3, write=3, snaps=[(1, 5)])  # reads and writes its own slot
    b = _row(0, 5, [3, 4], read=0, write=4)
    shared = _row(4, 1, [1, 6], read=7, write=8)  # reads page 1, which nobody writes
    assert step_hazards([a, b], 4) == []
    assert step_hazards([_row(4, 1, [1, 9], 2, 2), shared], 4) == []


def test_every_kind_of_conflict_is_named():
    w = _row(0, 3, [1], read=0, write=5, snaps=[(2, 6)])
    assert step_hazards([w, _row(0, 2, [2], 0, 6)], 4) == ["slot 6 written by rows 0 and 1"]
    assert step_hazards([w, _row(2, 1, [3], 5, 7)], 4) == ["row 1 reads slot 5 that row 0 writes"]
    assert step_hazards([w, _row(0, 2, [1], 0, 7)], 4) == [
        "page 1 written by rows 0 and 1", "row 0 reads page 1 that row 1 writes",
        "row 1 reads page 1 that row 0 writes"]
    reader = _row(4, 1, [1, 2], read=8, write=9)  # attends to page 1, which row 0 writes
    assert step_hazards([w, reader], 4) == ["row 1 reads page 1 that row 0 writes"]


def test_decode_program_rule():
    assert is_decode_step([_row(3, 1, [1], 2, 4), _row(7, 1, [2, 3], 5, 5)])
    assert not is_decode_step([_row(3, 1, [1], 2, 4, snaps=[(1, 6)])])
    assert not is_decode_step([_row(3, 2, [1], 2, 4)])
