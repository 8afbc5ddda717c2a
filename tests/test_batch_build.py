"""``build_forward_batch`` (array work over the whole step) against a row-by-row packing of the
same rows: every field equal on random steps (decode, prefill chunks, snapshots, verify rows,
rows without logits, padding, ``all_pages``), and the errors it raises."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.engine.step.batch import build_forward_batch
from mambacache.engine.step.plan import SeqSpec


def _rowwise(seqs: list[SeqSpec], page_size: int, T: int, B: int, P: int, S: int, L: int,
             all_pages: bool) -> dict[str, np.ndarray]:
    """The packing written one row at a time (the reference)."""
    out = {k: np.zeros(T, np.int32) for k in ("input_ids", "positions", "out_cache_loc")}
    total = sum(len(s.tokens) for s in seqs)
    out["cu_seqlens"] = np.full(B + 1, total, np.int32)
    for k in ("seq_lens", "read_slot", "write_slot"):
        out[k] = np.zeros(B, np.int32)
    out["page_table"] = np.zeros((B, P), np.int32)
    snap = np.zeros((3, S), np.int32)
    logits: list[int] = []
    start = k_snap = 0
    for i, s in enumerate(seqs):
        n, end = len(s.tokens), s.prefix_len + len(s.tokens)
        pages = list(s.page_ids)[:-(-end // page_size)]
        out["cu_seqlens"][i] = start
        for j in range(n):
            p = s.prefix_len + j
            out["input_ids"][start + j] = s.tokens[j]
            out["positions"][start + j] = p
            out["out_cache_loc"][start + j] = pages[p // page_size] * page_size + p % page_size
        out["seq_lens"][i] = end
        row = list(s.page_ids)[:P] if all_pages else pages
        out["page_table"][i, :len(row)] = row
        out["read_slot"][i], out["write_slot"][i] = s.read_slot, s.write_slot
        for off, slot in s.snapshots:
            snap[:, k_snap] = (i, off, slot)
            k_snap += 1
        if s.logits == "all":
            logits += range(start, start + n)
        elif s.logits == "last" and n:
            logits.append(start + n - 1)
        start += n
    out["snap_seq"], out["snap_offset"], out["snap_slot"] = snap
    out["logits_indices"] = np.zeros(L, np.int32)
    out["logits_indices"][:len(logits)] = logits
    return out


def _random_step(rng: np.random.Generator, page_size: int) -> list[SeqSpec]:
    seqs = []
    for _ in range(int(rng.integers(1, 9))):
        prefix = int(rng.integers(0, 40))
        n = int(rng.choice([0, 1, 1, 1, int(rng.integers(2, 20))]))
        pages = rng.permutation(200)[:-(-(prefix + n) // page_size) + int(rng.integers(0, 3))]
        tokens = rng.integers(1, 1000, n)
        snaps = [(int(o), int(rng.integers(1, 50))) for o in sorted(rng.choice(
            np.arange(1, n + 1), size=min(n, int(rng.integers(0, 3))), replace=False))]
        seqs.append(SeqSpec(
            tokens=tokens.tolist() if rng.random() < 0.3 else tokens.astype(np.int32),
            prefix_len=prefix, page_ids=pages.tolist() if rng.random() < 0.3 else
            pages.astype(np.int32), read_slot=int(rng.integers(0, 9)),
            write_slot=int(rng.integers(0, 9)), snapshots=snaps,
            logits=str(rng.choice(["last", "last", "all", "none"]))))
    return seqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_packing_equals_row_by_row(page_size):
    rng = np.random.default_rng(page_size)
    for _ in range(60):
        seqs = _random_step(rng, page_size)
        all_pages = bool(rng.random() < 0.3)
        total = sum(len(s.tokens) for s in seqs)
        pad = int(rng.integers(0, 4))
        T, B = total + pad + 1, len(seqs) + pad
        P = max(-(-(s.prefix_len + len(s.tokens)) // page_size) for s in seqs) + pad + 1
        S = sum(len(s.snapshots) for s in seqs) + pad + 1
        L = sum(len(s.tokens) if s.logits == "all" else s.logits == "last" and len(s.tokens) > 0
                for s in seqs) + pad + 1
        got = build_forward_batch(seqs, page_size, num_tokens=T, num_seqs=B, num_pages_per_seq=P,
                                  num_snapshots=S, num_logits=L, as_numpy=True,
                                  all_pages=all_pages)
        want = _rowwise(seqs, page_size, T, B, P, S, L, all_pages)
        for name, value in want.items():
            np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
            assert getattr(got, name).dtype == np.int32, name


def test_decode_rows_exact_fit():
    seqs = [SeqSpec(tokens=np.asarray([7 + i], np.int32), prefix_len=5 + i,
                    page_ids=np.arange(10 * i, 10 * i + 10, dtype=np.int32), read_slot=i + 1,
                    write_slot=i + 1) for i in range(3)]
    got = build_forward_batch(seqs, 2, as_numpy=True)
    np.testing.assert_array_equal(got.positions, [5, 6, 7])
    np.testing.assert_array_equal(got.out_cache_loc, [2 * 2 + 1, 2 * 13 + 0, 2 * 23 + 1])
    np.testing.assert_array_equal(got.logits_indices, [0, 1, 2])
    np.testing.assert_array_equal(got.page_table, [[0, 1, 2, 0], [10, 11, 12, 13],
                                                   [20, 21, 22, 23]])


def test_errors_name_the_row_and_the_bucket():
    rows = [SeqSpec(tokens=[1, 2], prefix_len=0, page_ids=[3, 5], read_slot=0, write_slot=1),
            SeqSpec(tokens=[1], prefix_len=4, page_ids=[4, 6], read_slot=0, write_slot=2)]
    with pytest.raises(ValueError, match="sequence 1 needs 5 pages, got 2"):
        build_forward_batch(rows, 1, as_numpy=True)
    with pytest.raises(ValueError, match="tokens 3/2"):
        build_forward_batch(rows, 4, num_tokens=2, as_numpy=True)
    with pytest.raises(ValueError, match="pages 2/1"):
        build_forward_batch(rows, 4, num_pages_per_seq=1, as_numpy=True)
    with pytest.raises(ValueError, match="logits 2/1"):
        build_forward_batch(rows, 4, num_logits=1, as_numpy=True)


def test_future_index_marks_each_placeholder_at_its_rows_last_token():
    from mambacache.engine.runners.model_runner import future_index

    rows = [SeqSpec(tokens=[0], prefix_len=3, page_ids=[1, 2, 3, 4], read_slot=1, write_slot=1,
                    prev_index=5),
            SeqSpec(tokens=[4, 5, 6], prefix_len=0, page_ids=[6, 7, 8], read_slot=0, write_slot=2),
            SeqSpec(tokens=[9, 0], prefix_len=2, page_ids=[9, 10, 11, 12], read_slot=3,
                    write_slot=3, prev_index=0)]
    np.testing.assert_array_equal(future_index(rows, 8), [5, -1, -1, -1, -1, 0, -1, -1])
