"""``ForwardBatch``: the explicit context of one jitted step, packed and padded to buckets.

The host builds it from numpy ints (``build_forward_batch``); the device only gathers and scatters
at the indices it holds. Sequences are ragged and packed along the token axis; ``cu_seqlens``
marks their boundaries. Tokens past ``cu_seqlens[-1]`` and sequences of extend length 0 are
padding: they write K/V to the dump page 0 and their state writes go to slot 0 (dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.step_plan import SeqSpec

__all__ = ["ForwardBatch", "SeqSpec", "build_forward_batch"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """One step's inputs. T tokens, B sequences, P pages per sequence, S snapshots, L logits.

    Attributes (all int32):
      input_ids: ``[T]`` packed extend tokens, padding 0.
      positions: ``[T]`` absolute position of each token in its sequence, padding 0.
      out_cache_loc: ``[T]`` KV location ``page * page_size + offset`` each token writes, padding
        in page 0.
      cu_seqlens: ``[B + 1]`` extend boundaries in the packed axis; ``cu_seqlens[0] == 0``.
      seq_lens: ``[B]`` tokens of each sequence after this step (prefix + extend), padding 0.
      page_table: ``[B, P]`` KV page ids covering each sequence's ``seq_lens`` tokens, 0-padded.
      read_slot: ``[B]`` state slot the initial conv/SSM state is read from (0 = zero state).
      write_slot: ``[B]`` state slot the final state is written to (0 = dropped).
      snap_seq: ``[S]`` snapshot requests: index of the sequence in the batch.
      snap_offset: ``[S]`` take the state after this many extend tokens (0..extend_len).
      snap_slot: ``[S]`` destination slot of the snapshot (0 = dropped, i.e. padding).
      logits_indices: ``[L]`` packed token indices whose logits the step returns.
    """

    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    cu_seqlens: jax.Array
    seq_lens: jax.Array
    page_table: jax.Array
    read_slot: jax.Array
    write_slot: jax.Array
    snap_seq: jax.Array
    snap_offset: jax.Array
    snap_slot: jax.Array
    logits_indices: jax.Array

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.read_slot.shape[0])


def build_forward_batch(seqs: Sequence[SeqSpec], page_size: int, *, num_tokens: int | None = None,
                        num_seqs: int | None = None, num_pages_per_seq: int | None = None,
                        num_snapshots: int | None = None, num_logits: int | None = None,
                        as_numpy: bool = False, all_pages: bool = False) -> Any:
    """Pack ``seqs`` into a ``ForwardBatch`` padded to the given sizes (default: exact fit).
    ``all_pages``: page tables list every page a sequence holds (up to P), not only those its
    ``seq_lens`` cover [speculative: the MTP drafts' K/V go past the step's tokens]."""
    ext = [len(s.tokens) for s in seqs]
    total = sum(ext)
    T = num_tokens if num_tokens is not None else max(total, 1)
    B = num_seqs if num_seqs is not None else max(len(seqs), 1)
    need_pages = [-(-(s.prefix_len + n) // page_size) for s, n in zip(seqs, ext, strict=True)]
    P = num_pages_per_seq if num_pages_per_seq is not None else max(need_pages + [1])
    snaps = [(i, off, slot) for i, s in enumerate(seqs) for off, slot in s.snapshots]
    S = num_snapshots if num_snapshots is not None else max(len(snaps), 1)
    if total > T or len(seqs) > B or max(need_pages + [0]) > P or len(snaps) > S:
        raise ValueError(
            f"batch does not fit its buckets: tokens {total}/{T}, seqs {len(seqs)}/{B}, "
            f"pages {max(need_pages + [0])}/{P}, snapshots {len(snaps)}/{S}")
    ids = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    loc = np.zeros(T, np.int32)
    cu = np.full(B + 1, total, np.int32)
    seq_lens = np.zeros(B, np.int32)
    table = np.zeros((B, P), np.int32)
    read = np.zeros(B, np.int32)
    write = np.zeros(B, np.int32)
    logit_idx: list[int] = []
    start = 0
    for i, s in enumerate(seqs):
        n = ext[i]
        if len(s.page_ids) < need_pages[i]:
            raise ValueError(f"sequence {i} needs {need_pages[i]} pages, got {len(s.page_ids)}")
        cu[i] = start
        p = np.arange(s.prefix_len, s.prefix_len + n, dtype=np.int32)
        pages = np.asarray(s.page_ids, np.int32)[:need_pages[i]]
        ids[start:start + n] = np.asarray(s.tokens, np.int32)
        pos[start:start + n] = p
        loc[start:start + n] = pages[p // page_size] * page_size + p % page_size
        seq_lens[i] = s.prefix_len + n
        held = np.asarray(s.page_ids[:P], np.int32) if all_pages else pages
        table[i, :len(held)] = held
        read[i], write[i] = s.read_slot, s.write_slot
        if s.logits == "all":
            logit_idx.extend(range(start, start + n))
        elif s.logits == "last" and n > 0:
            logit_idx.append(start + n - 1)
        start += n
    L = num_logits if num_logits is not None else max(len(logit_idx), 1)
    if len(logit_idx) > L:
        raise ValueError(f"batch does not fit its buckets: logits {len(logit_idx)}/{L}")
    snap = np.zeros((3, S), np.int32)
    if snaps:
        snap[:, :len(snaps)] = np.asarray(snaps, np.int32).T
    logits_indices = np.zeros(L, np.int32)
    logits_indices[:len(logit_idx)] = logit_idx
    arrays = dict(input_ids=ids, positions=pos, out_cache_loc=loc, cu_seqlens=cu,
                  seq_lens=seq_lens, page_table=table, read_slot=read, write_slot=write,
                  snap_seq=snap[0], snap_offset=snap[1], snap_slot=snap[2],
                  logits_indices=logits_indices)
    if as_numpy:
        return ForwardBatch(**arrays)
    return ForwardBatch(**{k: jnp.asarray(v) for k, v in arrays.items()})
