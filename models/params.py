"""Parameter layout and the seeded random init; the Qwen families' layer layout in full.

Every family lays out its own layers (``models/families/``: ``Family.layer_shapes``); the trunk
(embed, final_norm, lm_head) and the conventions below are shared. The Qwen layout:

Params are a plain pytree of ``jax.Array`` (nested dicts and a tuple of per-layer dicts). Linear
weights are stored ``[in, out]`` (``y = x @ w``), i.e. transposed from torch's ``nn.Linear``:

  embed ``[V, H]``, final_norm ``[H]``, lm_head ``[H, V]`` (a copy of ``embed.T`` when tied),
  layers[i]: input_norm ``[H]``, post_norm ``[H]``, and
    linear_attention -> gdn: in_proj ``[H, C + Hv*Dv + 2*Hv]``, conv_w ``[K, C]``, A_log
      ``[Hv]``, dt_bias ``[Hv]``, norm ``[Dv]`` (plain weight), out_proj ``[Hv*Dv, H]``;
    full_attention -> attn: qkv_proj ``[H, Hq*2*D + 2*Hkv*D]``, q_norm ``[D]``, k_norm ``[D]``,
      o_proj ``[Hq*D, H]``;
    dense -> mlp: gate_up ``[H, 2*I]`` pair-interleaved (column 2i gate i, 2i+1 up i), down
      ``[I, H]``;
    moe -> moe: router ``[H, E]``, gate_up ``[E, H, 2*Im]`` (gate | up per expert), down
      ``[E, Im, H]``, shared_gate_up ``[H, 2*Is]`` pair-interleaved, shared_down ``[Is, H]``,
      shared_gate ``[H, 1]``.

Group-major projections (independent of the tensor-parallel degree). With ``r = Hv/Hk``:

  in_proj columns: ``Hk`` groups, group ``j`` = ``q_j (Dk) | k_j (Dk) | v_j (r*Dv) | z_j (r*Dv) |
    b_j (r) | a_j (r)``; value head ``h = j*r + i`` is the ``i``-th of group ``j`` (GQA order).
  conv channels (``conv_w``'s axis 1, the conv pool's channel axis, the conv input): ``Hk``
    groups ``q_j | k_j | v_j`` (``C / Hk = 2*Dk + r*Dv`` each).
  qkv_proj columns, ``r = Hq/Hkv``: ``Hkv`` groups, group ``j`` = its ``r`` query heads as HF's
    ``q_proj`` packs them (per head ``query D | gate D``), then ``k_j (D)``, then ``v_j (D)``.

Invariant: every group is a contiguous column block of equal width, so splitting these columns
contiguously over ``tp`` devices (``tp`` divides Hk and Hkv) gives each device whole groups, and
the mixers' reshapes to ``[T, groups, per_group]`` keep the split on the group axis (no reshard).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

# Version of the column layouts documented above; saved with exported params (checkpoint.py).
# group-major-v1: group-major in_proj / conv / qkv_proj, pair-interleaved dense gate_up.
PARAM_LAYOUT = "group-major-v1"


def gdn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    c, hv, h = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.hidden_size
    return {
        "in_proj": (h, c + cfg.linear_value_dim + 2 * hv),
        "conv_w": (cfg.linear_conv_kernel_dim, c),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "norm": (cfg.linear_value_head_dim,),
        "out_proj": (cfg.linear_value_dim, h),
    }


def attn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hq, hkv, h = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    return {
        "qkv_proj": (h, hq * 2 * d + 2 * hkv * d),
        "q_norm": (d,),
        "k_norm": (d,),
        "o_proj": (hq * d, h),
    }


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"gate_up": (h, 2 * i), "down": (i, h)}


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, e, im, is_ = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size)
    return {
        "router": (h, e),
        "gate_up": (e, h, 2 * im),
        "down": (e, im, h),
        "shared_gate_up": (h, 2 * is_),
        "shared_down": (is_, h),
        "shared_gate": (h, 1),
    }


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The full parameter tree with shape tuples as leaves (each layer as its family lays it
    out: ``Family.layer_shapes``)."""
    family = cfg.model_family
    layers = tuple(family.layer_shapes(cfg, kind, mlp)
                   for kind, mlp in zip(cfg.layer_types, cfg.mlp_types, strict=True))
    h = cfg.hidden_size
    tree = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "lm_head": (h, cfg.vocab_size),
            "layers": layers}
    if cfg.num_mtp_layers:  # last: the target's params draw the same random numbers either way
        tree["mtp"] = mtp_shapes(cfg)
    return tree


