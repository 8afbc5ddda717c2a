"""Pallas Triton (GPU) grouped matmul: the routed experts of a top-k MoE, work ``~ T * k``.

Same contract as ``reference.grouped_matmul.grouped_moe_reference``. Layout (``moe_align``):
the ``P = T * k`` (token, expert) pairs sorted by expert, each expert's run padded to ``BM``
rows, a block -> expert table (``-1``: unused block). Two kernels, both over the grid
``(NB row blocks, column tiles)``, all parallel:

* up: ``h = act(x[rows] @ w_in[e])`` ``[NB * BM, I]`` in x.dtype. The block's rows are gathered
  from x by pair id inside the kernel (``x[pair // k]``: no ``[P, H]`` copy); SwiGLU keeps two
  fp32 accumulators (the gate and up column tiles of the same expert) and fuses ``silu(g) * u``
  into the store; relu2 one accumulator.
* down: ``y[pair] = w[pair] * (h[rows] @ w_out[e])`` ``[P, H]`` in x.dtype, the routing weight
  applied in the epilogue and each row stored at its own pair id (rows are unique: no atomics).

The ``k`` pairs of a token are summed outside in fp32 (``sum_pairs``). Blocks of expert ``-1``
return at once, so a step reads each touched expert's weights once per row block (decode: once)
and never touches the others. fp32 operands multiply exactly (``Precision.HIGHEST``: no TF32),
bf16 ones on the tensor cores with fp32 accumulation. Any H, I (masked tiles).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import check
from pallas_kernels.moe_align import moe_align
from pallas_kernels.reference.grouped_matmul import check_grouped, local_pairs, sum_pairs

_F32 = jnp.float32
_EXACT = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class GmmBlocks:
    """Tile sizes: ``block_m`` rows per block (one expert), ``block_n`` output columns per
    program, ``block_k`` reduction columns per step; Triton's warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# decode (few pairs per expert): 16-row blocks (the MMA's M), wide K steps over the weights;
# prefill: 64-row blocks (warpgroup MMA). docs/kernels.md has the sm_90 compile numbers.
DECODE = GmmBlocks(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL = GmmBlocks()
F32_BLOCKS = GmmBlocks(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)


def default_blocks(num_pairs: int, num_experts: int, dtype) -> GmmBlocks:
    """``DECODE`` when the pairs average fewer than 32 per expert, else ``PREFILL``; fp32
    (exact dots on the FMA units) ``F32_BLOCKS``. Any blocks are correct."""
    if jnp.dtype(dtype) == _F32:
        return F32_BLOCKS
    return DECODE if num_pairs < 32 * num_experts else PREFILL


def _idx(rows, cols):
    """``rows [n]``, ``cols [w]`` int32 -> both broadcast to ``[n, w]``."""
    shape = (rows.shape[0], cols.shape[0])
    return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


def _span(start, width: int, limit: int):
    """Indices ``start + [0, width)`` and their mask, clamped into ``[0, limit)``; when the
    tiles divide ``limit`` (``start`` is then a multiple of ``width``) plain indices and no
    mask, so that Triton sees contiguous columns (vector loads, ``cp.async`` pipelining)."""
    i = start + jnp.arange(width, dtype=jnp.int32)
    if limit % width == 0:
        return i, None
    return jnp.minimum(i, limit - 1), i < limit


def _mask(rows_ok, cols_ok, shape):
    """``rows_ok [n] & cols_ok [w]`` broadcast to ``shape`` (either may be None: all true);
    None when both are."""
    if rows_ok is None and cols_ok is None:
        return None
    if rows_ok is None:
        return jnp.broadcast_to(cols_ok[None, :], shape)
    if cols_ok is None:
        return jnp.broadcast_to(rows_ok[:, None], shape)
    return rows_ok[:, None] & cols_ok[None, :]


def _dot(a, b, exact: bool):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32,
                               precision=_EXACT if exact else None)


