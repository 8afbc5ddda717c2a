"""The in-kernel math of one KDA chunk, shared by the TPU and GPU kernel bodies.

Values, not refs: both families load a chunk (``BT`` tokens of one head, zero rows past the
sequence end) and call these. The form is ``reference/kda.py``'s docstring's; only 2-D ops,
masks instead of value slices (Triton cannot slice a value), ``fori_loop`` over columns.

The decays are per key channel, so ``sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])`` is no single
matmul. ``decayed_gram`` splits the pairs ``j < i`` by sub-chunks of ``SUB`` rows:
  * ``j`` in an earlier sub-chunk than ``i``: with ``r`` the first row of ``i``'s sub-chunk,
    ``exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j)`` and both factors are <= 1 (``G`` only
    falls), so ``(a * exp(G - G_r)) (b * exp(G_r - G))^T`` is one matmul per sub-chunk with
    nothing that can overflow (factoring at the chunk start instead, ``exp(-G_j)`` is inf once
    the decay inside a chunk passes ``e^-88``);
  * ``j`` in ``i``'s own sub-chunk: column by column, elementwise, each ``exp`` of a difference
    ``<= 0`` taken after masking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
SUB = 16  # rows per sub-chunk (a multiple of 8 and Triton's smallest dot)


def dot(a, b, *, trans_a=False, trans_b=False, precision=None):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                               preferred_element_type=_F32)


def _row(x, i):
    """Row ``i`` of ``x [R, C]`` as ``[1, C]`` (a masked sum: no dynamic value slice)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0, keepdims=True)


def decayed_gram(a, b, gcum, *, inclusive: bool, precision=None):
    """``M[i, j] = sum_c a[i, c] b[j, c] exp(G[i, c] - G[j, c])`` for ``j < i`` (``j <= i`` if
    ``inclusive``), 0 above. a, b, gcum ``[BT, Dk]`` f32 (BT a multiple of SUB). Returns
    ``[BT, BT]`` f32."""
    bt = a.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    rcol = jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    out = jnp.zeros((bt, bt), _F32)
    for s in range(1, bt // SUB):  # earlier sub-chunks, reference row r = s * SUB
        g_r = _row(gcum, s * SUB)
        mine = (rcol >= s * SUB) & (rcol < (s + 1) * SUB)
        left = jnp.where(mine, a * jnp.exp(jnp.where(mine, gcum - g_r, 0.0)), 0.0)
        before = rcol < s * SUB
        right = jnp.where(before, b * jnp.exp(jnp.where(before, g_r - gcum, 0.0)), 0.0)
        out = out + dot(left, right, trans_b=True, precision=precision)
    same = jax.lax.div(rows, SUB) == jax.lax.div(cols, SUB)
    keep = same & ((rows >= cols) if inclusive else (rows > cols))

    def column(j, acc):
        b_j, g_j = _row(b, j), _row(gcum, j)
        below = rcol >= j
        col = jnp.sum(a * b_j * jnp.exp(jnp.where(below, gcum - g_j, 0.0)), axis=1,
                      keepdims=True)                                     # [BT, 1]
        return jnp.where((cols == j) & keep, col, acc)

    return jax.lax.fori_loop(0, bt, column, out)


def chunk_output(q, k, v, gcum, beta, s0, inverse, precision=None):
    """One chunk: q, k L2-normalised (q scaled) ``[BT, Dk]``, v ``[BT, Dv]``, gcum ``[BT, Dk]``,
    beta ``[BT, 1]``, s0 ``[Dk, Dv]`` (state at the chunk start), all f32; ``inverse`` maps a
    strictly lower ``L`` to ``(I + L)^-1``. Returns ``(o [BT, Dv], u [BT, Dv])``, u the
    corrected values ``V'`` the state update uses."""
    lower = beta * decayed_gram(k, k, gcum, inclusive=False, precision=precision)
    eg = jnp.exp(gcum)
    u = dot(inverse(lower), beta * (v - dot(k * eg, s0, precision=precision)),
            precision=precision)
    attn = decayed_gram(q, k, gcum, inclusive=True, precision=precision)
    o = dot(q * eg, s0, precision=precision) + dot(attn, u, precision=precision)
    return o, u


def state_after(r, k, gcum, u, s0, precision=None):
    """State after the first ``r`` rows (0..BT) of the chunk: ``diag(exp(G_r)) s0 + (k *
    exp(G_r - G))^T u`` over rows ``< r`` (``G_0 = 0``). Returns ``[Dk, Dv]`` f32."""
    bt, dk = k.shape
    rcol = jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    g_r = _row(gcum, r - 1)                        # [1, Dk]; all 0 when r == 0
    w = jnp.where(rcol < r, jnp.exp(jnp.where(rcol < r, g_r - gcum, 0.0)), 0.0)
    eye = (jax.lax.broadcasted_iota(jnp.int32, (dk, dk), 0)
           == jax.lax.broadcasted_iota(jnp.int32, (dk, dk), 1))
    scale = jnp.where(eye, jnp.exp(g_r), 0.0)       # diag(exp(G_r)) without a transpose
    return dot(scale, s0, precision=precision) + dot(k * w, u, trans_a=True,
                                                     precision=precision)
