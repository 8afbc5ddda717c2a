"""Tensor parallelism: a 1-D device mesh (axis ``"tp"``) and the shardings of params and pools.

GSPMD partitions the jitted step from the input shardings, except the kernel ops: the runner
passes the mesh to the model (``jitted_sharded_step``), and each op of ``pallas_kernels.ops``
(Pallas kernel or jnp reference alike) runs inside ``jax.shard_map`` over ``tp``, on each
device's own heads / channels of the pools (``pool_specs``), index arrays replicated, no
collective inside. A ``pallas_call`` is opaque to GSPMD, which would gather the pools whole onto
every device around it. Heads are split over the ``tp`` axis:

* pools: KV pages on the KV-head axis, conv state on the channel axis, SSM state on the
  value-head axis (``pool_specs``). Page and slot ids stay global, so the host side (radix
  tree, allocators, ``ForwardBatch``) is unchanged.
* params (``param_spec``): column-parallel input projections (``in_proj``, ``qkv_proj``,
  ``gate_up``), row-parallel output projections (``out_proj``, ``o_proj``, ``down``): one
  all-reduce per mixer and per MLP. Experts are split on the expert axis; the vocab is split for
  ``embed`` and ``lm_head``; norms, the router and per-head scalars of tiny size are replicated.

``in_proj``, ``conv_w`` and ``qkv_proj`` are group-major (per key / KV head, ``models/params.py``),
so a contiguous column split hands each device whole head groups and the mixers need no reshard:
the compiled TP extend step's mixers hold only their row-parallel all-reduce. The dense MLP and
shared-expert ``gate_up`` are pair-interleaved (``models/layers.py: swiglu``) for the same
reason: the layers need only their all-reduces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.ops import TP_AXIS

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine
    from mambacache.engine.runners.pools import PoolState
    from models.config import ModelConfig

TP = TP_AXIS  # one name for the mesh axis, shared with the kernel ops

# leaf name -> which axis is split over "tp" (None: replicated)
_PARAM_AXIS = {
    "embed": 0, "lm_head": 1,
    "in_proj": 1, "conv_w": 1, "A_log": 0, "dt_bias": 0, "out_proj": 0,
    "qkv_proj": 1, "o_proj": 0,
    "shared_gate_up": 1, "shared_down": 0,
    "conv_b": 0, "D": 0, "shared_up": 1,  # Mamba2 hybrids (models/families/mamba2_common.py)
    "f_b": 1, "g_b": 1, "b_proj": 1, "q_proj": 1, "k_up": 0, "v_up": 0,  # Kimi Linear
}
_MLP_AXIS = {"gate_up": 1, "up": 1, "down": 0}  # dense MLP; MoE experts use axis 0 instead


def validate_tensor_parallel(model_cfg: ModelConfig, tp: int,
                             num_devices: int | None = None) -> None:
    """``ValueError`` unless ``tp`` divides every head count it splits and fits the devices."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"parallel.tensor_parallel must be a positive int, got {tp!r}")
    num_devices = len(jax.devices()) if num_devices is None else num_devices
    if tp > num_devices:
        raise ValueError(f"parallel.tensor_parallel={tp} exceeds the {num_devices} available "
                         f"device(s)")
    counts = {
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_key_value_heads": model_cfg.num_key_value_heads,
        "linear_num_key_heads": model_cfg.linear_num_key_heads,
        "linear_num_value_heads": model_cfg.linear_num_value_heads,
    }
    if "moe" in model_cfg.mlp_types:
        counts["num_experts"] = model_cfg.num_experts
    if model_cfg.model_family.linear_groups_replicate:
        groups = counts.pop("linear_num_key_heads")  # Mamba2 groups: split, or one per device
        if groups % tp and tp % groups:
            raise ValueError(f"parallel.tensor_parallel={tp} and the model's Mamba2 n_groups "
                             f"({groups}) must divide one another")
    for name, value in counts.items():
        if value % tp:
            raise ValueError(f"parallel.tensor_parallel={tp} must divide the model's {name} "
                             f"({value})")


def replicate_kv_heads(model_cfg: ModelConfig, tp: int) -> Any:
    """``model_cfg`` with each KV head repeated ``tp / Hkv`` times when ``tp`` exceeds the KV
    heads (Qwen3-Next: 2 KV heads at TP 8), so every device holds the one KV head its query
    heads read (vLLM's rule); the same math with ``k`` / ``v`` columns repeated in
    ``qkv_proj``. Unchanged when ``tp`` divides ``Hkv``, for MLA (one latent row, already
    replicated) or when the repeat cannot be even."""
    hkv, hq = model_cfg.num_key_value_heads, model_cfg.num_attention_heads
    if (tp <= hkv or tp % hkv or hq % tp or model_cfg.kv_lora_rank
            or not model_cfg.num_full_layers):
        return model_cfg
    import dataclasses

    return dataclasses.replace(model_cfg, num_key_value_heads=tp)