def _weight_tile(w_ref, e, k0, c0, c_off: int, blocks: GmmBlocks, width: int):
    """``w[e, k0:k0+BK, c_off + c0:c_off + c0+BN]`` (columns ``c0 + j`` below ``width``), 0
    outside."""
    rows, rok = _span(k0, blocks.block_k, w_ref.shape[1])
    cols, cok = _span(c0, blocks.block_n, width)
    r, c = _idx(rows, cols + c_off)
    mask = _mask(rok, cok, r.shape)
    return pltr.load(w_ref.at[jnp.full_like(r, e), r, c], mask=mask,
                     other=None if mask is None else 0)


def _gmm_up_kernel(expert_ref,  # [NB] i32 local expert of each row block (-1: unused)
                   pair_ref,    # [NB * BM] i32 pair id of each row (P: padding)
                   x_ref,       # [T, H] tokens
                   w_ref,       # [E, H, N_in] gate | up (swiglu) or up (relu2)
                   h_ref,       # [NB * BM, I_pad] out: act(x[rows] @ w_in[e]) in x.dtype
                   *, top_k: int, inter: int, activation: str, blocks: GmmBlocks):
    b, n = pl.program_id(0), pl.program_id(1)
    e = expert_ref[b]
    bm, bn = blocks.block_m, blocks.block_n
    exact = x_ref.dtype == _F32

    @pl.when(e >= 0)
    def _block():
        rows = b * bm + jnp.arange(bm, dtype=jnp.int32)
        pair = pltr.load(pair_ref.at[rows])
        valid = pair < x_ref.shape[0] * top_k
        tok = jnp.where(valid, pair // top_k, 0)
        hidden = x_ref.shape[1]

        def step(kb, accs):
            k0 = kb * blocks.block_k
            cols, kok = _span(k0, blocks.block_k, hidden)
            r, c = _idx(tok, cols)
            xt = pltr.load(x_ref.at[r, c], mask=_mask(valid, kok, r.shape), other=0)
            new = [_dot(xt, _weight_tile(w_ref, e, k0, n * bn, 0, blocks, inter), exact)]
            if activation == "swiglu":   # the up columns: the same tile, I further
                new.append(_dot(xt, _weight_tile(w_ref, e, k0, n * bn, inter, blocks, inter),
                                exact))
            return tuple(a + d for a, d in zip(accs, new, strict=True))

        num = 2 if activation == "swiglu" else 1
        init = tuple(jnp.zeros((bm, bn), _F32) for _ in range(num))
        accs = jax.lax.fori_loop(0, pl.cdiv(hidden, blocks.block_k), step, init)
        if activation == "swiglu":   # rounded to x.dtype first, as the reference's product
            g, u = (a.astype(h_ref.dtype).astype(_F32) for a in accs)
            out = g * jax.nn.sigmoid(g) * u
        else:
            out = jnp.square(jnp.maximum(accs[0].astype(h_ref.dtype).astype(_F32), 0.0))
        # columns past I: act(0) = 0 into h's padding columns (unique indices, no mask)
        r, c = _idx(rows, n * bn + jnp.arange(bn, dtype=jnp.int32))
        pltr.store(h_ref.at[r, c], out.astype(h_ref.dtype))


def _gmm_down_kernel(expert_ref,  # [NB] i32 local expert of each row block (-1: unused)
                     pair_ref,    # [NB * BM] i32 pair id of each row (P: padding)
                     wgt_ref,     # [P] f32 routing weight of each pair
                     h_ref,       # [NB * BM, I_pad] activations (rows as pair_ref)
                     w_ref,       # [E, I, H] down projection
                     y_ref,       # [P + BM, H_pad] out: wgt * h @ w_out[e] at row ``pair``
                     *, blocks: GmmBlocks):
    b, n = pl.program_id(0), pl.program_id(1)
    e = expert_ref[b]
    bm, bn = blocks.block_m, blocks.block_n
    exact = h_ref.dtype == _F32

    @pl.when(e >= 0)
    def _block():
        rows = b * bm + jnp.arange(bm, dtype=jnp.int32)
        pair = pltr.load(pair_ref.at[rows])
        num_pairs, hidden = y_ref.shape[0] - bm, w_ref.shape[2]
        valid = pair < num_pairs
        inter = w_ref.shape[1]

        def step(kb, acc):
            k0 = kb * blocks.block_k
            cols, kok = _span(k0, blocks.block_k, inter)
            r, c = _idx(rows, cols)
            mask = _mask(None, kok, r.shape)
            ht = pltr.load(h_ref.at[r, c], mask=mask, other=None if mask is None else 0)
            return acc + _dot(ht, _weight_tile(w_ref, e, k0, n * bn, 0, blocks, hidden), exact)

        acc = jax.lax.fori_loop(0, pl.cdiv(inter, blocks.block_k), step,
                                jnp.zeros((bm, bn), _F32))
        wgt = pltr.load(wgt_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0.0)
        # padding rows go to the spare rows P + [0, BM), columns past H to y's padding: every
        # index of the store is distinct (the interpreter's scatter needs it; a GPU masks)
        dest = jnp.where(valid, pair, num_pairs + jnp.arange(bm, dtype=jnp.int32))
        r, c = _idx(dest, n * bn + jnp.arange(bn, dtype=jnp.int32))
        pltr.store(y_ref.at[r, c], (acc * wgt[:, None]).astype(y_ref.dtype))


def _call(kernel, grid, out_shape, blocks: GmmBlocks, interpret: bool, *args):
    return pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
    )(*args)


