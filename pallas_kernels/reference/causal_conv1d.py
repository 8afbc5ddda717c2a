"""Plain-jnp references of the depthwise causal conv1d + SiLU over ragged packed sequences
(windows in a slot pool) and the shape check both kernel families share.

``conv_pool[slot]`` is ``[K-1, C]``: the last K-1 inputs of a sequence, oldest first. Token t of a
sequence sees inputs ``t-K+1 .. t``; indices below 0 come from the initial window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check, drop_slot, state_targets, token_seq_ids


def _gather_inputs(x, init, cu_seqlens, seq, local):
    """Inputs at local indices ``local [..., W]`` of sequences ``seq [...]`` (< 0: window).

    x ``[T, C]``; init ``[B, K-1, C]``. Returns ``[..., W, C]`` in x.dtype.
    """
    width = init.shape[1]
    packed = jnp.clip(cu_seqlens[seq][..., None] + local, 0, x.shape[0] - 1)
    from_x = x[packed]
    from_w = init[seq[..., None], jnp.clip(local + width, 0, width - 1)].astype(x.dtype)
    return jnp.where((local >= 0)[..., None], from_x, from_w)


def _silu_conv(cols, weight, bias):
    """cols ``[..., K, C]`` inputs oldest first; weight ``[K, C]``. Returns f32 ``[..., C]``."""
    acc = jnp.sum(cols.astype(jnp.float32) * weight.astype(jnp.float32), axis=-2)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc * jax.nn.sigmoid(acc)


def causal_conv1d_extend_reference(x, weight, bias, conv_pool, cu_seqlens, read_slot,
                                   write_slot, snap_seq, snap_offset, snap_slot):
    """Plain-jnp gather form. Shapes as ``ops.causal_conv1d_extend``; returns ``(y, pool)``."""
    num_tokens = x.shape[0]
    kernel = weight.shape[0]
    init = conv_pool[read_slot]                                    # [B, K-1, C]
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    local_t = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[seq]
    taps = jnp.arange(kernel, dtype=jnp.int32) - (kernel - 1)
    cols = _gather_inputs(x, init, cu_seqlens, seq, local_t[:, None] + taps)
    y = jnp.where(valid[:, None], _silu_conv(cols, weight, bias), 0.0).astype(x.dtype)
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    win = _gather_inputs(x, init, cu_seqlens, t_seq, t_off[:, None] + taps[:-1])
    pool = conv_pool.at[drop_slot(t_slot, conv_pool.shape[0])].set(
        win.astype(conv_pool.dtype), mode="drop")
    return y, pool


def causal_conv1d_decode_reference(x, weight, bias, conv_pool, read_slot, write_slot):
    """One token per sequence: x ``[B, C]``. Returns ``(y [B, C] in x.dtype, conv_pool)``."""
    window = conv_pool[read_slot].astype(x.dtype)                  # [B, K-1, C]
    cols = jnp.concatenate([window, x[:, None, :]], axis=1)        # [B, K, C]
    y = _silu_conv(cols, weight, bias).astype(x.dtype)
    pool = conv_pool.at[drop_slot(write_slot, conv_pool.shape[0])].set(
        cols[:, 1:].astype(conv_pool.dtype), mode="drop")
    return y, pool


def check_conv(x, weight, bias, conv_pool) -> None:
    """``ValueError`` unless x ``[..., C]``, weight ``[K, C]``, bias and the pool agree."""
    channels = x.shape[-1]
    kernel = weight.shape[0]
    check(weight.shape == (kernel, channels) and kernel >= 2,
          f"weight shape {weight.shape} must be [K >= 2, {channels}]")
    check(bias is None or bias.shape == (channels,), f"bias shape must be ({channels},)")
    check(conv_pool.shape[1:] == (kernel - 1, channels),
          f"conv_pool shape {conv_pool.shape} must be [N, {kernel - 1}, {channels}]")
    check(conv_pool.dtype == x.dtype,
          f"conv_pool dtype {conv_pool.dtype} must equal x dtype {x.dtype}")
