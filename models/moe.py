"""Top-k mixture of experts with a sigmoid-gated shared expert: grouped (serving) and dense forms.

Routing (both forms, one ``jax.lax.top_k`` call, so ties resolve identically): ``softmax`` of
``x @ router`` in fp32, top-k, optionally renormalised, cast to the activation dtype.

* ``moe_grouped``: the serving form. Each of the ``T * k`` (token, expert) pairs runs only on
  its own expert, then the outputs are weighted and summed back per token. Work ``~ T * k``.
  ``impl="pallas"`` (the model's serving path): the grouped matmul op ``pallas_kernels.ops.
  grouped_moe`` (GPU: rows sorted by expert and padded to blocks, SwiGLU / relu2 and the
  routing weight fused; TPU: megablox ``gmm``), interpreted off its backend.
  ``impl="ragged_dot"``: the pairs sorted by expert and two ``jax.lax.ragged_dot`` (kept for
  comparison: on TPU it lowers natively, but XLA's GPU backend rewrites it into one dense
  product over every expert, and on CPU JAX expands it to a masked dense matmul over every
  group, ``E * T * k``: ``docs/model.md``, ``docs/kernels.md``).
  Under tensor parallel (``mesh`` with a ``"tp"`` axis, experts split on axis 0) the routed part
  runs in ``jax.shard_map``: x and the routing replicated, each device takes the pairs of its
  ``E / tp`` local experts, and the partial outputs are summed with ``psum`` over ``"tp"``.
  GSPMD is never asked to partition the ragged group axis.
* ``moe_dense_reference``: every expert on every token, weight 0 outside the top-k (cost
  ``T * E``): the exactness reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.layers import F32, swiglu
from pallas_kernels import ops
from pallas_kernels.fixed_order import row_sum, softmax
from pallas_kernels.reference.grouped_matmul import activate

if TYPE_CHECKING:
    from models.config import ModelConfig

TP_AXIS = "tp"


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
          bias: jax.Array | None = None, groups: tuple[int, int] = (1, 1),
          scale: float = 1.0, fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: weights ``[T, k]`` in x.dtype and expert ids ``[T, k]`` int32.

    x ``[T, H]``, router ``[H, E]``; softmax in fp32, renormalised over the top-k if
    ``norm_topk_prob``. Raises ``ValueError`` unless ``1 <= top_k <= E``. With ``bias``
    (``[E]``, DeepSeek-V3 / Kimi Linear) the scores are sigmoids instead, see ``_route_biased``.
    ``fixed_order`` (``model.deterministic``): softmax and renormalisation sum in a fixed tree.
    """
    num_experts = router.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if bias is not None:
        return _route_biased(x, router, top_k, norm_topk_prob, bias, groups, scale, fixed_order)
    probs = softmax((x @ router).astype(F32), fixed_order=fixed_order)
    top_vals, top_idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_vals = top_vals / row_sum(top_vals, fixed_order=fixed_order)
    return top_vals.astype(x.dtype), top_idx.astype(jnp.int32)


def _route_biased(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
                  bias: jax.Array, groups: tuple[int, int],
                  scale: float, fixed_order: bool) -> tuple[jax.Array, jax.Array]:
    """Sigmoid scores ``s`` (fp32); the choice ranks ``s + bias``: the experts form ``groups[0]``
    groups, each scored by the sum of its two best, and only the best ``groups[1]`` groups stay
    eligible; top-k of those. Weights: ``s`` of the chosen (renormalised with ``+ 1e-20`` if
    ``norm_topk_prob``) times ``scale``, as transformers' ``KimiLinearTopkRouter``."""
    num_groups, keep_groups = groups
    scores = jax.nn.sigmoid(x.astype(F32) @ router.astype(F32))      # [T, E]
    choice = scores + bias.astype(F32)
    per_group = choice.reshape(choice.shape[0], num_groups, -1)
    group_score = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_score, keep_groups)
    eligible = jnp.any(best[:, :, None] == jnp.arange(num_groups), axis=1)   # [T, G]
    choice = jnp.where(eligible[:, :, None], per_group, -jnp.inf).reshape(choice.shape)
    _, top_idx = jax.lax.top_k(choice, top_k)
    top_vals = jnp.take_along_axis(scores, top_idx, axis=-1)
    if norm_topk_prob:
        top_vals = top_vals / (row_sum(top_vals, fixed_order=fixed_order) + 1e-20)
    return (top_vals * scale).astype(x.dtype), top_idx.astype(jnp.int32)


