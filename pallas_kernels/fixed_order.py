"""Row reductions in a fixed order, for ``model.deterministic`` (bit-identical outputs).

``tree_sum(x)`` sums the last axis as a tree of elementwise adds (the axis zero-padded to a
power of two, then halves added pairwise): every output element is summed in the same order
whatever the other axes' sizes. XLA's ``reduce`` promises no such thing: on CPU a row-wise
reduce over ``[T, D]`` is vectorised according to T (rows 0..39 of T = 64 and T = 128 round
differently in fp32), so a request's norms changed with the step it shared.

``row_sum`` / ``row_mean`` / ``softmax`` / ``log_softmax`` take that order while the trace-time
switch ``fixed_order(True)`` is on, else they are the plain ``jnp`` / ``jax.nn`` forms (the
default mode is unchanged, bit for bit). ``models.model.forward`` and the engine's step turn the
switch on from ``ModelConfig.deterministic``; jitted programs are keyed by that config (a static
argument), so a switch read while tracing never reaches another config's program.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("fixed_order", default=False)


def enabled() -> bool:
    """Whether reductions traced now take the fixed order."""
    return _ON.get()


@contextlib.contextmanager
def fixed_order(on: bool) -> Iterator[None]:
    """Reductions traced inside take the fixed order if ``on`` (nested: the inner one wins)."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


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


def row_sum(x: jax.Array) -> jax.Array:
    """``sum(x, -1, keepdims=True)``; the fixed order under ``fixed_order(True)``."""
    return tree_sum(x) if enabled() else jnp.sum(x, axis=-1, keepdims=True)


def row_mean(x: jax.Array) -> jax.Array:
    """``mean(x, -1, keepdims=True)``; the fixed order under ``fixed_order(True)``."""
    return tree_sum(x) / x.shape[-1] if enabled() else jnp.mean(x, axis=-1, keepdims=True)


def softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.softmax(x, -1)``; the fixed order under ``fixed_order(True)`` (max is exact in
    any order; the sum is the tree)."""
    if not enabled():
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / tree_sum(e)


def log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, -1)``; the fixed order under ``fixed_order(True)``."""
    if not enabled():
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(tree_sum(jnp.exp(shifted)))
