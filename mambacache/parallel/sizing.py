"""Device -> per-device byte budget for the cache: the ONE sizing path of the plan and the engine.

For a model, an engine config and a mesh (real devices, or a libtpu compile-only topology), it
compiles the engine's own step programs at their largest buckets (``largest_step_shapes``: the
widest prefill step and the decode step) on abstract, sharded params and pools (no weight is
allocated), reads ``memory_analysis()`` per device, and gives the cache what is left:

    budget = (hbm - weights - max(temp + generated code over the programs)) * memory_fraction

``weights`` is the largest device's share of the params (``sharded_bytes``), exact from the
shardings the engine uses (``mesh.param_shardings``). Pool sizes come from the budget and what one
state slot and one KV token take on a device (``unit_bytes``, from ``PoolState`` itself).

Invariants: every number here is per device (under tensor parallelism the busiest device); a
budget below zero is reported as such, never clamped, so the caller can say by how much it
does not fit. ``pool_sizes_from_budget`` is the interim split until the memory-budget work's
``byte budget -> pool sizes`` function lands; callers use only its two outputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mambacache.engine.batch import build_forward_batch
from mambacache.engine.pools import PoolState
from mambacache.engine.runner import (
    MIN_PAGE_BUCKET,
    MIN_SNAPSHOT_BUCKET,
    MIN_TOKEN_BUCKET,
    bucket,
    jitted_sharded_step,
)
from mambacache.engine.sampling import SamplingBatch
from mambacache.engine.step_plan import SeqSpec
from mambacache.parallel.mesh import param_shardings, pool_shardings, replicated

#: share of the states in the interim split (issue 25 measured 0.3-0.5 best on chat traces)
INTERIM_STATE_SHARE = 0.3
#: the plan's cache.memory_fraction when the config sets none (SGLang's mem_fraction_static)
DEFAULT_MEMORY_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The ``ForwardBatch`` bucket of one step program (the runner's ``shapes_for`` keys)."""

    decode: bool
    num_tokens: int
    num_seqs: int
    num_pages_per_seq: int
    num_snapshots: int
    num_logits: int


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """``memory_analysis()`` and ``cost_analysis()`` of one compiled step, per device (bytes,
    FLOPs); ``optimal_seconds``: the TPU compiler's own time estimate (0 when absent)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    optimal_seconds: float


def memory_fraction(cfg: Any) -> float:
    """``cache.memory_fraction``, or ``DEFAULT_MEMORY_FRACTION`` when it is unset (0)."""
    return float(getattr(cfg.cache, "memory_fraction", 0.0) or DEFAULT_MEMORY_FRACTION)


def context_len(cfg: Any, model_cfg: Any) -> int:
    """The longest sequence a step must hold: the model's ``max_position_embeddings``."""
    del cfg  # no engine-side context limit yet
    return int(model_cfg.max_position_embeddings)


