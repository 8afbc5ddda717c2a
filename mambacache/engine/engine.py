"""``Engine``: the public serving API (DESIGN.md) over the scheduler, the cache and the runner.

    engine = Engine(EngineConfig.load("configs/tiny_qwen3_next.toml"))
    outs = engine.generate([[5, 17, 3, 99]], SamplingParams(max_new_tokens=8))

``add_request`` / ``step`` / ``abort`` drive it incrementally (the benchmark does).

One thread at a time (``engine/thread_guard.py``): a call from a second thread while another
is inside the engine (a step running) is a ``RuntimeError`` naming both; nothing is serialised
or interleaved. The server drives the engine from its one ``EngineLoop`` thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from absl import logging

from mambacache.cache.base import CacheBase
from mambacache.config import EngineConfig
from mambacache.engine.checks import check_engine_integrity, validate_request
from mambacache.engine.leases.cache_manager import CacheManager
from mambacache.engine.metrics import EngineMetrics
from mambacache.engine.request import FINISHED, RUNNING, WAITING, Request, RequestOutput
from mambacache.engine.runner_protocol import InFlight, Runner
from mambacache.engine.runners.loading import load_model, model_dtype, served_model_config
from mambacache.engine.sampling.params import SamplingParams
from mambacache.engine.scheduler import Scheduler
from mambacache.engine.speculative.verify import spec_metrics
from mambacache.engine.step_loop import StepLoop
from mambacache.engine.thread_guard import owned

if TYPE_CHECKING:
    from mambacache.engine.runners.pools import PoolState

__all__ = ["Engine", "load_model", "model_dtype"]

#: consecutive steps that schedule nothing while requests are unfinished before ``generate``
#: gives up (the scheduler is deterministic: one such step already means none will follow).
MAX_IDLE_STEPS = 2


def prefill_grid(cfg: EngineConfig) -> int:
    """[deterministic] The prefill chunk grid (``CacheManager``'s docstring): the Pallas
    kernels' ``DETERMINISTIC_GRID`` when ``model.deterministic`` runs them (``model.kernels``
    "pallas", or "auto" off CPU), else 0 (the references compute token by token).
    ``ValueError`` for what the grid cannot serve: speculative decoding (a verify row computes
    its tokens in one chunk, a decode one at a time) and a chunked prefill size below it."""
    if not cfg.model.deterministic or cfg.model.kernels == "reference":
        return 0
    from pallas_kernels import ops

    if ops.resolve_impl(cfg.model.kernels) != "pallas":
        return 0
    grid = ops.DETERMINISTIC_GRID
    if cfg.speculative.enabled:
        raise ValueError(f"speculative.method {cfg.speculative.method!r} cannot run with "
                         "model.deterministic and the Pallas kernels: a verify row computes "
                         "its tokens in one chunk, a decode one at a time; use "
                         "model.kernels = 'reference' or speculative.method = 'none'")
    if cfg.scheduler.chunked_prefill_size < grid:
        raise ValueError(f"scheduler.chunked_prefill_size ({cfg.scheduler.chunked_prefill_size})"
                         f" must be >= the deterministic prefill grid ({grid}) with the Pallas "
                         "kernels: prefills are cut only at multiples of it")
    return grid


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, *, model: tuple[Any, Any] | None = None,
                 runner: Runner | None = None, warmup_max_seq_len: int | None = None):
        """``model``: an already loaded ``(model_cfg, params)`` to share between engines.
        ``runner``: a runner to use instead of the model's (``ShadowRunner``: no model, no
        device; its ``model_cfg`` gives the vocabulary and context length).
        ``warmup_max_seq_len``: the caller warms up next with this bound (0: the model's
        context); with ``compile.while_loading`` "auto" the warm-up's programs then compile
        while the weights load (``engine/runners/loading_compiles.py``)."""
        self.cfg = cfg = cfg if cfg is not None else EngineConfig()
        self.mesh = None  # [parallel] a jax Mesh when parallel.tensor_parallel > 1
        self.loading_compiles: Any = None  # [compile.while_loading] joined by ``warmup``
        if runner is not None:
            self.model_cfg, self.runner = cfg.model.capped(runner.model_cfg), runner
            if cfg.cache.has_budget:  # [issue 25] a byte budget: derive the pools
                from mambacache.engine.runners.pools import size_pools

                self.cfg = cfg = size_pools(cfg, self.model_cfg)[0]
        else:
            from mambacache.engine.runners.compile_cache import use_compile_cache

            use_compile_cache(cfg.compile)  # before the first compile (the random init's)
            if model is None:
                self._start_loading_compiles(warmup_max_seq_len)
            try:
                self.model_cfg, params = model if model is not None else load_model(cfg)
            except BaseException:
                if self.loading_compiles is not None:
                    self.loading_compiles.cancel()
                raise
            self.model_cfg = served_model_config(cfg, self.model_cfg)
            self.runner = self._model_runner(params)
            cfg = self.cfg  # [issue 25] pools sized from the byte budget in _model_runner
        if cfg.cache.host_memory_bytes and cfg.cache.enable:  # [host tier] its byte units
            from mambacache.engine.runners.pools import model_byte_sizes

            state, kv = model_byte_sizes(cfg, self.model_cfg)
            self.cfg = cfg = cfg.replace(**{"cache.state_bytes": state,
                                            "cache.kv_bytes_per_token": kv})
        if cfg.scheduler.decode_steps > 1 and not getattr(self.runner, "multi_step_ok", True):
            logging.info("scheduler.decode_steps %d on %s (tensor parallel or speculative): "
                         "one decode iteration per step", cfg.scheduler.decode_steps,
                         type(self.runner).__name__)
            self.cfg = cfg = cfg.replace(**{"scheduler.decode_steps": 1})
        self.manager = CacheManager(cfg.cache, transfer=getattr(self.runner, "transfer", None),
                                    loads=self.runner if hasattr(self.runner, "finish_load")
                                    else None, grid=prefill_grid(cfg))
        self.scheduler = Scheduler(cfg, self.manager)
        self.rebalancer = None  # [rebalance] the device split moving between steps
        if cfg.cache.rebalance and cfg.cache.device_splits:
            from mambacache.engine.runners.rebalance import Rebalancer

            self.rebalancer = Rebalancer(self)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.stats = EngineMetrics()
        # the step loop: overlapped (depth 1) unless off; with speculative decoding only on a
        # runner that shifts chained rows on the device (``spec_k``; not the shadow runner)
        # and with chains only (draft trees, ``speculative.topk`` > 1, run synchronously)
        spec = cfg.speculative
        chains = getattr(self.runner, "spec_k", 0) > 0 and spec.topk == 1
        self.overlap = cfg.scheduler.overlap and (chains or not spec.enabled)
        self.loop = StepLoop(self, depth=int(self.overlap))
        if cfg.scheduler.overlap and not self.overlap:
            logging.info("scheduler.overlap with speculative decoding (topk %d) on %s: the "
                         "synchronous loop runs", spec.topk, type(self.runner).__name__)
        logging.info("engine ready: %s, %d KV pages of %d tokens, %d state slots, cache %s",
                     type(self.runner).__name__, cfg.cache.num_pages, cfg.cache.page_size,
                     cfg.cache.num_mamba_slots, "on" if cfg.cache.enable else "off")

    def _start_loading_compiles(self, warmup_max_seq_len: int | None) -> None:
        """[compile.while_loading] Start the warm-up's compiles before the weights load."""
        from mambacache.engine.runners.loading_compiles import LoadingCompiles, wanted

        if self.cfg.compile.ahead_of_time and wanted(self.cfg, warmup_max_seq_len is not None):
            self.loading_compiles = LoadingCompiles.start(self.cfg, warmup_max_seq_len or None)

    def _model_runner(self, params: Any) -> Runner:
        from mambacache.engine.runners.loading_compiles import create_pools, runner_kwargs
        from mambacache.engine.runners.model_runner import ModelRunner
        from mambacache.engine.runners.pools import size_pools

        cfg = self.cfg
        if cfg.parallel.tensor_parallel > 1:
            from mambacache.parallel.mesh import make_mesh, validate_tensor_parallel

            validate_tensor_parallel(self.model_cfg, cfg.parallel.tensor_parallel)
            self.mesh = make_mesh(cfg.parallel.tensor_parallel)
        # [issue 25] cache.memory_bytes / memory_fraction -> pool sizes (engine/runners/pools.py)
        device_budget = None
        if cfg.cache.memory_fraction:
            from mambacache.parallel.mesh import make_mesh
            from mambacache.parallel.sizing import device_cache_budget

            device_budget = device_cache_budget(cfg, self.model_cfg, params,
                                                self.mesh or make_mesh(1))
        sizes = None  # per device: tensor parallelism shards the pools' rows
        if self.mesh is not None and cfg.cache.has_budget:
            from mambacache.parallel.sizing import unit_bytes

            slot_b, page_b = unit_bytes(self.model_cfg, self.mesh, cfg.cache.page_size,
                                        model_dtype(cfg))
            sizes = (slot_b, -(-page_b // cfg.cache.page_size))
        self.cfg = cfg = size_pools(cfg, self.model_cfg, memory_bytes=device_budget,
                                    physical=True, device_sizes=sizes)[0]
        mtp = cfg.speculative.method == "mtp"
        if mtp and "mtp" not in params:
            raise ValueError("speculative.method 'mtp' needs a model with an MTP head: "
                             f"{self.model_cfg.family} params have none (num_mtp_layers "
                             f"{self.model_cfg.num_mtp_layers})")
        pools = create_pools(cfg, self.model_cfg, sharding=self._pool_sharding())
        self.runner = ModelRunner(self.model_cfg, params, pools, **runner_kwargs(cfg))
        if self.mesh is not None:
            from mambacache.parallel.mesh import shard_engine

            self.mesh = shard_engine(self)
        return self.runner

    def _pool_sharding(self):
        """Pools are created already sharded over the mesh (no whole pool on one device)."""
        if self.mesh is None:
            return None
        from mambacache.parallel.mesh import pool_field_sharding

        return pool_field_sharding(self.mesh)

    @property
    def cache(self) -> CacheBase:
        return self.manager.cache

    @property
    def in_flight(self) -> InFlight | None:
        """[overlap] The dispatched step whose tokens are not read yet."""
        return self.loop.in_flight

    # ---- requests --------------------------------------------------------------------------
    @owned
    def add_request(self, prompt: Sequence[int] | np.ndarray, params: SamplingParams | None = None,
                    *, extra_key: str | None = None) -> int:
        """Queue a request; bad input is a ``ValueError`` raised before anything is held."""
        params = params if params is not None else SamplingParams()
        tokens = validate_request(prompt, params, extra_key, self.model_cfg,
                                  self.manager.kv_capacity_tokens)
        rid = next(self._ids)
        self.requests[rid] = Request(rid, tokens, params, extra_key=extra_key,
                                     lease=self.manager.lease())
        self.scheduler.waiting.append(self.requests[rid])
        return rid

    @owned
    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request and free everything it holds; its output so far, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is WAITING:
            self.scheduler.waiting.remove(req)
            req.status, req.finish_reason = FINISHED, "abort"
        elif req.status is RUNNING:
            self.scheduler.finish(req, "abort", keep=False)
        if not self.has_unfinished():  # [host tier] idle: no load left in flight
            self.manager.land_loads()
        return req.to_output()

    def has_unfinished(self) -> bool:
        """Requests waiting or running; [overlap] a request whose sampled token is not read yet
        is one of them (a step in flight with no such row holds only dropped tokens)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    @owned
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, extra_keys: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in the order of ``prompts``."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        keys = extra_keys if extra_keys is not None else [None] * len(prompts)
        rids = [self.add_request(p, sp, extra_key=k)
                for p, sp, k in zip(prompts, params, keys, strict=True)]
        done: dict[int, RequestOutput] = {}
        idle = 0
        while any(r not in done for r in rids):
            before = self.scheduler.progress_marker()
            for out in self.step():
                done[out.request_id] = out
            idle = idle + 1 if self.scheduler.progress_marker() == before else 0
            if idle >= MAX_IDLE_STEPS or (not self.has_unfinished()
                                          and any(r not in done for r in rids)):
                raise RuntimeError(f"no progress in {idle} steps: {self.scheduler.describe()}")
        return [done[r] for r in rids]

    # ---- one step --------------------------------------------------------------------------
    @owned
    def step(self) -> list[RequestOutput]:
        """Schedule, run and account one step (``engine/step_loop.py``); the requests that
        finished in it. [overlap] Dispatches step N+1, then reads step N: the finished requests
        are those whose tokens were read in this call."""
        if self.rebalancer is not None:  # [rebalance] between steps: drain, move the pools
            self.rebalancer.poll()
        return self.loop.step()

    @owned
    def warmup(self, max_seq_len: int | None = None, logit_controls: bool = False,
               progress: Any = None) -> dict[str, Any]:
        """Compile every step program this configuration can run (sequences up to
        ``max_seq_len`` tokens; default the model's context) on an idle engine, leaving its
        cache, pools and metrics as they were (``engine/runners/warmup.py``); ``logit_controls``:
        the penalty / grammar variants too. Returns ``programs``, ``compiles`` (XLA compiles JAX
        reported), ``cache_hits``, ``compile_s``, ``seconds``, ``controls_programs``,
        ``program_list``; ``progress(line)`` hears each stage."""
        from mambacache.engine.runners.warmup import warmup

        self.warmup_stats = warmup(self, max_seq_len, logit_controls, progress)
        return self.warmup_stats

    # ---- [parallel] warm restarts: parallel/checkpoint.py -----------------------------------
    @property
    def pools(self) -> PoolState:
        """The device pools (a model runner's; the shadow runner has none)."""
        return self.runner.pools

    def replace_pools(self, pools: PoolState) -> None:
        """Swap in ``pools`` of the same layout (restored rows); on an idle engine only."""
        if self.has_unfinished():
            raise ValueError(f"cannot replace the pools while requests run "
                             f"({len(self.scheduler.running)} running, "
                             f"{len(self.scheduler.waiting)} waiting)")
        self.runner.place(self.runner.params, pools)

    @owned
    def save(self, path: str) -> None:
        """Save the whole cache (tree + the pool rows it owns) to directory ``path``; idle only."""
        from mambacache.parallel.checkpoint import save_cache

        save_cache(self, path)

    @owned
    def restore(self, path: str) -> None:
        """Load a cache saved by ``save`` into this idle engine; ``ValueError`` if the model or
        the cache layout differ."""
        from mambacache.parallel.checkpoint import restore_cache

        restore_cache(self, path)

    # ---- observability ---------------------------------------------------------------------
    @owned
    def metrics(self) -> dict[str, Any]:
        out = {**self.stats.as_dict(self), **spec_metrics(self.scheduler.speculative)}
        if self.rebalancer is not None:
            out.update(self.rebalancer.metrics())
        return out

    @owned
    def check_integrity(self) -> None:
        """Raise if any invariant of the tree, the pools or the requests is broken."""
        check_engine_integrity(self)