@functools.partial(jax.jit, static_argnames=("activation", "blocks", "interpret"))
def grouped_moe(x, top_vals, top_idx, w_in, w_out, expert_offset=0, *,
                activation: str = "swiglu", blocks: GmmBlocks | None = None,
                interpret: bool = False):
    """Pallas-Triton routed experts; same contract as ``grouped_moe_reference``.

    x ``[T, H]``; top_vals / top_idx ``[T, k]`` (global expert ids); w_in ``[E, H, N_in]``,
    w_out ``[E, I, H]`` (the local experts ``expert_offset + [0, E)``). Returns ``[T, H]``
    float32. ``blocks`` defaults to ``default_blocks(T * k, E, x.dtype)``.
    """
    num_experts, inter = check_grouped(x, top_vals, top_idx, w_in, w_out, activation)
    num_tokens, top_k = top_idx.shape
    num_pairs, hidden = num_tokens * top_k, x.shape[1]
    blocks = blocks or default_blocks(num_pairs, num_experts, x.dtype)
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(blocks, name)
        check(size >= 16 and size & (size - 1) == 0, f"{name} {size} must be a power of two "
              ">= 16 (Triton dot tiles)")
    if num_pairs == 0:
        return jnp.zeros((num_tokens, hidden), _F32)
    w_in, w_out = w_in.astype(x.dtype), w_out.astype(x.dtype)
    block_expert, sorted_pair = moe_align(top_idx, num_experts, blocks.block_m, expert_offset)
    nb = block_expert.shape[0]
    up = functools.partial(_gmm_up_kernel, top_k=top_k, inter=inter, activation=activation,
                           blocks=blocks)
    n_up, n_down = pl.cdiv(inter, blocks.block_n), pl.cdiv(hidden, blocks.block_n)
    h = _call(up, (nb, n_up),
              jax.ShapeDtypeStruct((nb * blocks.block_m, n_up * blocks.block_n), x.dtype),
              blocks, interpret, block_expert, sorted_pair, x, w_in)
    wgt = top_vals.reshape(-1).astype(_F32)
    down = functools.partial(_gmm_down_kernel, blocks=blocks)
    y = _call(down, (nb, n_down),
              jax.ShapeDtypeStruct((num_pairs + blocks.block_m, n_down * blocks.block_n),
                                   x.dtype), blocks, interpret,
              block_expert, sorted_pair, wgt, h, w_out)[:num_pairs, :hidden]
    _, ok = local_pairs(top_idx, num_experts, expert_offset)
    return sum_pairs(y, ok, num_tokens)