def largest_step_shapes(cfg: Any, model_cfg: Any) -> dict[str, StepShapes]:
    """The widest prefill bucket (every running request's decode row plus a full prefill chunk,
    pages for a whole context) and the decode bucket, as ``runner.ModelRunner`` pads them."""
    seqs = bucket(cfg.scheduler.max_running_requests, 1)
    pages = bucket(-(-context_len(cfg, model_cfg) // cfg.cache.page_size), MIN_PAGE_BUCKET)
    chunk = cfg.scheduler.chunked_prefill_size
    tokens = bucket(chunk + seqs, MIN_TOKEN_BUCKET)
    snaps = max(MIN_SNAPSHOT_BUCKET, min(tokens, bucket(2 * seqs, 1)))
    return {
        "prefill": StepShapes(False, tokens, seqs, pages, snaps, seqs),
        "decode": StepShapes(True, seqs, seqs, pages, MIN_SNAPSHOT_BUCKET, seqs),
    }


def abstract_params(model_cfg: Any, dtype: Any) -> Any:
    """The params' ``ShapeDtypeStruct`` tree from the layout (``models.params.param_shapes``);
    nothing allocated, not even on the host (``init_params`` draws numpy randoms)."""
    from models.params import param_shapes

    def is_shape(x: Any) -> bool:
        return isinstance(x, tuple) and all(isinstance(d, int) for d in x)

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
                        param_shapes(model_cfg), is_leaf=is_shape)


def abstract_pools(model_cfg: Any, num_pages: int, page_size: int, num_slots: int,
                   dtype: Any) -> PoolState:
    return jax.eval_shape(lambda: PoolState.create(model_cfg, num_pages, page_size, num_slots,
                                                   dtype))


def sharded_bytes(tree: Any, shardings: Any) -> int:
    """Bytes of ``tree``'s shards on its busiest device (abstract leaves; nothing allocated)."""
    per_device: dict[int, int] = {}
    for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shard = math.prod(sh.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        for i, _ in enumerate(sh.mesh.devices.flat):
            per_device[i] = per_device.get(i, 0) + shard
    return max(per_device.values(), default=0)


def laid_out_bytes(tree: Any, shardings: Any) -> int:
    """Per-device bytes of ``tree`` as the devices lay it out (TPU: tiles pad the two minor
    dims, e.g. a conv state row ``[K-1 = 3, C]`` takes 16 rows in bf16): the argument size of a
    program that only takes it, compiled for ``shardings``' devices. Logical bytes on CPU."""
    leaves, sh = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if not leaves or sh[0].mesh.devices.flat[0].platform == "cpu":
        return sharded_bytes(tree, shardings)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(leaves, sh, strict=True)]
    compiled = jax.jit(lambda *a: None, keep_unused=True).lower(*args).compile()
    return int(compiled.memory_analysis().argument_size_in_bytes)


def unit_bytes(model_cfg: Any, mesh: Mesh, page_size: int, dtype: Any) -> tuple[int, int]:
    """Per device: bytes of one state slot (conv + SSM rows of every linear layer) and of one
    KV page (``page_size`` tokens in every attention layer), from ``PoolState.create``'s
    shapes as the devices lay them out."""
    def size(pages: int, slots: int) -> int:
        pools = abstract_pools(model_cfg, pages, page_size, slots, dtype)
        return laid_out_bytes(pools, pool_shardings(pools, mesh))

    base = size(1, 1)
    return size(1, 2) - base, size(2, 1) - base


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def step_args(shapes: StepShapes, page_size: int, params: Any, pools: PoolState,
              mesh: Mesh) -> tuple:
    """Abstract arguments of the runner's step (``runner._step``), placed as the engine places
    them: params and pools sharded, the batch and sampling rows replicated."""
    spec = SeqSpec(tokens=[1], prefix_len=0, page_ids=[1], read_slot=0, write_slot=1)
    kw = {f.name: getattr(shapes, f.name) for f in dataclasses.fields(shapes) if f.name != "decode"}
    batch = build_forward_batch([spec], page_size, as_numpy=True, **kw)
    sb = SamplingBatch.from_params([None], [0], shapes.num_logits)
    rep = replicated(mesh)
    host = (np.zeros(bucket(shapes.num_seqs, 1), np.int32), batch, sb,
            np.zeros(shapes.num_tokens, np.int32))
    host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                       sharding=rep), host)
    return (_abstract(params, param_shardings(params, mesh)),
            _abstract(pools, pool_shardings(pools, mesh))) + host


def compile_step(model_cfg: Any, shapes: StepShapes, *, params: Any, pools: PoolState,
                 page_size: int, kernels: str, mesh: Mesh) -> StepMemory:
    """Compile the engine's jitted step (``runner.jitted_sharded_step``) for ``mesh``'s devices
    at ``shapes`` and read its per-device memory and cost."""
    args = step_args(shapes, page_size, params, pools, mesh)
    fn = jitted_sharded_step(model_cfg, kernels, shapes.decode,
                             pool_shardings(pools, mesh), replicated(mesh), mesh)
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return StepMemory(
        argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes), flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=float(cost.get("optimal_seconds", 0.0) or 0.0))


def cache_budget_bytes(hbm_bytes: int, weight_bytes: int, step_bytes: int,
                       fraction: float) -> int:
    """What the cache may take per device: ``(hbm - weights - step) * fraction``; negative
    when the weights and the step alone do not fit (by that much, before the fraction)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cache.memory_fraction must be in (0, 1], got {fraction}")
    left = hbm_bytes - weight_bytes - step_bytes
    return int(left * fraction) if left > 0 else left


def pool_sizes_from_budget(budget_bytes: int, slot_bytes: int, page_bytes: int, *,
                           page_size: int, state_share: float = INTERIM_STATE_SHARE
                           ) -> tuple[int, int]:
    """Interim ``(num_mamba_slots, num_kv_tokens)`` for ``budget_bytes`` per device:
    ``state_share`` of the bytes to state slots, the rest to whole pages of KV. A model without
    linear (or attention) layers gives all bytes to the other pool. Replaced by the
    memory-budget work's function when it lands."""
    if budget_bytes <= 0:
        return 0, 0
    share = state_share if slot_bytes and page_bytes else float(bool(slot_bytes))
    slots = int(budget_bytes * share) // slot_bytes if slot_bytes else 0
    left = budget_bytes - slots * slot_bytes
    pages = left // page_bytes if page_bytes else 0
    return slots, pages * page_size
