"""Plain-jnp reference of the grouped MoE matmul (the routed experts of a top-k MoE), its shape
check and the expert activations both kernel families share.

The op: ``y[t] = sum_j w[t, j] * act(x[t] @ w_in[e]) @ w_out[e]`` with ``e = top_idx[t, j]``,
over the local experts ``expert_offset + [0, E)`` only (a pair routed elsewhere adds 0: tensor
parallel). ``act`` is static: ``"swiglu"`` (``w_in`` holds ``gate | up``, ``N_in = 2 I``) or
``"relu2"`` (Nemotron-H, ``relu(h)^2``, ``N_in = I``). Rounding follows the model's grouped
form: ``act(x @ w_in)`` in x.dtype, the second product accumulated in fp32, times the routing
weight, rounded to x.dtype per pair, then the k pairs of a token summed in fp32.

The reference evaluates each pair on its own expert's weights (gathered per pair: memory
``T k H N_in``; an oracle for tests, not a serving path). Work is ``T * k`` either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check

_F32 = jnp.float32
ACTIVATIONS = ("swiglu", "relu2")
_EXACT = jax.lax.Precision.HIGHEST


def activate(h: jax.Array, activation: str) -> jax.Array:
    """``[..., N_in] -> [..., I]``: SwiGLU on ``gate | up`` or squared ReLU; in h.dtype."""
    if activation == "swiglu":
        g, u = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(g) * u
    return jnp.square(jax.nn.relu(h))


def check_grouped(x, top_vals, top_idx, w_in, w_out, activation: str) -> tuple[int, int]:
    """Static shape checks; returns ``(E, I)``. ``ValueError`` naming the shapes otherwise."""
    check(activation in ACTIVATIONS,
          f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(x.ndim == 2, f"x must be [T, H], got shape {x.shape}")
    num_tokens, hidden = x.shape
    check(top_idx.ndim == 2 and top_idx.shape[0] == num_tokens,
          f"top_idx {top_idx.shape} must be [T, k] with T = {num_tokens} (x {x.shape})")
    check(top_vals.shape == top_idx.shape,
          f"top_vals {top_vals.shape} must match top_idx {top_idx.shape}")
    check(jnp.issubdtype(top_idx.dtype, jnp.integer), f"top_idx must be int, got {top_idx.dtype}")
    check(w_in.ndim == 3 and w_in.shape[1] == hidden,
          f"w_in {w_in.shape} must be [E, H, N_in] with H = {hidden} (x {x.shape})")
    num_experts, _, n_in = w_in.shape
    inter = n_in // 2 if activation == "swiglu" else n_in
    check(activation != "swiglu" or n_in % 2 == 0,
          f"swiglu needs an even w_in width (gate | up), got {n_in}")
    check(w_out.shape == (num_experts, inter, hidden),
          f"w_out {w_out.shape} must be [E, I, H] = {(num_experts, inter, hidden)} "
          f"(w_in {w_in.shape}, {activation})")
    check(num_experts >= 1, f"w_in {w_in.shape} has no experts")
    return num_experts, inter


def local_pairs(top_idx: jax.Array, num_experts: int, expert_offset) -> tuple[jax.Array,
                                                                              jax.Array]:
    """Local expert id ``[P]`` int32 (clamped into range) and whether each pair is local."""
    local = top_idx.reshape(-1).astype(jnp.int32) - expert_offset
    ok = (local >= 0) & (local < num_experts)
    return jnp.clip(local, 0, num_experts - 1), ok


def sum_pairs(y: jax.Array, ok: jax.Array, num_tokens: int) -> jax.Array:
    """Per-pair outputs ``[P, H]`` (garbage where not ``ok``) -> per token ``[T, H]`` f32."""
    y = jnp.where(ok[:, None], y, jnp.zeros_like(y))
    return jnp.sum(y.reshape(num_tokens, -1, y.shape[-1]).astype(_F32), axis=1)


def grouped_moe_reference(x, top_vals, top_idx, w_in, w_out, expert_offset=0, *,
                          activation: str = "swiglu") -> jax.Array:
    """The routed experts, ``[T, H]`` float32 (module docstring).

    x ``[T, H]``; top_vals ``[T, k]`` (x.dtype or f32); top_idx ``[T, k]`` int (global expert
    ids); w_in ``[E, H, N_in]``, w_out ``[E, I, H]`` (the local experts); expert_offset: int or
    a traced int32 scalar.
    """
    num_experts, _ = check_grouped(x, top_vals, top_idx, w_in, w_out, activation)
    num_tokens, top_k = top_idx.shape
    e, ok = local_pairs(top_idx, num_experts, expert_offset)
    rows = jnp.repeat(x, top_k, axis=0)                                   # [P, H]
    h = jnp.einsum("ph,phn->pn", rows, w_in[e], precision=_EXACT)         # x.dtype
    a = activate(h.astype(x.dtype), activation)
    y = jnp.einsum("pi,pih->ph", a, w_out[e], precision=_EXACT, preferred_element_type=_F32)
    y = (y * top_vals.reshape(-1, 1).astype(_F32)).astype(x.dtype)
    return sum_pairs(y, ok, num_tokens)
