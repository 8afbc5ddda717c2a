"""TPU (Mosaic) grouped matmul: the routed experts of a top-k MoE on jax's megablox ``gmm``.

Same contract as ``reference.grouped_matmul.grouped_moe_reference``. Megablox wants the rows
of each group contiguous but not padded (its grid visits ``M / tm + E - 1`` row tiles at most,
masking the rows of a tile that belong to the neighbouring group, and skips empty groups), so
the layout is the plain sort: the ``P = T * k`` pairs stably sorted by local expert (pairs of
other devices' experts last, outside every group), rows gathered from x by XLA, padded to a
multiple of ``tm``. Two ``gmm`` calls (``w_in`` then ``w_out``) with the activation between
them in x.dtype; the routing weight, the unsort and the per-token fp32 sum outside. Work
``~ T * k``: a tile of weights is read for each row tile of its group.

Tiles: ``tm`` rows, the power of two nearest above the mean rows per expert ``P / E`` within
``[16, 128]`` (``row_tile``); ``tk`` / ``tn`` the largest of 512, 256, 128 dividing the
dimension, else the whole dimension (Mosaic's block rule). Megablox visits up to ``P / tm + E -
1`` row tiles and multiplies each whole (rows of the neighbouring group masked), so its MXU work
is up to ``(P / tm + E - 1) tm`` rows, not ``P``: at decode (2 rows per expert) a 128-row tile
would be 64 times the active FLOPs; 16-row tiles keep it near 8, with about the same number of
grid steps (``E - 1`` of them come from the groups). Its ``CostEstimate`` (what XLA's
``cost_analysis`` reports) is ``2 m k n`` over the sorted rows: the active FLOPs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from pallas_kernels.reference.grouped_matmul import activate, check_grouped, local_pairs, sum_pairs

_F32 = jnp.float32


def _tile(dim: int) -> int:
    return next((t for t in (512, 256, 128) if dim % t == 0), dim)


def row_tile(num_pairs: int, num_experts: int) -> int:
    """``tm``: the mean rows per expert rounded up to a power of two, within ``[16, 128]``."""
    mean = max(1, -(-num_pairs // num_experts))
    return min(128, max(16, 1 << (mean - 1).bit_length()))


def tiling(tm: int, k: int, n: int) -> tuple[int, int, int]:
    """``(tm, tk, tn)`` for ``gmm`` over a ``[*, k] @ [k, n]`` product."""
    return tm, _tile(k), _tile(n)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def grouped_moe(x, top_vals, top_idx, w_in, w_out, expert_offset=0, *,
                activation: str = "swiglu", interpret: bool = False):
    """Megablox routed experts; same contract as ``grouped_moe_reference``.

    x ``[T, H]``; top_vals / top_idx ``[T, k]`` (global expert ids); w_in ``[E, H, N_in]``,
    w_out ``[E, I, H]`` (the local experts ``expert_offset + [0, E)``). Returns ``[T, H]``
    float32.
    """
    num_experts, _ = check_grouped(x, top_vals, top_idx, w_in, w_out, activation)
    num_tokens, top_k = top_idx.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return jnp.zeros(x.shape, _F32)
    e, ok = local_pairs(top_idx, num_experts, expert_offset)
    group = jnp.where(ok, e, num_experts)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.zeros(num_experts + 1, jnp.int32).at[group].add(1)[:num_experts]
    tm = row_tile(num_pairs, num_experts)
    rows_pad = -(-num_pairs // tm) * tm
    rows = jnp.take(x, order // top_k, axis=0)
    rows = jnp.pad(rows, ((0, rows_pad - num_pairs), (0, 0)))
    w_in, w_out = w_in.astype(x.dtype), w_out.astype(x.dtype)
    h = gmm(rows, w_in, sizes, x.dtype, tiling(tm, *w_in.shape[1:]), interpret=interpret)
    a = activate(h, activation)
    out = gmm(a, w_out, sizes, _F32, tiling(tm, *w_out.shape[1:]), interpret=interpret)
    weighted = (out[:num_pairs] * jnp.take(top_vals.reshape(-1).astype(_F32), order)[:, None])
    y = jnp.zeros((num_pairs, x.shape[1]), x.dtype).at[order].set(
        weighted.astype(x.dtype), unique_indices=True)
    return sum_pairs(y, ok, num_tokens)
