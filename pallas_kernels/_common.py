"""Shared helpers of the kernels and their references: ragged-batch bookkeeping, norms."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.fixed_order import row_sum

HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)  # IEEE fp32 dots: no TF32


def dot_precision(dtype) -> tuple | None:
    """Precision of the dots over values computed from inputs of ``dtype``. fp32 means fp32 on
    every backend: ``HIGHEST`` for fp32 inputs (a GPU would run ``DEFAULT`` fp32 dots in TF32,
    a TPU in one bf16 pass); narrower inputs keep the backend's default (None)."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def interpret_default(family: str = "tpu") -> bool:
    """Run the ``family`` ("tpu": Mosaic, "gpu": Triton) kernels interpreted?
    ``PALLAS_INTERPRET=0/1`` decides; else unless the backend is the family's own."""
    env = os.environ.get("PALLAS_INTERPRET")
    if env in ("0", "1"):
        return env == "1"
    return jax.default_backend() != family


def l2norm(x: jax.Array, eps: float = 1e-6, *, fixed_order: bool = False) -> jax.Array:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in float32 (transformers' ``l2norm``); the sum in the
    fixed tree of ``fixed_order.py`` if ``fixed_order``."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(row_sum(x32 * x32, fixed_order=fixed_order) + eps)


def token_seq_ids(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Sequence index ``[T] int32`` of every packed token and its validity ``[T] bool``.

    Padding tokens (``t >= cu_seqlens[-1]``) get the last sequence index and ``False``.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    return seq, t < cu_seqlens[-1]


def drop_slot(slot: jax.Array, num_slots: int) -> jax.Array:
    """Map slot 0 (the zero state, writes dropped) out of range, for ``.at[].set(mode="drop")``."""
    return jnp.where(slot == 0, num_slots, slot)


def state_targets(cu_seqlens: jax.Array, write_slot: jax.Array, snap_seq: jax.Array,
                  snap_offset: jax.Array, snap_slot: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every state the extend writes: the B final states, then the S snapshots.

    Returns ``(seq [B+S], offset [B+S], slot [B+S])``, all int32: the state after ``offset``
    extend tokens of sequence ``seq`` goes to ``slot`` (0 = dropped).
    """
    num_seqs = write_slot.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = jnp.concatenate([jnp.arange(num_seqs, dtype=jnp.int32), snap_seq.astype(jnp.int32)])
    offset = jnp.concatenate([lens, snap_offset]).astype(jnp.int32)
    offset = jnp.clip(offset, 0, lens[seq])
    slot = jnp.concatenate([write_slot, snap_slot]).astype(jnp.int32)
    return seq, offset, slot


def copy_empty_targets(pool, cu_seqlens, read_slot, t_seq, t_slot):
    """States written for empty sequences are copies of their initial state (no chunk has
    them): ``pool[t_slot] <- pool[read_slot[t_seq]]`` where the sequence is empty."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    dst = jnp.where(lens[t_seq] == 0, t_slot, 0)
    return pool.at[drop_slot(dst, pool.shape[0])].set(pool[read_slot[t_seq]], mode="drop")


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond`` (static shape checks of the public wrappers)."""
    if not cond:
        raise ValueError(msg)


def max_chunks(num_tokens: int, chunk_size: int, num_seqs: int) -> int:
    """Static bound on the chunks of ``num_tokens`` packed tokens of ``num_seqs`` sequences cut
    into ``chunk_size`` pieces that never span two sequences (``NC`` in docs/kernels.md)."""
    return min(-(-num_tokens // chunk_size) + num_seqs, max(num_tokens, 1))


def check_chunk_size(chunk_size: int) -> None:
    """``ValueError`` unless ``chunk_size`` is a positive multiple of 8 (sublane tiles)."""
    check(chunk_size % 8 == 0 and chunk_size > 0,
          f"chunk_size {chunk_size} must be a positive multiple of 8")


def chunk_layout(cu_seqlens, num_tokens: int, chunk_size: int, num_chunks: int):
    """Cut every sequence into chunks of ``chunk_size`` that never span two sequences.

    Returns ``(gather [NC, BT] token index or T for zero rows, chunk_seq [NC], first [NC] int32,
    chunk_off [B+1] first chunk of each sequence)``.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_off = jnp.concatenate([jnp.zeros(1, jnp.int32),
                                 jnp.cumsum(-(-lens // chunk_size)).astype(jnp.int32)])
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(chunk_off, c, side="right") - 1, 0, num_seqs - 1)
    used = c < chunk_off[-1]
    local = (c - chunk_off[seq])[:, None] * chunk_size + jnp.arange(chunk_size)
    valid = used[:, None] & (local < lens[seq][:, None])
    gather = jnp.where(valid, cu_seqlens[seq][:, None] + local, num_tokens)
    first = (used & (c == chunk_off[seq])).astype(jnp.int32)
    return gather, seq.astype(jnp.int32), first, chunk_off


def chunk_spans(cu_seqlens, num_tokens: int, chunk_size: int, num_chunks: int):
    """The chunks of ``chunk_layout`` as spans: ``(seq [NC], loc [NC], count [NC])`` int32, chunk
    c holding the ``count`` tokens (0 for unused chunks) of sequence ``seq`` from its local
    offset ``loc`` (packed index ``cu_seqlens[seq] + loc``)."""
    _, seq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    loc = (c - chunk_off[seq]) * chunk_size
    count = jnp.where(c < chunk_off[-1], jnp.clip(lens[seq] - loc, 0, chunk_size), 0)
    return seq, loc.astype(jnp.int32), count.astype(jnp.int32)


def chunk_targets(cu_seqlens, chunk_off, t_seq, t_off, t_slot, chunk_size, num_chunks):
    """Sort the written states by chunk. Returns CSR ``(start [NC+1], row [J], slot [J])``:
    the state after ``row`` (0..BT) tokens of the chunk goes to ``slot``."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    inner = jnp.where(t_off > 0, (t_off - 1) // chunk_size, 0)
    chunk = jnp.where(lens[t_seq] > 0, chunk_off[t_seq] + inner, num_chunks)
    order = jnp.argsort(chunk, stable=True)
    start = jnp.searchsorted(chunk[order], jnp.arange(num_chunks + 1), side="left")
    row = (t_off - inner * chunk_size)[order]
    return start.astype(jnp.int32), row.astype(jnp.int32), t_slot[order]


def extend_targets(pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
                   chunk_off, chunk_size: int, num_chunks: int):
    """The states a chunked extend kernel writes, as its CSR target table; the targets of empty
    sequences are done here (copies of the initial state). Returns ``(pool, tstart [NC+1],
    trow [J], tslot [J])`` (see ``state_targets``, ``copy_empty_targets``, ``chunk_targets``)."""
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    pool = copy_empty_targets(pool, cu_seqlens, read_slot, t_seq, t_slot)
    tstart, trow, tslot = chunk_targets(cu_seqlens, chunk_off, t_seq, t_off, t_slot,
                                        chunk_size, num_chunks)
    return pool, tstart, trow, tslot


def bias_row(bias: jax.Array | None, channels: int) -> jax.Array:
    """Conv bias ``[C]`` (None: zeros) as an f32 row ``[1, C]`` for the kernels."""
    return (jnp.zeros((1, channels), jnp.float32) if bias is None
            else bias.reshape(1, channels).astype(jnp.float32))