def make_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh over the first ``tp`` devices (all processes' devices, in global order)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    if tp > len(devices):
        raise ValueError(f"parallel.tensor_parallel={tp} exceeds the {len(devices)} device(s)")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def _split(shape: tuple[int, ...], axis: int | None, tp: int) -> P:
    if axis is None or len(shape) <= axis or shape[axis] % tp:
        return P()
    spec: list[str | None] = [None] * len(shape)
    spec[axis] = TP
    return P(*spec)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
    """The ``PartitionSpec`` of the param at ``path`` (names from the root, e.g.
    ``("layers", "3", "moe", "gate_up")``); a leaf whose split axis ``tp`` does not divide is
    replicated."""
    name = path[-1]
    if "moe" in path and name in ("gate_up", "up", "down"):
        return _split(shape, 0, tp)  # experts
    if "mamba" in path and name == "norm":  # Mamba2's grouped norm spans all heads' channels
        return _split(shape, 0, tp)
    if "mlp" in path and name in _MLP_AXIS:
        return _split(shape, _MLP_AXIS[name], tp)
    return _split(shape, _PARAM_AXIS.get(name), tp)


def _key_names(path: tuple) -> tuple[str, ...]:
    out = []
    for k in path:
        out.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return tuple(out)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree of ``NamedSharding`` matching ``params`` (arrays or ``ShapeDtypeStruct``)."""
    tp = mesh.shape[TP]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_key_names(path), tuple(x.shape), tp)),
        params)


def pool_specs() -> dict[str, P]:
    """Per-field spec of ``PoolState``: heads / channels over ``tp``, ids (axis 0) global."""
    return {"k_pages": P(None, None, TP, None), "v_pages": P(None, None, TP, None),
            "conv": P(None, None, TP), "ssm": P(None, TP, None, None)}


def _fit(spec: P, shape: tuple[int, ...], tp: int) -> P:
    """``spec`` with every split axis that ``tp`` does not divide replicated instead: a layer
    kind's pool row may have no head axis to split (MLA's latent row: one "KV head", replicated,
    each device attending with its own query heads). Head counts are validated beforehand."""
    return P(*(ax if ax is None or shape[i] % tp == 0 else None for i, ax in enumerate(spec)))


def pool_field_sharding(mesh: Mesh):
    """``(field name, shape) -> NamedSharding`` for ``PoolState.create(..., sharding=...)``."""
    specs, tp = pool_specs(), mesh.shape[TP]
    return lambda field, shape: NamedSharding(mesh, _fit(specs[field], shape, tp))


def pool_shardings(pools: PoolState, mesh: Mesh) -> Any:
    """``PoolState`` of ``NamedSharding`` (same tree as ``pools``)."""
    specs, tp = pool_specs(), mesh.shape[TP]
    return pools.replace(**{f: tuple(NamedSharding(mesh, _fit(specs[f], a.shape, tp))
                                     for a in getattr(pools, f)) for f in specs})


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree: Any, shardings: Any) -> Any:
    """Put ``tree`` onto ``shardings`` leaf by leaf. Multi-process: each process builds only its
    addressable shards from its host copy (``make_array_from_callback``)."""
    if jax.process_count() == 1:
        return jax.tree.map(jax.device_put, tree, shardings)

    def one(x: Any, sh: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


def shard_engine(engine: Engine) -> Any:
    """Put ``engine``'s params and pools onto a ``cfg.parallel.tensor_parallel`` mesh (the
    engine's, else a new one) and make its runner compile the step with those shardings
    (``Engine.__init__`` calls this and keeps the mesh returned). Writes nothing of the engine's
    or the runner's: the runner places the arrays (``ModelRunner.place``)."""
    tp = engine.cfg.parallel.tensor_parallel
    validate_tensor_parallel(engine.model_cfg, tp)
    mesh = engine.mesh if engine.mesh is not None else make_mesh(tp)
    runner = engine.runner
    pool_sh = pool_shardings(runner.pools, mesh)
    runner.place(_placed(runner.params, param_shardings(runner.params, mesh)),
                 _placed(runner.pools, pool_sh))
    runner.use_shardings(mesh, pool_sh)
    return mesh


def _placed(tree: Any, shardings: Any) -> Any:
    """``tree`` on ``shardings``; leaves already there (created or restored sharded) stay put."""
    leaves, sh = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if all(isinstance(x, jax.Array) and x.sharding == s for x, s in zip(leaves, sh, strict=True)):
        return tree
    return place(tree, shardings)


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of ``tree``'s shards on each device (``str(device)`` -> bytes)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out
