"""The row layout of the grouped matmul: (token, expert) pairs sorted by expert, padded to blocks.

A top-k MoE step routes ``P = T * k`` (token, expert) pairs; pair ``p`` is token ``p // k``'s
``p % k``-th choice. ``moe_align`` lays them out for the GPU grouped matmul
(``gpu/grouped_matmul.py``): each expert's pairs are contiguous and its run is padded up to a
multiple of ``block_m`` rows, so every block of ``block_m`` rows belongs to exactly one expert,
which a ``[NB]`` table names. Everything is computed on the device with static shapes (no host
sync, jittable): one stable sort of the ``P`` expert ids, a count per expert, cumulative sums.

Static size: with ``n_e`` pairs on expert ``e`` and ``m <= min(E, P)`` experts non-empty,
``sum_e ceil(n_e / BM) <= (P + m (BM - 1)) / BM``, so ``NB = floor((P + min(E, P) (BM - 1)) /
BM)`` blocks always suffice (``max_blocks``): at decode (``P`` small) it is bounded by the
pairs, not by ``E * (BM - 1)``. Blocks past the used ones carry expert ``-1`` and only padding.

Tensor parallel: ``expert_offset`` (traced, e.g. ``axis_index * E_local``) selects the local
experts ``[offset, offset + E_local)``; pairs routed elsewhere get no row at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound ``NB`` on the row blocks of ``num_pairs`` pairs over ``num_experts``
    experts (module docstring); at least 1."""
    check(block_m >= 1, f"block_m {block_m} must be >= 1")
    busy = min(num_experts, num_pairs)
    return max(1, (num_pairs + busy * (block_m - 1)) // block_m)


def moe_align(top_idx: jax.Array, num_experts: int, block_m: int,
              expert_offset: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """Pairs sorted by expert, each expert's run padded to ``block_m`` rows.

    top_idx ``[T, k]`` int (global expert ids); ``num_experts``: the local experts ``E`` (ids
    ``expert_offset + [0, E)``). Returns ``(block_expert [NB] int32, sorted_pair [NB * BM]
    int32)``: the local expert of each row block (``-1``: unused block), and the pair id of each
    row (``P = T * k`` for a padding row); ``NB = max_blocks(P, E, BM)``. Rows of one expert keep
    the pairs' order (a stable sort).
    """
    num_tokens, top_k = top_idx.shape
    num_pairs = num_tokens * top_k
    nb = max_blocks(num_pairs, num_experts, block_m)
    local = top_idx.reshape(-1).astype(jnp.int32) - expert_offset
    group = jnp.where((local >= 0) & (local < num_experts), local, num_experts)   # [P]
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[group].add(1)[:num_experts]
    blocks = (counts + block_m - 1) // block_m                                     # [E]
    block_end = jnp.cumsum(blocks)                                                 # [E]
    row_start = (block_end - blocks) * block_m      # first padded row of each expert
    pair_start = jnp.cumsum(counts) - counts        # its first pair in the sorted order
    order = jnp.argsort(group, stable=True).astype(jnp.int32)                      # [P]
    sorted_group = group[order]
    e = jnp.minimum(sorted_group, num_experts - 1)
    rank = jnp.arange(num_pairs, dtype=jnp.int32) - pair_start[e]
    dest = jnp.where(sorted_group < num_experts, row_start[e] + rank, nb * block_m)
    sorted_pair = jnp.full(nb * block_m, num_pairs, jnp.int32).at[dest].set(
        order, mode="drop", unique_indices=True)
    b = jnp.arange(nb, dtype=jnp.int32)
    owner = jnp.searchsorted(block_end, b, side="right").astype(jnp.int32)
    block_expert = jnp.where(b < block_end[-1], owner, -1)
    return block_expert, sorted_pair
