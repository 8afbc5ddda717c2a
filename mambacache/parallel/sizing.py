"""Device -> per-device byte budget for the cache: the ONE sizing path of the plan and the engine.

For a model, an engine config and a mesh (real devices, or a libtpu compile-only topology), it
compiles the engine's own step programs at their largest buckets (``largest_step_shapes``: the
widest prefill step and the decode step) on abstract, sharded params and pools (no weight is
allocated), reads ``memory_analysis()`` per device, and gives the cache what is left:

    budget = (hbm - weights - max(temp + generated code over the programs)) * memory_fraction

``weights`` is the largest device's share of the params as the devices lay them out
(``laid_out_bytes``; ``sharded_bytes`` is the logical count), with the shardings the engine
uses (``mesh.param_shardings``). The pools get the budget through ``cache/budget.py``
(``plan_pools``), with what one state slot and one KV page take on a device (``unit_bytes``,
from ``PoolState`` itself, layout padding included).

Invariants: every number is per device (under tensor parallelism the busiest device); the
pools' own bytes are never part of a compiled program's temporaries, which grow with the pools
by far less than the pools themselves (``step_memories``; checked on a TPU topology by
``tests/test_plan.py``). ``device_cache_budget`` is what an engine on real devices calls;
``parallel/plan.py`` runs the same steps on a topology.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mambacache.engine.runners.pools import PoolState
from mambacache.engine.runners.sampler_program import separate_sampler_on, step_callables
from mambacache.engine.sampling.sampler import SamplingBatch
from mambacache.engine.step.batch import build_forward_batch
from mambacache.engine.step.buckets import StepShape, bucket
from mambacache.engine.step.plan import SeqSpec
from mambacache.parallel.mesh import param_shardings, pool_shardings, replicated

if TYPE_CHECKING:
    from mambacache.config import EngineConfig
    from models.config import ModelConfig

#: the plan's cache.memory_fraction when the config sets none (SGLang's mem_fraction_static)
DEFAULT_MEMORY_FRACTION = 0.9


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


def memory_fraction(cfg: EngineConfig) -> float:
    """``cache.memory_fraction``, or ``DEFAULT_MEMORY_FRACTION`` when it is unset (0)."""
    return float(getattr(cfg.cache, "memory_fraction", 0.0) or DEFAULT_MEMORY_FRACTION)


def largest_step_shapes(cfg: EngineConfig, model_cfg: ModelConfig) -> dict[str, StepShape]:
    """The engine's widest programs (``warmup.engine_buckets``' program set, pages for the
    model's whole context): the extend step with the most tokens and logits rows, and the
    widest decode step."""
    from mambacache.engine.runners.warmup import engine_buckets
    from mambacache.engine.speculative.verify import max_rows

    programs = engine_buckets(cfg, model_cfg,
                              bucket(max_rows(cfg), 1)).program_set()
    return {
        "prefill": max((s for s in programs if not s.decode),
                       key=lambda s: (s.num_tokens, s.num_logits, s.num_pages_per_seq)),
        "decode": max((s for s in programs if s.decode),
                      key=lambda s: (s.num_seqs, s.num_pages_per_seq)),
    }


def abstract_params(model_cfg: ModelConfig, dtype: Any) -> Any:
    """The params' ``ShapeDtypeStruct`` tree (``models.sizes``); nothing allocated."""
    from models.sizes import abstract_params as shapes

    return shapes(model_cfg, dtype)


def abstract_pools(model_cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int,
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
    try:
        compiled = jax.jit(lambda *a: None, keep_unused=True).lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:
        if not out_of_memory(e):
            raise
        return sharded_bytes(tree, shardings)  # over the HBM already: the logical count says so
    return int(compiled.memory_analysis().argument_size_in_bytes)


def out_of_memory(e: Exception) -> bool:
    """The compiler refused a program for its memory (``RESOURCE_EXHAUSTED``)."""
    return "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e)


def unit_bytes(model_cfg: ModelConfig, mesh: Mesh, page_size: int, dtype: Any) -> tuple[int, int]:
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


def step_args(shapes: StepShape, page_size: int, params: Any, pools: PoolState,
              mesh: Mesh) -> tuple:
    """Abstract arguments of the runner's step (``step_program._step``), placed as the engine places
    them: params and pools sharded, the batch and sampling rows replicated."""
    spec = SeqSpec(tokens=[1], prefix_len=0, page_ids=[1], read_slot=0, write_slot=1)
    batch = build_forward_batch([spec], page_size, as_numpy=True, **shapes.sizes())
    sb = SamplingBatch.from_params([None], [0], shapes.num_logits)
    rep = replicated(mesh)
    host = (np.zeros(bucket(shapes.num_seqs, 1), np.int32), batch, sb,
            np.zeros(shapes.num_tokens, np.int32))
    host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype,
                                                       sharding=rep), host)
    return (_abstract(params, param_shardings(params, mesh)),
            _abstract(pools, pool_shardings(pools, mesh))) + host


