"""Plain-jnp references of Kimi Delta Attention (KDA): the gated delta rule with a decay per key
channel, over ragged packed sequences with snapshots (prefill) and one token per sequence
(decode); plus the chunked form (``kda_chunk_reference``) that the Pallas kernels follow.

Per sequence, from ``S = ssm_pool[read_slot]`` (``[H, Dk, Dv]`` float32), each token:
``S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q`` with ``g [H, Dk]`` (log decay,
<= 0), q and k L2-normalised (eps 1e-6), q scaled by ``Dk ** -0.5``. Same pools and slot
conventions as the gated delta rule (``reference/gated_delta_rule.py``, whose token scan serves
both: its ``delta_step`` takes a per-head or a per-channel decay); q, k and v have the same head
count here (Kimi Linear has no GQA in KDA).

Chunked form, per chunk of ``BT`` tokens with in-chunk cumulative log decays ``G_t = sum_{s<=t}
g_s`` (``[BT, Dk]``) and the state ``S0`` at the chunk start:
  ``A[i, j] = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])`` (j < i),
  ``T = (I + A)^-1``,  ``W = T (beta * k * exp(G))``,  ``U = T (beta * v)``,
  ``V' = U - W S0``,  ``o_i = (q_i * exp(G_i)) S0 + sum_{j<=i} (sum_c q_i[c] k_j[c]
  exp(G_i[c] - G_j[c])) V'_j``,  ``S_BT = diag(exp(G_last)) S0 + (k * exp(G_last - G))^T V'``.
The decays enter only as differences ``G_i - G_j`` with ``j <= i`` (<= 0, so ``exp`` <= 1) or as
``exp(G)`` / ``exp(G_last - G)`` (<= 1): nothing overflows however strong the decay, unlike the
factorised ``exp(G_i) exp(-G_j)``, which is inf for ``|G| > 88``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import check, dot_precision
from pallas_kernels.reference.gated_delta_rule import (
    gated_delta_rule_decode_reference,
    gated_delta_rule_extend_reference,
    prepare_qk,
)


def check_kda(q, k, v, g, beta, ssm_pool) -> None:
    """``ValueError`` unless q, k, g ``[T, H, Dk]``, v ``[T, H, Dv]``, beta ``[T, H]`` and
    ssm_pool ``[N, H, Dk, Dv]`` float32 agree."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    check(k.shape == q.shape and g.shape == q.shape,
          f"k {k.shape} / g {g.shape} must equal q's shape {q.shape}")
    check(v.shape[:2] == (t, h), f"v shape {v.shape} must be [{t}, {h}, Dv]")
    check(beta.shape == (t, h), f"beta shape {beta.shape} must be {(t, h)}")
    check(ssm_pool.shape[1:] == (h, dk, dv) and ssm_pool.dtype == jnp.float32,
          f"ssm_pool {ssm_pool.shape} {ssm_pool.dtype} must be [N, {h}, {dk}, {dv}] float32")


def kda_extend_reference(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, fixed_order: bool = False):
    """Token scan. q, k ``[T, H, Dk]`` raw; v ``[T, H, Dv]``; g ``[T, H, Dk]`` f32; beta
    ``[T, H]`` f32. Returns ``(o [T, H, Dv] in v.dtype, ssm_pool)`` with the finals and
    snapshots written (``ops.gated_delta_rule_extend``'s target rules)."""
    check_kda(q, k, v, g, beta, ssm_pool)
    return gated_delta_rule_extend_reference(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot,
                                             write_slot, snap_seq, snap_offset, snap_slot,
                                             fixed_order=fixed_order)


def kda_decode_reference(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *,
                         fixed_order: bool = False):
    """One token per sequence: shapes as the extend with ``T = B``. Returns ``(o, ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    return gated_delta_rule_decode_reference(q, k, v, g, beta, ssm_pool, read_slot, write_slot,
                                             fixed_order=fixed_order)


def kda_chunk_reference(q, k, v, g, beta, state, *, chunk_size: int = 16):
    """One sequence in chunks (the module docstring's form). q, k, g ``[T, H, Dk]``; v
    ``[T, H, Dv]``; beta ``[T, H]``; state ``[H, Dk, Dv]`` f32. Returns ``(o [T, H, Dv] f32,
    final state, chunk-start states [NC, H, Dk, Dv])``; T is zero-padded to whole chunks. Dots
    at ``dot_precision(q.dtype)`` (fp32: HIGHEST)."""
    t, h, dk = q.shape
    prec = dot_precision(q.dtype)
    mm = functools.partial(jnp.matmul, precision=prec)
    pad = -t % chunk_size
    qn, kn = prepare_qk(q, k, h)

    def chunks(x):  # [T, H, ...] -> [NC, H, BT, ...] float32
        x = jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(-1, chunk_size, *x.shape[1:]), 1, 2)

    qc, kc, vc, gc, bc = (chunks(x) for x in (qn, kn, v, g, beta))
    gcum = jnp.cumsum(gc, axis=2)                                    # [NC, H, BT, Dk]
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)

    def step(s0, xs):
        qi, ki, vi, gi, bi = xs                                      # [H, BT, ...]
        diff = gi[:, :, None, :] - gi[:, None, :, :]                 # [H, i, j, Dk]
        decay = jnp.exp(jnp.where(lower[..., None], diff, -jnp.inf))
        a = bi[..., None] * jnp.einsum("hic,hjc,hijc->hij", ki, ki, decay, precision=prec)
        tmat = jnp.linalg.inv(jnp.eye(chunk_size) + a)
        w = mm(tmat, bi[..., None] * ki * jnp.exp(gi))
        u = mm(tmat, bi[..., None] * vi)
        v_new = u - mm(w, s0)
        causal = jnp.exp(jnp.where((lower | jnp.eye(chunk_size, dtype=bool))[..., None], diff,
                                   -jnp.inf))
        attn = jnp.einsum("hic,hjc,hijc->hij", qi, ki, causal, precision=prec)
        o = mm(qi * jnp.exp(gi), s0) + mm(attn, v_new)
        last = gi[:, -1:, :]                                         # [H, 1, Dk]
        s1 = jnp.exp(last[:, 0, :, None]) * s0 + mm(jnp.swapaxes(ki * jnp.exp(last - gi), 1, 2),
                                                    v_new)
        return s1, (o, s0)

    final, (o, starts) = jax.lax.scan(step, state.astype(jnp.float32), (qc, kc, vc, gcum, bc))
    o = jnp.moveaxis(o, 2, 1).reshape(-1, h, v.shape[-1])[:t]
    return o, final, starts
