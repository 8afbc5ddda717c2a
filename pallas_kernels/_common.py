"""Shared helpers of the kernels and their references: ragged-batch bookkeeping, norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in float32 (transformers' ``l2norm``)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


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


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond`` (static shape checks of the public wrappers)."""
    if not cond:
        raise ValueError(msg)
