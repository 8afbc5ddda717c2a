"""Compile the warm-up's step programs while the weights load (``compile.while_loading``).

A step program needs only abstract params and pools (shapes, dtypes, shardings), so the
ahead-of-time compiles of ``engine/runners/warmup.py`` can start before ``load_model`` has read a
weight: ``LoadingCompiles.start`` builds a ``ModelRunner`` over ``ShapeDtypeStruct`` params
(``models.sizes.abstract_params``) and pools (``PoolState.create`` under ``jax.eval_shape``),
sized exactly as ``Engine`` sizes its own (``runner_kwargs``, ``create_pools``: one source for
both), and submits ``ModelRunner.compile_ahead`` for every program of the warm-up's set to a
thread pool. The engine's own runner later calls the SAME jitted callables
(``step_program.jitted_step`` / ``multi_step.jitted_multi_step`` are cached per model config),
and JAX keeps each lowered executable per callable and abstract arguments, so the warm-up's run
of a program compiled here compiles nothing.

``join`` (at warm-up) waits for the pool, raises the first failed compile as a ``RuntimeError``
naming the program, and hands back ``{(shape, logit_controls): seconds}`` for the programs
whose abstract state matches the engine's real one (``abstract`` of params, pools and the
carry); on a mismatch (another model config, a dtype or sharding the load chose) nothing is
reused and the warm-up compiles as without it (logged). Not under tensor parallelism nor
``cache.memory_fraction`` (their pools and shardings need the mesh and the loaded params):
``start`` returns None there and the warm-up compiles everything itself.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax
from absl import logging

from mambacache.config import EngineConfig
from mambacache.engine.step.buckets import StepShape

Job = tuple[StepShape, bool]  # (shape, logit_controls), as in ``engine/runners/warmup.py``


def runner_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """The ``ModelRunner`` keyword arguments of a (sized) engine config (the engine's and the
    loading compiles' runners are built from the same)."""
    from mambacache.engine.runners.sampler_program import separate_sampler_on
    from mambacache.engine.runners.warmup import min_rows
    from mambacache.engine.speculative.verify import max_rows

    mtp = cfg.speculative.method == "mtp"
    spec = cfg.speculative
    return dict(kernels=cfg.model.kernels, page_size=cfg.cache.page_size,
                max_seqs=max_rows(cfg), num_drafts=spec.num_draft_tokens if mtp else 0,
                num_alts=spec.topk - 1 if mtp else 0,
                spec_k=spec.num_draft_tokens if spec.enabled else 0, min_rows=min_rows(cfg),
                separate_sampler=separate_sampler_on(cfg.compile.separate_sampler,
                                                     jax.default_backend()))


def create_pools(cfg: EngineConfig, model_cfg: Any, sharding: Any = None) -> Any:
    """The engine's ``PoolState`` for a sized config (device arrays; under ``jax.eval_shape``
    their ``ShapeDtypeStruct``s)."""
    from mambacache.engine.runners.loading import model_dtype
    from mambacache.engine.runners.pools import PoolState
    from mambacache.engine.speculative.verify import num_state_slots

    return PoolState.create(model_cfg, cfg.cache.num_pages, cfg.cache.page_size,
                            num_state_slots(cfg), model_dtype(cfg), sharding=sharding,
                            extra_kv_layers=int(cfg.speculative.method == "mtp"))


def wanted(cfg: EngineConfig, warmup_expected: bool) -> bool:
    """Whether to compile while loading: ``"on"``; ``"auto"`` (the default) when the caller
    said it warms up next (the server, the benchmark); never ``"off"``."""
    mode = cfg.compile.while_loading
    return mode == "on" or (mode == "auto" and warmup_expected)


def _expected_model_config(cfg: EngineConfig) -> Any:
    """The model config ``Engine`` will hold, read without a weight (``parallel/plan.py``)."""
    from mambacache.engine.runners.loading import served_model_config
    from mambacache.parallel.plan import load_model_config

    return served_model_config(cfg, load_model_config(cfg))


class LoadingCompiles:
    """The warm-up's programs compiling in a thread pool; ``join`` collects them."""

    def __init__(self, model_cfg: Any, runner: Any, futures: dict[Any, Job], t0: float):
        self.model_cfg = model_cfg
        self.runner = runner  # the abstract runner whose compile_ahead ran (its counter too)
        self.futures = futures
        self.t0 = t0

    @classmethod
    def start(cls, cfg: EngineConfig, max_seq_len: int | None = None,
              threads: int | None = None) -> LoadingCompiles | None:
        """Submit every program of the warm-up's set (``warmup.engine_buckets``, sequences up
        to ``max_seq_len``) to ``threads`` threads (default ``compile.threads``); None where
        the shapes need the loaded model (tensor parallel, ``cache.memory_fraction``)."""
        if cfg.parallel.tensor_parallel > 1 or cfg.cache.memory_fraction:
            logging.info("compile.while_loading: not with tensor parallelism or "
                         "cache.memory_fraction; the warm-up compiles every program")
            return None
        from mambacache.engine.runners.loading import model_dtype
        from mambacache.engine.runners.model_runner import ModelRunner
        from mambacache.engine.runners.pools import size_pools
        from mambacache.engine.runners.warmup import compile_threads, engine_buckets
        from models.sizes import abstract_params

        t0 = time.perf_counter()
        model_cfg = _expected_model_config(cfg)
        cfg = size_pools(cfg, model_cfg, physical=True)[0]
        pools = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),  # uncommitted
                             jax.eval_shape(lambda: create_pools(cfg, model_cfg)))
        runner = ModelRunner(model_cfg, abstract_params(model_cfg, model_dtype(cfg)), pools,
                             **runner_kwargs(cfg))
        if cfg.scheduler.decode_steps > 1 and not runner.multi_step_ok:
            cfg = cfg.replace(**{"scheduler.decode_steps": 1})  # as ``Engine`` does
        shapes = engine_buckets(cfg, model_cfg, runner.max_seqs, max_seq_len).program_set()
        shapes.sort(key=lambda s: -s.compile_weight)
        n = compile_threads(cfg.compile.threads if threads is None else threads, len(shapes))
        pool = concurrent.futures.ThreadPoolExecutor(n, "mambacache-loading-compile")
        futures = {pool.submit(runner.compile_ahead, s, False): (s, False) for s in shapes}
        pool.shutdown(wait=False)  # its threads end with the last compile
        logging.info("compiling %d step programs in %d threads while the weights load",
                     len(shapes), n)
        return cls(model_cfg, runner, futures, t0)

    def cancel(self) -> None:
        """Drop the compiles not started yet (the engine failed to start)."""
        for fut in self.futures:
            fut.cancel()

    def join(self, runner: Any, model_cfg: Any) -> tuple[dict[Job, float], dict[str, Any]]:
        """Wait for every compile; ``({job: seconds} usable by ``runner``, a report)``.
        ``RuntimeError`` naming the program for the first compile that failed."""
        done: dict[Job, float] = {}
        for fut in concurrent.futures.as_completed(self.futures):
            shape, controls = self.futures[fut]
            try:
                done[(shape, controls)] = fut.result()
            except Exception as exc:  # surfaces here, at warm-up, never lost in the pool
                self.cancel()
                raise RuntimeError(f"compiling the step program {shape.describe()} while the "
                                   f"weights loaded failed: {exc}") from exc
        counter = self.runner.warm_compiles
        report = {"programs": len(done), "compiles": counter.compiles,
                  "cache_hits": counter.cache_hits, "seconds": time.perf_counter() - self.t0,
                  "usable": self.matches(runner, model_cfg)}
        if not report["usable"]:
            logging.warning("the programs compiled while the weights loaded were for other "
                            "abstract params or pools than the loaded model's: the warm-up "
                            "compiles them again")
            done = {}
        return done, report

    def matches(self, runner: Any, model_cfg: Any) -> bool:
        """Whether ``runner`` runs the programs compiled here: the same model config, jitted
        callables and abstract params, pools and carry."""
        from mambacache.engine.runners.model_runner import abstract

        def state(r: Any) -> Any:
            return jax.tree.map(abstract, (r.params, r.pools, r.future))

        return (model_cfg == self.model_cfg and runner.step_programs == self.runner.step_programs
                and state(runner) == state(self.runner))