def router_weights(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
                   **routing) -> jax.Array:
    """Dense routing weights ``[T, E]`` in x.dtype (0 outside each token's top-k)."""
    top_vals, top_idx = route(x, router, top_k, norm_topk_prob, **routing)
    one_hot = jax.nn.one_hot(top_idx, router.shape[-1], dtype=x.dtype)  # [T, k, E]
    return jnp.einsum("tk,tke->te", top_vals, one_hot)


def _shared_expert(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    shared = swiglu(x, p["shared_gate_up"], p["shared_down"])
    if "shared_gate" not in p:  # Kimi Linear: shared experts without a gate
        return shared
    return jax.nn.sigmoid(x @ p["shared_gate"]) * shared


def moe_dense_reference(x: jax.Array, p: dict[str, jax.Array], top_k: int,
                        norm_topk_prob: bool, **routing) -> jax.Array:
    """Dense form: every expert on every token, non-selected weighted by 0. x ``[T, H]``.

    p: ``router [H, E]``, ``gate_up [E, H, 2I]`` (gate | up), ``down [E, I, H]``, shared expert
    ``shared_gate_up [H, 2Is]``, ``shared_down [Is, H]``, ``shared_gate [H, 1]``. Returns
    ``[T, H]`` in x.dtype. Exact but costs ``T * E`` expert evaluations.
    """
    weights = router_weights(x, p["router"], top_k, norm_topk_prob,
                             **_bias(p, routing))  # [T, E]
    h = jnp.einsum("th,ehi->tei", x, p["gate_up"])
    g, u = jnp.split(h, 2, axis=-1)
    per_expert = jnp.einsum("tei,eih->teh", jax.nn.silu(g) * u, p["down"])
    routed = jnp.einsum("teh,te->th", per_expert, weights)
    return routed + _shared_expert(x, p)


def _bias(p: dict[str, jax.Array], routing: dict) -> dict:
    """``routing`` (``groups``, ``scale``) plus the correction bias when the layer has one."""
    return {**routing, "bias": p["router_bias"]} if "router_bias" in p else routing


GROUPED_IMPLS = ("pallas", "reference", "ragged_dot")


def _grouped_experts(x: jax.Array, top_vals: jax.Array, top_idx: jax.Array, gate_up: jax.Array,
                     down: jax.Array, expert_offset: jax.Array | int,
                     activation: str = "swiglu") -> jax.Array:
    """Routed output ``[T, H]`` float32 of the experts ``expert_offset + [0, E_local)``.

    x ``[T, H]``; top_vals / top_idx ``[T, k]`` (global expert ids); gate_up ``[E_local, H, 2I]``,
    down ``[E_local, I, H]``. Pairs routed to other experts contribute 0 (tensor parallel).
    """
    num_tokens, top_k = top_idx.shape
    num_local = gate_up.shape[0]
    local = top_idx.reshape(-1) - expert_offset                    # [T*k]
    is_local = (local >= 0) & (local < num_local)
    group = jnp.where(is_local, local, num_local)                  # others sort last
    order = jnp.argsort(group, stable=True)                        # [T*k] pair ids by expert
    group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = jnp.take(x, order // top_k, axis=0)                     # [T*k, H]
    h = jax.lax.ragged_dot(rows, gate_up, group_sizes)             # [T*k, 2I] (or [T*k, I])
    out = jax.lax.ragged_dot(activate(h, activation), down, group_sizes)            # [T*k, H]
    # rows past sum(group_sizes) (other devices' pairs) are not defined by ragged_dot: mask
    out = jnp.where(jnp.take(is_local, order)[:, None], out, jnp.zeros_like(out))
    weighted = out * jnp.take(top_vals.reshape(-1), order)[:, None]  # x.dtype, as the dense form
    unsorted = jnp.zeros_like(weighted).at[order].set(weighted, unique_indices=True)
    return jnp.sum(unsorted.reshape(num_tokens, top_k, -1).astype(F32), axis=1)


def moe_grouped(x: jax.Array, p: dict[str, jax.Array], top_k: int, norm_topk_prob: bool, *,
                mesh: Mesh | None = None, impl: str = "pallas", **routing) -> jax.Array:
    """Grouped top-k MoE plus the shared expert; x ``[T, H]`` -> ``[T, H]``.

    Same params and result as ``moe_dense_reference`` (fp32: equal to rounding), cost
    ``~T * k``. ``impl``: one of ``GROUPED_IMPLS`` (``routed_experts``). ``mesh``: None for one
    device, else a mesh with a ``"tp"`` axis over which ``gate_up`` / ``down`` are split on the
    expert axis (``E % tp == 0``).
    """
    top_vals, top_idx = route(x, p["router"], top_k, norm_topk_prob, **_bias(p, routing))
    routed = routed_experts(x, top_vals, top_idx, p["gate_up"], p["down"], mesh=mesh, impl=impl)
    return routed.astype(x.dtype) + _shared_expert(x, p)


def routed_experts(x: jax.Array, top_vals: jax.Array, top_idx: jax.Array, w_in: jax.Array,
                   w_out: jax.Array, *, activation: str = "swiglu", mesh: Mesh | None = None,
                   impl: str = "pallas") -> jax.Array:
    """The grouped routed part alone, ``[T, H]`` float32: ``sum_k top_vals * w_out(act(w_in
    x))`` over each token's experts. ``w_in [E, H, I_in]``, ``w_out [E, I, H]``;
    ``activation`` maps ``I_in`` to ``I`` (``"swiglu"`` on ``gate | up``; Nemotron-H's
    ``"relu2"`` with ``I_in = I``). ``impl``: ``"pallas"`` / ``"reference"``: the grouped
    matmul op ``ops.grouped_moe`` (its kernel family, or its per-pair reference);
    ``"ragged_dot"``: sort + two ``lax.ragged_dot``. ``mesh``: experts split over "tp" as in
    ``moe_grouped``."""
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_IMPLS}, got {impl!r}")
    if impl != "ragged_dot":
        return ops.grouped_moe(x, top_vals, top_idx, w_in, w_out, activation=activation,
                               impl=impl, mesh=mesh)
    if mesh is None:
        return _grouped_experts(x, top_vals, top_idx, w_in, w_out, 0, activation)
    return _routed_on_mesh(x, top_vals, top_idx, w_in, w_out, mesh, activation)


def _routed_on_mesh(x: jax.Array, top_vals: jax.Array, top_idx: jax.Array, gate_up: jax.Array,
                    down: jax.Array, mesh: Mesh, activation: str = "swiglu") -> jax.Array:
    if TP_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} must include {TP_AXIS!r}")
    tp = mesh.shape[TP_AXIS]
    if gate_up.shape[0] % tp:
        raise ValueError(f"tensor_parallel={tp} must divide num_experts ({gate_up.shape[0]})")

    def per_device(x, top_vals, top_idx, gate_up, down):
        offset = jax.lax.axis_index(TP_AXIS) * gate_up.shape[0]
        part = _grouped_experts(x, top_vals, top_idx, gate_up, down, offset, activation)
        return jax.lax.psum(part, TP_AXIS)

    experts = P(TP_AXIS, None, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), experts, experts),
                         out_specs=P(), check_vma=False)(x, top_vals, top_idx, gate_up, down)


