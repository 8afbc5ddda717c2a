"""Row reductions in a fixed order, for ``model.deterministic`` (bit-identical outputs).

``tree_sum(x)`` sums the last axis as a tree of elementwise adds (the axis zero-padded to a
power of two, then halves added pairwise): every output element is summed in the same order
whatever the other axes' sizes. XLA's ``reduce`` promises no such thing: on CPU a row-wise
reduce over ``[T, D]`` is vectorised according to T (rows 0..39 of T = 64 and T = 128 round
differently in fp32), so a request's norms changed with the step it shared.

``row_sum`` / ``row_mean`` / ``softmax`` / ``log_softmax`` / ``prefix_sum`` take that order when
their keyword ``fixed_order`` is True, else they are the plain ``jnp`` / ``jax.nn`` forms (the
default mode is unchanged, bit for bit). ``fixed_order`` is a Python bool, static wherever it is
traced: the model passes ``ModelConfig.deterministic`` down explicitly (norms, routers, the
kernel ops' ``fixed_order`` static, the sampler); nothing here reads a global switch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis, keepdims, by pairwise elementwise adds in a fixed tree."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:  # + 0.0 is exact: padding changes no partial sum
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def row_sum(x: jax.Array, *, fixed_order: bool) -> jax.Array:
    """``sum(x, -1, keepdims=True)``; the fixed tree if ``fixed_order``."""
    return tree_sum(x) if fixed_order else jnp.sum(x, axis=-1, keepdims=True)


def row_mean(x: jax.Array, *, fixed_order: bool) -> jax.Array:
    """``mean(x, -1, keepdims=True)``; the fixed tree if ``fixed_order``."""
    return tree_sum(x) / x.shape[-1] if fixed_order else jnp.mean(x, axis=-1, keepdims=True)


def softmax(x: jax.Array, *, fixed_order: bool) -> jax.Array:
    """``jax.nn.softmax(x, -1)``; if ``fixed_order``, the sum is the tree (max is exact in any
    order)."""
    if not fixed_order:
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / tree_sum(e)


def log_softmax(x: jax.Array, *, fixed_order: bool) -> jax.Array:
    """``jax.nn.log_softmax(x, -1)``; if ``fixed_order``, the sum is the tree."""
    if not fixed_order:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(tree_sum(jnp.exp(shifted)))


def prefix_sum(x: jax.Array, *, fixed_order: bool) -> jax.Array:
    """``cumsum(x, -1)``; if ``fixed_order``, a Hillis-Steele scan (``log2 n`` shifted
    elementwise adds): element i's sum has the same association whatever the other axes' sizes
    (XLA's cumsum promises no such thing)."""
    if not fixed_order:
        return jnp.cumsum(x, axis=-1)
    n, shift = x.shape[-1], 1
    while shift < n:
        pad = [(0, 0)] * (x.ndim - 1) + [(shift, 0)]
        x = x + jnp.pad(x[..., :n - shift], pad)
        shift *= 2
    return x
