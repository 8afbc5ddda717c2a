"""Plain-jnp references of the Mamba2 SSD scan (ragged prefill with snapshots, decode) and the
shape checks both kernel families share.

Per sequence, starting from ``h = ssm_pool[read_slot]`` (``[H, N, P]`` float32: the transpose of
transformers' ``[H, P, N]``, so that a Mamba2 pool row has the Gated DeltaNet layout ``[heads,
key dim, value dim]`` with B as the key and x as the value), each token ``t``, per head::

    h = exp(dt_t * A) h + dt_t * B_t x_t^T        (B_t [N] of the head's group, x_t [P])
    y_t = h^T C_t + D * x_t

with ``dt`` already ``softplus(dt_raw + dt_bias)`` clamped to ``time_step_limit`` (the model does
that), ``A = -exp(A_log)``. Heads ``g*r .. g*r + r - 1`` (``r = H / G``) share group ``g``'s B
and C (transformers' ``repeat_interleave``). Written states: the final state of each sequence
to ``write_slot``, the state after ``snap_offset`` tokens of sequence ``snap_seq`` to
``snap_slot`` (any offset, per request); slot 0 writes are dropped; an offset of 0 writes the
initial state. The chunked (matmul) form the kernels use is in ``docs/kernels.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check, dot_precision, drop_slot, state_targets, token_seq_ids

F32 = jnp.float32


def expand_groups(b: jax.Array, num_heads: int) -> jax.Array:
    """``[..., G, N]`` -> ``[..., H, N]`` float32: head ``h`` takes group ``h // (H / G)``."""
    return jnp.repeat(b.astype(F32), num_heads // b.shape[-2], axis=-2)


def ssd_step(state: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array,
             c: jax.Array, d: jax.Array, precision=None) -> tuple[jax.Array, jax.Array]:
    """One token for all heads, float32. state ``[..., H, N, P]``; x ``[..., H, P]``; dt
    ``[..., H]``; a, d ``[H]``; b, c ``[..., H, N]`` (expanded). Returns ``(state, y [..., H,
    P])``."""
    state = jnp.exp(dt * a)[..., None, None] * state
    state = state + (dt[..., None] * b)[..., :, None] * x[..., None, :]
    y = jnp.einsum("...np,...n->...p", state, c, precision=precision) + d[:, None] * x
    return state, y


def capture_table(cu_seqlens, write_slot, snap_seq, snap_offset, snap_slot, num_tokens: int):
    """Which token's state each written state is. Returns ``(t_seq, t_off, t_slot [J],
    canon [J], capture [T])``: target ``j`` is the state after packed token ``tok_j`` (or the
    initial state when ``t_off == 0``); ``canon[j]`` is the first target at the same token,
    ``capture[t]`` the target whose buffer row token ``t`` fills (``J`` = none)."""
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    num_targets = t_seq.shape[0]
    tok = jnp.where(t_off > 0, cu_seqlens[t_seq] + t_off - 1, -1)
    same = (tok[:, None] == tok[None, :]) & (tok[:, None] >= 0)
    canon = jnp.argmax(same, axis=1)
    owner = jnp.where((canon == jnp.arange(num_targets)) & (tok >= 0), tok, num_tokens)
    capture = jnp.full((num_tokens,), num_targets, jnp.int32).at[owner].set(
        jnp.arange(num_targets, dtype=jnp.int32), mode="drop")
    return t_seq, t_off, t_slot, canon, capture


def ssd_extend_reference(x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot):
    """Token scan. Shapes as ``ops.ssd_extend``; returns ``(y [T, H, P] in x.dtype, pool)``.

    One ``lax.scan`` over the packed tokens carries the running state, reloaded from the pool
    at every sequence start; each written state is captured at its last token.
    """
    check_ssd(x, dt, a, b, c, d, ssm_pool)
    num_tokens, num_heads, _ = x.shape
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    is_start = jnp.arange(num_tokens) == cu_seqlens[seq]
    init = ssm_pool[read_slot]                                          # [B, H, N, P]
    t_seq, t_off, t_slot, canon, capture = capture_table(
        cu_seqlens, write_slot, snap_seq, snap_offset, snap_slot, num_tokens)
    a32, d32 = a.astype(F32), d.astype(F32)

    def body(carry, xs):
        state, buf = carry
        xt, dtt, bt, ct, start, s, cap = xs
        state = jnp.where(start, init[s], state)
        state, y = ssd_step(state, xt, dtt, a32, bt, ct, d32, dot_precision(x.dtype))
        buf = jax.lax.dynamic_update_index_in_dim(buf, state, cap, 0)
        return (state, buf), y

    buf0 = jnp.zeros((t_seq.shape[0] + 1,) + ssm_pool.shape[1:], F32)
    xs = (x.astype(F32), dt.astype(F32), expand_groups(b, num_heads),
          expand_groups(c, num_heads), is_start, seq, capture)
    (_, buf), y = jax.lax.scan(body, (init[0] * 0.0, buf0), xs)
    states = jnp.where((t_off > 0)[:, None, None, None], buf[canon], init[t_seq])
    pool = ssm_pool.at[drop_slot(t_slot, ssm_pool.shape[0])].set(states, mode="drop")
    y = jnp.where(valid[:, None, None], y, 0.0).astype(x.dtype)
    return y, pool


def ssd_decode_reference(x, dt, a, b, c, d, ssm_pool, read_slot, write_slot):
    """One token per sequence: x ``[B, H, P]``, dt ``[B, H]``, b, c ``[B, G, N]``.

    Returns ``(y [B, H, P] in x.dtype, ssm_pool)``; writes to slot 0 are dropped.
    """
    check_ssd(x, dt, a, b, c, d, ssm_pool)
    num_heads = x.shape[1]
    state, y = ssd_step(ssm_pool[read_slot], x.astype(F32), dt.astype(F32), a.astype(F32),
                        expand_groups(b, num_heads), expand_groups(c, num_heads),
                        d.astype(F32), dot_precision(x.dtype))
    pool = ssm_pool.at[drop_slot(write_slot, ssm_pool.shape[0])].set(state, mode="drop")
    return y.astype(x.dtype), pool


def check_ssd(x, dt, a, b, c, d, ssm_pool) -> tuple[int, int, int, int]:
    """``ValueError`` unless the inputs agree (shapes in ``ops.ssd_extend``); returns
    ``(H, P, G, N)``."""
    t, h, p = x.shape
    check(b.ndim == 3 and b.shape[0] == t, f"B shape {b.shape} must be [{t}, G, N]")
    g, n = b.shape[1:]
    check(c.shape == b.shape, f"C shape {c.shape} must equal B shape {b.shape}")
    check(h % g == 0, f"heads ({h}) must be a multiple of groups ({g})")
    check(dt.shape == (t, h), f"dt shape {dt.shape} must be {(t, h)}")
    check(a.shape == (h,) and d.shape == (h,), f"A {a.shape} / D {d.shape} must be ({h},)")
    check(ssm_pool.ndim == 4 and ssm_pool.shape[1:] == (h, n, p) and ssm_pool.dtype == F32,
          f"ssm_pool {ssm_pool.shape} {ssm_pool.dtype} must be [S, {h}, {n}, {p}] float32")
    return h, p, g, n