def dense_moe(cfg: ModelConfig, impl: str) -> bool:
    """The MoE's dense form (every expert on every token)? With the references, and
    [deterministic] always: a token's row of the grouped form's ``ragged_dot`` is not known to
    be independent of how many tokens the other experts got (its tiling follows the groups)."""
    return impl == "reference" or cfg.deterministic


def mlp_block(cfg: ModelConfig, layer: dict[str, Any], x: jax.Array, impl: str,
              mesh: Mesh | None) -> jax.Array:
    """The feed-forward of the Qwen and Kimi families: dense SwiGLU (``layer["mlp"]``), or the
    MoE (``layer["moe"]``): grouped (the grouped matmul kernel, cost ~ T * k) with the Pallas
    kernels, the dense form (every expert on every token) with the references.
    [deterministic] The dense form with either (``dense_moe``)."""
    if "moe" in layer:
        routing = {"groups": (cfg.n_group, cfg.topk_group), "scale": cfg.routed_scaling_factor,
                   "fixed_order": cfg.deterministic}
        if dense_moe(cfg, impl):
            return moe_dense_reference(x, layer["moe"], cfg.num_experts_per_tok,
                                       cfg.norm_topk_prob, **routing)
        return moe_grouped(x, layer["moe"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           mesh=mesh, impl=impl, **routing)
    return swiglu(x, layer["mlp"]["gate_up"], layer["mlp"]["down"])
