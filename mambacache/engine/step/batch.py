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

from mambacache.engine.step.plan import SeqSpec

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
    ``seq_lens`` cover [speculative: the MTP drafts' K/V go past the step's tokens].

    Array work over the whole step: per row only its fields are read (no numpy call per row
    but the ``tokens`` one), so a decode step of hundreds of rows costs the host little."""
    n_seq = len(seqs)
    ext = np.fromiter((len(s.tokens) for s in seqs), np.int64, n_seq)
    prefix = np.fromiter((s.prefix_len for s in seqs), np.int64, n_seq)
    total = int(ext.sum())
    T = num_tokens if num_tokens is not None else max(total, 1)
    B = num_seqs if num_seqs is not None else max(n_seq, 1)
    seq_end = prefix + ext
    need = -(-seq_end // page_size)
    most = int(need.max()) if n_seq else 0
    P = num_pages_per_seq if num_pages_per_seq is not None else max(most, 1)
    snaps = [(i, off, slot) for i, s in enumerate(seqs) for off, slot in s.snapshots]
    S = num_snapshots if num_snapshots is not None else max(len(snaps), 1)
    if total > T or n_seq > B or most > P or len(snaps) > S:
        raise ValueError(
            f"batch does not fit its buckets: tokens {total}/{T}, seqs {n_seq}/{B}, "
            f"pages {most}/{P}, snapshots {len(snaps)}/{S}")
    held = np.fromiter((len(s.page_ids) for s in seqs), np.int64, n_seq)
    short = np.flatnonzero(held < need)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {i} needs {need[i]} pages, got {held[i]}")
    ids = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    loc = np.zeros(T, np.int32)
    cu = np.full(B + 1, total, np.int32)
    seq_lens = np.zeros(B, np.int32)
    table = np.zeros((B, P), np.int32)
    read = np.zeros(B, np.int32)
    write = np.zeros(B, np.int32)
    starts = np.cumsum(ext) - ext
    cu[:n_seq] = starts
    seq_lens[:n_seq] = seq_end
    read[:n_seq] = np.fromiter((s.read_slot for s in seqs), np.int64, n_seq)
    write[:n_seq] = np.fromiter((s.write_slot for s in seqs), np.int64, n_seq)
    if n_seq:
        # each row's page ids (those its seq_lens cover, or all up to P), row-major
        width = np.minimum(held, P) if all_pages else need
        flat = np.concatenate([np.asarray(s.page_ids[:w], np.int32)
                               for s, w in zip(seqs, width.tolist(), strict=True)])
        table[:n_seq][np.arange(P) < width[:, None]] = flat
    if total:
        ids[:total] = np.concatenate([np.asarray(s.tokens, np.int32) for s in seqs])
        row = np.repeat(np.arange(n_seq), ext)
        p = np.arange(total) + np.repeat(prefix - starts, ext)
        pos[:total] = p
        loc[:total] = table[row, p // page_size] * page_size + p % page_size
    kinds = [s.logits for s in seqs]
    if kinds.count("last") == n_seq:
        logit_idx = (starts + ext - 1)[ext > 0]
    else:  # verify rows ("all"), rows without logits ("none")
        out: list[int] = []
        for start, n, kind in zip(starts.tolist(), ext.tolist(), kinds, strict=True):
            if kind == "all":
                out.extend(range(start, start + n))
            elif kind == "last" and n > 0:
                out.append(start + n - 1)
        logit_idx = np.asarray(out, np.int64)
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