def compile_step(model_cfg: ModelConfig, shapes: StepShape, *, params: Any, pools: PoolState,
                 page_size: int, kernels: str, mesh: Mesh,
                 separate_sampler: bool = False) -> StepMemory:
    """Compile the engine's jitted step (``step_program.jitted_sharded_step``) for ``mesh``'s
    devices at ``shapes`` and read its per-device memory and cost. ``separate_sampler``
    (``engine/runners/sampler_program.py``): the step without its sampler and the sampler
    program, both compiled; temporaries the larger one's, code and cost summed."""
    args = step_args(shapes, page_size, params, pools, mesh)
    fn = step_callables(model_cfg, kernels, separate=separate_sampler,
                        pool_sh=pool_shardings(pools, mesh), out_sh=replicated(mesh),
                        mesh=mesh)[shapes.decode]
    compiled = fn.lower(*args).compile()
    if isinstance(compiled, tuple):  # [compile.separate_sampler] (step, sampler)
        return _combined(*(_memory(c) for c in compiled))
    return _memory(compiled)


def _combined(step: StepMemory, sampler: StepMemory) -> StepMemory:
    """One step run as two programs: the step's arguments and outputs, the larger of the two
    temporaries (they run one after the other), code, FLOPs, bytes and seconds summed."""
    return dataclasses.replace(
        step, temp_bytes=max(step.temp_bytes, sampler.temp_bytes),
        code_bytes=step.code_bytes + sampler.code_bytes, flops=step.flops + sampler.flops,
        bytes_accessed=step.bytes_accessed + sampler.bytes_accessed,
        optimal_seconds=step.optimal_seconds + max(sampler.optimal_seconds, 0.0))


def _memory(compiled: Any) -> StepMemory:
    """``compiled``'s ``StepMemory``."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return StepMemory(
        argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(mem.generated_code_size_in_bytes), flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=float(cost.get("optimal_seconds", 0.0) or 0.0))


def step_memories(model_cfg: ModelConfig, cfg: EngineConfig, shapes: dict[str, StepShape], *,
                  params: Any, mesh: Mesh, dtype: Any, kernels: str) -> dict[str, StepMemory]:
    """Every program of ``shapes`` compiled for ``mesh`` with pools of 64 pages and
    ``max_running_requests + 1`` slots: the pools' own bytes are ``unit_bytes`` arithmetic and
    the donated pools alias their outputs. The temporaries still grow a little with the pools
    on TPU (tiny decode on v6e: +1.02 MB for +960 pages and +75 slots), far less than the pools
    (``tests/test_plan.py``: under a tenth), inside the ``1 - memory_fraction`` headroom."""
    slots = cfg.scheduler.max_running_requests + 1
    pools = abstract_pools(model_cfg, 64, cfg.cache.page_size, slots, dtype)
    platform = next(iter(mesh.devices.flat)).platform
    split = separate_sampler_on(cfg.compile.separate_sampler, platform)
    return {name: compile_step(model_cfg, sh, params=params, pools=pools,
                               page_size=cfg.cache.page_size, kernels=kernels, mesh=mesh,
                               separate_sampler=split)
            for name, sh in shapes.items()}


def device_cache_budget(cfg: EngineConfig, model_cfg: ModelConfig, params: Any, mesh: Mesh) -> int:
    """The engine's cache budget per device on this machine's devices (``mesh``), by the plan's
    path: the allocator's ``bytes_limit`` minus the params' device share on ``mesh`` minus the
    largest step program's temporaries and code, times ``cache.memory_fraction``.
    ``ValueError`` when nothing is left or the backend reports no memory (CPU)."""
    from mambacache.cache.budget import budget_from_fraction
    from mambacache.parallel.topology import local_topology

    hbm = local_topology().chip.hbm_bytes
    dtype = jax.tree.leaves(params)[0].dtype
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    # the share each device holds once placed on ``mesh`` (params may still sit on one device)
    weights = laid_out_bytes(abstract, param_shardings(abstract, mesh))
    mems = step_memories(model_cfg, cfg, largest_step_shapes(cfg, model_cfg), params=abstract,
                         mesh=mesh, dtype=dtype, kernels=cfg.model.kernels)
    step = max(m.temp_bytes + m.code_bytes for m in mems.values())
    return budget_from_fraction(hbm, weights, step, memory_fraction(cfg))
