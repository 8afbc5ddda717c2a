"""Random ragged-batch cases shared by the kernel tests and the benchmark (numpy on the host)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RaggedCase:
    """A packed batch: ``lens`` extend lengths padded to T tokens and B sequences.

    ``read_slot``/``write_slot`` ``[B]``, snapshots ``[S]`` each, ``cu_seqlens [B+1]``; slot 0
    is never written; padding sequences have length 0 and write slot 0.
    """

    lens: tuple[int, ...]
    cu_seqlens: np.ndarray
    read_slot: np.ndarray
    write_slot: np.ndarray
    snap_seq: np.ndarray
    snap_offset: np.ndarray
    snap_slot: np.ndarray
    num_tokens: int
    num_slots: int


def ragged_case(rng: np.random.Generator, lens: Sequence[int], *, num_tokens: int,
                num_seqs: int, snapshots: Sequence[tuple[int, int]] = (),
                num_snapshots: int | None = None, zero_init: bool = False) -> RaggedCase:
    """Build a case. ``snapshots`` are ``(seq, offset)``; each gets its own fresh slot.

    Write and snapshot slots are distinct fresh slots, so every write is observable. Each
    sequence reads (unless ``zero_init``: slot 0) either its own write slot or one of the slots
    no sequence writes (a cached snapshot; several sequences may read the same one): as the
    engine guarantees, no sequence reads a slot that another one (or a snapshot) writes in the
    same call. The kernels update the pool in place, so such a read would see the other
    sequence's write or not depending on the order the programs run in (on hardware, and in
    JAX >= 0.11's interpreter, which makes each grid step's writes to an aliased pool visible to
    the next; 0.10's interpreter read a copy).
    """
    lens = tuple(int(n) for n in lens)
    if sum(lens) > num_tokens or len(lens) > num_seqs:
        raise ValueError(f"lens {lens} do not fit {num_tokens} tokens / {num_seqs} seqs")
    num_snaps = num_snapshots if num_snapshots is not None else max(len(snapshots), 1)
    num_slots = 1 + 2 * num_seqs + num_snaps + 2
    cu = np.full(num_seqs + 1, sum(lens), np.int32)
    cu[0] = 0
    cu[1:len(lens) + 1] = np.cumsum(lens)
    fresh = rng.permutation(np.arange(1, num_slots))
    write = np.zeros(num_seqs, np.int32)
    write[:len(lens)] = fresh[:len(lens)]
    unwritten = fresh[len(lens) + len(snapshots):]
    read = np.zeros(num_seqs, np.int32)
    if not zero_init:
        own = rng.integers(0, 2, size=len(lens)).astype(bool)
        read[:len(lens)] = np.where(own, write[:len(lens)],
                                    rng.choice(unwritten, size=len(lens)))
    snap = np.zeros((3, num_snaps), np.int32)
    for j, (b, off) in enumerate(snapshots):
        snap[:, j] = (b, off, fresh[len(lens) + j])
    return RaggedCase(lens, cu, read, write, snap[0], snap[1], snap[2], num_tokens, num_slots)


def gdr_inputs(rng: np.random.Generator, case: RaggedCase, num_k_heads: int, num_v_heads: int,
               head_k_dim: int, head_v_dim: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random q, k, v, g, beta and an ssm pool (slot 0 zero) for a gated delta rule case."""
    t = case.num_tokens
    pool = rng.normal(size=(case.num_slots, num_v_heads, head_k_dim, head_v_dim)) * 0.5
    pool[0] = 0.0
    return dict(
        q=rng.normal(size=(t, num_k_heads, head_k_dim)).astype(dtype),
        k=rng.normal(size=(t, num_k_heads, head_k_dim)).astype(dtype),
        v=rng.normal(size=(t, num_v_heads, head_v_dim)).astype(dtype),
        g=np.log(rng.uniform(0.5, 1.0, size=(t, num_v_heads))).astype(np.float32),
        beta=rng.uniform(0.05, 0.95, size=(t, num_v_heads)).astype(np.float32),
        ssm_pool=pool.astype(np.float32),
    )


def slot_args(case: RaggedCase) -> tuple[np.ndarray, ...]:
    """``(cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot)``."""
    return (case.cu_seqlens, case.read_slot, case.write_slot, case.snap_seq, case.snap_offset,
            case.snap_slot)


def paged_attention_case(rng: np.random.Generator, ext: Sequence[int], prefix: Sequence[int],
                         page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         pad_tokens: int = 2) -> tuple[np.ndarray, ...]:
    """Random paged-attention inputs: ``(q [T+pad, Hq, D], k_pages, v_pages [N, page_size, Hkv,
    D] f64, cu_seqlens [B+1], seq_lens [B], page_table [B, P] int32)``. Sequence b extends
    ``ext[b]`` tokens after ``prefix[b]`` cached ones; each gets distinct random pages (page 0,
    the dump page, is never used)."""
    seq_lens = np.array(ext, np.int32) + np.array(prefix, np.int32)
    pages_per = int(max(1, -(-seq_lens.max() // page_size))) + 1
    num_pages = len(ext) * pages_per + 1
    table = rng.permutation(np.arange(1, num_pages))[:len(ext) * pages_per]
    table = table.reshape(len(ext), pages_per).astype(np.int32)
    kp = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    vp = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    cu = np.concatenate([[0], np.cumsum(ext)]).astype(np.int32)
    q = rng.normal(size=(int(cu[-1]) + pad_tokens, num_q_heads, head_dim))
    return q, kp, vp, cu, seq_lens, table
