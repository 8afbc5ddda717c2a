"""Plain-jnp references of the gated delta rule (ragged prefill with snapshots, decode) and the
shape checks both kernel families share.

Per sequence, starting from ``S = ssm_pool[read_slot]`` (``[Hv, Dk, Dv]`` float32), each token:
``S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q`` with q, k L2-normalised (q also scaled
by ``Dk ** -0.5``). See ``docs/kernels.md`` for the chunked (WY / UT-transform) form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import (
    check,
    check_chunk_size,
    dot_precision,
    drop_slot,
    l2norm,
    state_targets,
    token_seq_ids,
)


def prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int, *,
               fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """L2-normalise ``q, k [T, Hk, Dk]`` (q times ``Dk**-0.5``); expand to ``[T, Hv, Dk]`` f32.
    ``fixed_order``: the norms' sums in a fixed tree (``model.deterministic``)."""
    group = num_v_heads // q.shape[1]
    qn = l2norm(q, fixed_order=fixed_order) * (q.shape[-1] ** -0.5)
    kn = l2norm(k, fixed_order=fixed_order)
    return jnp.repeat(qn, group, axis=1), jnp.repeat(kn, group, axis=1)


def delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
               beta: jax.Array, precision=None) -> tuple[jax.Array, jax.Array]:
    """One token for all heads. state ``[..., H, Dk, Dv]``; q, k ``[..., H, Dk]``; v ``[..., H,
    Dv]``; beta ``[..., H]``; g ``[..., H]`` (one decay per head) or ``[..., H, Dk]`` (per key
    channel: KDA); all float32; ``precision`` of the two contractions (``dot_precision`` of the
    inputs' dtype). Returns ``(new state, o [..., H, Dv])``."""
    decay = jnp.exp(g)
    state = (decay[..., None] if g.ndim == k.ndim else decay[..., None, None]) * state
    kv = jnp.einsum("...kv,...k->...v", state, k, precision=precision)
    u = beta[..., None] * (v - kv)
    state = state + k[..., :, None] * u[..., None, :]
    return state, jnp.einsum("...kv,...k->...v", state, q, precision=precision)


def gated_delta_rule_extend_reference(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot,
                                      write_slot, snap_seq, snap_offset, snap_slot, *,
                                      fixed_order: bool = False):
    """Plain-jnp token scan. Shapes as ``ops.gated_delta_rule_extend``; returns ``(o, pool)``.

    One ``lax.scan`` over the packed tokens carries the running state, reloaded from the pool at
    every sequence start. Each written state (final or snapshot) is captured at its last token.
    """
    num_tokens, num_heads, dv = v.shape
    num_slots = ssm_pool.shape[0]
    qe, ke = prepare_qk(q, k, num_heads, fixed_order=fixed_order)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    is_start = jnp.arange(num_tokens) == cu_seqlens[seq]
    init = ssm_pool[read_slot]                                        # [B, Hv, Dk, Dv]
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    num_targets = t_seq.shape[0]
    tok = jnp.where(t_off > 0, cu_seqlens[t_seq] + t_off - 1, -1)   # token after which to take
    same = (tok[:, None] == tok[None, :]) & (tok[:, None] >= 0)
    canon = jnp.argmax(same, axis=1)                                 # first target at that token
    owner = jnp.where((canon == jnp.arange(num_targets)) & (tok >= 0), tok, num_tokens)
    capture = jnp.full((num_tokens,), num_targets, jnp.int32).at[owner].set(
        jnp.arange(num_targets, dtype=jnp.int32), mode="drop")

    def body(carry, xs):
        state, buf = carry
        qt, kt, vt, gt, bt, start, b, cap = xs
        state = jnp.where(start, init[b], state)
        state, o = delta_step(state, qt, kt, vt, gt, bt, dot_precision(v.dtype))
        buf = jax.lax.dynamic_update_index_in_dim(buf, state, cap, 0)
        return (state, buf), o

    buf0 = jnp.zeros((num_targets + 1,) + ssm_pool.shape[1:], jnp.float32)
    xs = (qe, ke, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32),
          is_start, seq, capture)
    (_, buf), o = jax.lax.scan(body, (init[0] * 0.0, buf0), xs)
    states = jnp.where((t_off > 0)[:, None, None, None], buf[canon], init[t_seq])
    pool = ssm_pool.at[drop_slot(t_slot, num_slots)].set(states, mode="drop")
    o = jnp.where(valid[:, None, None], o, 0.0).astype(v.dtype)
    return o, pool


def gated_delta_rule_decode_reference(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *,
                                      fixed_order: bool = False):
    """One token per sequence. q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``.

    Returns ``(o [B, Hv, Dv] in v.dtype, ssm_pool)``; writes to slot 0 are dropped.
    """
    qe, ke = prepare_qk(q, k, v.shape[1], fixed_order=fixed_order)
    state = ssm_pool[read_slot]
    state, o = delta_step(state, qe, ke, v.astype(jnp.float32), g.astype(jnp.float32),
                          beta.astype(jnp.float32), dot_precision(v.dtype))
    pool = ssm_pool.at[drop_slot(write_slot, ssm_pool.shape[0])].set(state, mode="drop")
    return o.astype(v.dtype), pool


def check_gdr(q, k, v, g, beta, ssm_pool, chunk_size: int) -> None:
    """``ValueError`` unless the extend inputs agree (shapes in ``ops.gated_delta_rule_extend``)
    and ``chunk_size`` is legal."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    check(k.shape == q.shape, f"k shape {k.shape} must equal q shape {q.shape}")
    check(v.shape[0] == t and hv % hk == 0,
          f"v shape {v.shape}: tokens must be {t} and heads a multiple of {hk}")
    check(g.shape == (t, hv) and beta.shape == (t, hv),
          f"g {g.shape} / beta {beta.shape} must be {(t, hv)}")
    check(ssm_pool.shape[1:] == (hv, dk, dv) and ssm_pool.dtype == jnp.float32,
          f"ssm_pool {ssm_pool.shape} {ssm_pool.dtype} must be [N, {hv}, {dk}, {dv}] float32")
    check_chunk_size(chunk_size)


def check_gdr_decode(q, k, v, g, beta, ssm_pool) -> tuple[int, int]:
    """``ValueError`` unless the decode inputs agree (shapes in ``gated_delta_rule_decode``);
    returns ``(Hk, Dk)``."""
    num_seqs, num_heads, dv = v.shape
    hk, dk = q.shape[1:]
    check(k.shape == q.shape and q.shape[0] == num_seqs and num_heads % hk == 0,
          f"q {q.shape} / k {k.shape} must be [{num_seqs}, Hk, Dk] with {num_heads} % Hk == 0")
    check(g.shape == (num_seqs, num_heads) and beta.shape == (num_seqs, num_heads),
          f"g {g.shape} / beta {beta.shape} must be {(num_seqs, num_heads)}")
    check(ssm_pool.shape[1:] == (num_heads, dk, dv) and ssm_pool.dtype == jnp.float32,
          f"ssm_pool {ssm_pool.shape} {ssm_pool.dtype} must be [N, {num_heads}, {dk}, {dv}] f32")
    return hk, dk