def mtp_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The MTP head (``models/mtp.py``): ``embed_norm``, ``hidden_norm`` ``[H]`` (zero-centred),
    ``fc`` ``[2H, H]`` over ``[embedding | hidden]``, one full-attention ``layer`` with the MLP
    kind of the model's last layer, ``final_norm`` ``[H]``. Embedding and lm_head are shared."""
    h = cfg.hidden_size
    layer: dict[str, Any] = {"input_norm": (h,), "post_norm": (h,), "attn": attn_shapes(cfg)}
    if cfg.mlp_types[-1] == "moe":
        layer["moe"] = moe_shapes(cfg)
    else:
        layer["mlp"] = mlp_shapes(cfg)
    return {"embed_norm": (h,), "hidden_norm": (h,), "fc": (2 * h, h), "layer": layer,
            "final_norm": (h,)}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _init_leaf(path: str, shape: tuple[int, ...], rng: np.random.Generator,
               std: float, plain_norms: bool = False) -> np.ndarray:
    """Random value for one leaf; norms, A_log and dt_bias are randomised too (not identity).
    ``plain_norms``: the family's layer norms multiply by ``w`` (Kimi Linear), not ``1 + w``."""
    name = path.rsplit("/", 1)[-1]
    if name in ("input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "embed_norm",
                "hidden_norm") and not plain_norms:
        return rng.normal(0.0, 0.1, shape)  # zero-centred: the norm multiplies by (1 + w)
    if name in ("norm", "kv_norm", "input_norm", "post_norm", "final_norm"):
        return 1.0 + rng.normal(0.0, 0.1, shape)  # plain weight (gated norms, Kimi's norms)
    if name == "router_bias":
        return rng.normal(0.0, 0.1, shape)
    if name == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name == "dt_bias":
        return 1.0 + rng.normal(0.0, 0.2, shape)
    if name == "conv_w":
        return rng.normal(0.0, 0.3, shape)
    if name == "embed":
        return rng.normal(0.0, 1.0, shape)
    return rng.normal(0.0, std, shape)


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Seeded random parameters for ``cfg`` in ``dtype`` (numpy RNG: identical on any backend).

    Linear weights ~ N(0, 1/sqrt(fan_in)); every norm weight, ``A_log`` and ``dt_bias`` is
    randomised so that a wrong ``(1 + w)`` convention or a swapped gate changes the output.
    """
    rng = np.random.default_rng(seed)

    def build(tree: Any, path: str) -> Any:
        if _is_shape(tree):
            fan_in = tree[-2] if len(tree) >= 2 else 1
            leaf = _init_leaf(path, tree, rng, 1.0 / np.sqrt(fan_in),
                              plain_norms=cfg.model_family.plain_norms)
            return jnp.asarray(leaf.astype(np.float32), dtype=dtype)
        if isinstance(tree, dict):
            return {k: build(v, f"{path}/{k}") for k, v in tree.items()}
        return tuple(build(v, f"{path}/{i}") for i, v in enumerate(tree))

    params = build(param_shapes(cfg), "")
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"].T
    return params


def check_params(cfg: ModelConfig, params: Any) -> None:
    """``ValueError`` naming the first leaf whose presence or shape differs from the layout."""
    expected = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=_is_shape)[0]
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    got = {jax.tree_util.keystr(k): v for k, v in got.items()}
    for key, shape in expected:
        name = jax.tree_util.keystr(key)
        if name not in got:
            raise ValueError(f"parameter {name} is missing (expected shape {shape})")
        if tuple(got[name].shape) != shape:
            raise ValueError(f"parameter {name} has shape {tuple(got[name].shape)}, "
                             f"expected {shape}")
    extra = sorted(set(got) - {jax.tree_util.keystr(k) for k, _ in expected})
    if extra:
        raise ValueError(f"unexpected parameter(s) {extra}")
