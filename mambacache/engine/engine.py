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
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from mambacache.cache.radix import make_cache_from_config
from mambacache.config import EngineConfig
from mambacache.engine.checks import check_engine_integrity, validate_request
from mambacache.engine.loading import load_model, model_dtype
from mambacache.engine.metrics import EngineMetrics
from mambacache.engine.overlap import overlap_step
from mambacache.engine.request import Request, RequestOutput, Status
from mambacache.engine.sampling_params import SamplingParams
from mambacache.engine.scheduler import Scheduler
from mambacache.engine.speculative import num_state_slots, spec_metrics
from mambacache.engine.step_plan import ScheduledSeq, first_logit_row
from mambacache.engine.thread_guard import owned

__all__ = ["Engine", "load_model", "model_dtype"]

#: consecutive steps that schedule nothing while requests are unfinished before ``generate``
#: gives up (the scheduler is deterministic: one such step already means none will follow).
MAX_IDLE_STEPS = 2


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, *, model: tuple[Any, Any] | None = None,
                 runner: Any = None):
        """``model``: an already loaded ``(model_cfg, params)`` to share between engines.
        ``runner``: a runner to use instead of the model's (``ShadowRunner``: no model, no
        device; its ``model_cfg`` gives the vocabulary and context length)."""
        self.cfg = cfg = cfg if cfg is not None else EngineConfig()
        self.mesh = None  # [parallel] a jax Mesh when parallel.tensor_parallel > 1
        if runner is not None:
            self.model_cfg, self.runner = runner.model_cfg, runner
        else:
            self.model_cfg, params = model if model is not None else load_model(cfg)
            self.runner = self._model_runner(params)
        self.scheduler = Scheduler(cfg, self._new_cache())
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.stats = EngineMetrics()
        self.in_flight = None  # [overlap] the dispatched step whose tokens are not read yet
        # the step loop: overlapped (engine/overlap.py) unless off or speculative (verify rows)
        self.overlap = cfg.scheduler.overlap and not cfg.speculative.enabled
        if cfg.scheduler.overlap and cfg.speculative.enabled:
            logging.info("scheduler.overlap with speculative decoding: the synchronous loop runs")
        logging.info("engine ready: %s, %d KV pages of %d tokens, %d state slots, cache %s",
                     type(self.runner).__name__, cfg.cache.num_pages, cfg.cache.page_size,
                     cfg.cache.num_mamba_slots, "on" if cfg.cache.enable else "off")

    def _model_runner(self, params: Any) -> Any:
        from mambacache.engine.pools import PoolState
        from mambacache.engine.runner import ModelRunner

        cfg = self.cfg
        if cfg.parallel.tensor_parallel > 1:
            from mambacache.parallel.mesh import make_mesh, validate_tensor_parallel

            validate_tensor_parallel(self.model_cfg, cfg.parallel.tensor_parallel)
            self.mesh = make_mesh(cfg.parallel.tensor_parallel)
        mtp = cfg.speculative.method == "mtp"
        if mtp and "mtp" not in params:
            raise ValueError("speculative.method 'mtp' needs a model with an MTP head: "
                             f"{self.model_cfg.family} params have none (num_mtp_layers "
                             f"{self.model_cfg.num_mtp_layers})")
        pools = PoolState.create(self.model_cfg, cfg.cache.num_pages, cfg.cache.page_size,
                                 num_state_slots(cfg), model_dtype(cfg),
                                 sharding=self._pool_sharding(), extra_kv_layers=int(mtp))
        self.runner = ModelRunner(self.model_cfg, params, pools, kernels=cfg.model.kernels,
                                  page_size=cfg.cache.page_size,
                                  max_seqs=cfg.scheduler.max_running_requests,
                                  num_drafts=cfg.speculative.num_draft_tokens if mtp else 0)
        if self.mesh is not None:
            from mambacache.parallel.mesh import shard_engine

            shard_engine(self)
        return self.runner

    def _pool_sharding(self):
        """Pools are created already sharded over the mesh (no whole pool on one device)."""
        if self.mesh is None:
            return None
        from mambacache.parallel.mesh import pool_field_sharding

        return pool_field_sharding(self.mesh)

    def _new_cache(self):
        return make_cache_from_config(self.cfg.cache)  # every cache key, speculative states too

    @property
    def cache(self):
        return self.scheduler.cache

    # ---- requests --------------------------------------------------------------------------
    @owned
    def add_request(self, prompt: Sequence[int] | np.ndarray, params: SamplingParams | None = None,
                    *, extra_key: str | None = None) -> int:
        """Queue a request; bad input is a ``ValueError`` raised before anything is held."""
        params = params if params is not None else SamplingParams()
        tokens = validate_request(prompt, params, extra_key, self.model_cfg, self.cfg)
        rid = next(self._ids)
        self.requests[rid] = Request(rid, tokens, params, extra_key=extra_key)
        self.scheduler.waiting.append(self.requests[rid])
        return rid

    @owned
    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request and free everything it holds; its output so far, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is Status.WAITING:
            self.scheduler.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
        elif req.status is Status.RUNNING:
            self.scheduler.finish(req, "abort", keep=False)
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
        """Schedule, run and account one step; returns the requests that finished in it.
        [overlap] Dispatches step N+1, then reads step N (``engine/overlap.py``): the finished
        requests are those whose tokens were read in this call."""
        if self.overlap:
            return overlap_step(self)
        t_start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self._flush_slot_copies()  # ends released while scheduling (preemption)
        if not scheduled:
            return []
        if self.cfg.scheduler.check_integrity_every_step:
            self.scheduler.check_step(scheduled)
        t_dispatch = time.perf_counter()
        try:
            tokens, logprobs = self.runner.run(scheduled)
        except AssertionError:
            raise  # a broken invariant (the shadow runner's data-flow check) is a bug: no retry
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests only
            return self._fail_step(scheduled, err)
        # Overlap: the step runs asynchronously; account progress and publish finished prefills
        # to the tree while it does. Only the sampled tokens need the device.
        # A verify row's progress depends on its sampled tokens: it is recorded after the sync.
        for s in scheduled:
            if not s.drafts:
                self._advance(s)
        t_wait = time.perf_counter()
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        self._observe_drafts(scheduled)
        t_synced = time.perf_counter()
        finished = self._collect(scheduled, tokens, logprobs, t_synced)
        self._flush_slot_copies()  # ends released by finishes
        now = time.perf_counter()
        self.stats.on_step(self, scheduled, host_s=now - t_start - (t_synced - t_wait),
                           wall_s=now - t_start, busy_s=t_synced - t_dispatch, t_start=t_start)
        if self.cfg.scheduler.check_integrity_every_step:
            self.check_integrity()
        return finished

    def _collect(self, scheduled: list[ScheduledSeq], tokens: np.ndarray, logprobs: np.ndarray,
                 now: float) -> list[RequestOutput]:
        """Append each row's sampled token(s) (``tokens``, ``logprobs``: one per logits row);
        the requests that finished."""
        finished = []
        for s, i in zip(scheduled, first_logit_row(scheduled), strict=True):
            if s.drafts:
                out = self._accept_verify(s, tokens[i:i + len(s.drafts) + 1],
                                          logprobs[i:i + len(s.drafts) + 1], now)
            else:
                out = s.samples and self._append(s.req, int(tokens[i]), float(logprobs[i]), now)
            if out:
                finished.append(out)
        return finished

    def _accept_verify(self, s: ScheduledSeq, tokens: np.ndarray, logprobs: np.ndarray,
                       now: float) -> RequestOutput | None:
        """[speculative] Emit the verified prefix of a verify row plus the target's next token
        (``engine/speculative.py``); the request's state becomes the one after them."""
        req, n_out = s.req, len(s.req.output_ids)
        emitted = self.scheduler.speculative.accept(
            self.scheduler, s, tokens,
            lambda j: self._finish_reason(req, int(tokens[j]), n_out + j + 1) is not None)
        out = None
        for j in range(emitted):
            out = self._append(req, int(tokens[j]), float(logprobs[j]), now)
        return out

    def _observe_drafts(self, scheduled: list[ScheduledSeq]) -> None:
        """[speculative mtp] Keep the drafts the step made for each row's next step."""
        drafts = getattr(self.runner, "last_drafts", None)
        if drafts is not None:
            self.scheduler.speculative.drafter.observe(scheduled, np.asarray(drafts))

    def _flush_slot_copies(self) -> None:
        """[speculative] Copy scratch end states into the running slots the tree adopted, before
        any later step can read them (the pools' data dependency orders it)."""
        spec = self.scheduler.speculative
        if spec is not None and spec.slot_copies:
            self.runner.copy_slots(spec.take_copies())

    def _advance(self, s: ScheduledSeq) -> None:
        self.scheduler.advance(s)
        if s.end - s.start > 1 or s.start < s.req.prompt_len:
            self.stats.computed_prefill_tokens += s.end - s.start

    def _append(self, req: Request, token: int, logprob: float,
                now: float) -> RequestOutput | None:
        """Record a sampled token; finish the request if it is done."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.token_times_s.append(now)
        if req.first_token_s is None:
            req.first_token_s = now
        reason = self._finish_reason(req, token, len(req.output_ids))
        if reason is None:
            return None
        self.scheduler.finish(req, reason)
        self.stats.on_finish(req)
        self.requests.pop(req.request_id, None)
        return req.to_output()

    def _finish_reason(self, req: Request, token: int, num_out: int) -> str | None:
        """Why ``req`` ends with ``token`` as its ``num_out``-th output token (None: it goes on)."""
        p = req.params
        eos = getattr(self.model_cfg, "eos_token_id", None)
        if token in p.stop_token_ids or (not p.ignore_eos and eos is not None and token == eos):
            return "stop"
        if num_out >= p.max_new_tokens:
            return "length"
        return None

    def _fail_step(self, scheduled: list[ScheduledSeq], err: Exception, *,
                   lost: bool | None = None) -> list[RequestOutput]:
        """A step raised: fail its requests; if the donated pools are gone (``lost``: the runner
        says), everything running or with a token in flight fails and the pools and the cache
        start empty (no state can outlive its pools)."""
        victims = [s.req for s in scheduled]
        lost = self.runner.pools_lost() if lost is None else lost
        if lost:
            victims += [r for r in self.scheduler.running if r not in victims]
            victims += [r for r in self.scheduler.waiting if r.num_pending]  # [overlap]
        outs = []
        logging.warning("step failed (%s: %s): %d requests fail%s", type(err).__name__, err,
                        len(victims), ", pools lost: the cache starts empty" if lost else "")
        for req in victims:
            req.error = f"{type(err).__name__}: {err}"
            if lost:
                queue = self.scheduler.running if req.status is Status.RUNNING \
                    else self.scheduler.waiting
                queue.remove(req)
                self.scheduler.num_finished += 1
                req.status, req.finish_reason = Status.FINISHED, "error"
            else:
                self.scheduler.finish(req, "error", keep=False)
            self.requests.pop(req.request_id, None)
            outs.append(req.to_output())
        if lost:
            self.runner.reset_pools()
            if self.scheduler.speculative is not None:
                self.scheduler.speculative.reset()
            self.scheduler.cache = self._new_cache()
        self.stats.failed_steps += 1
        return outs

    @owned
    def warmup(self, max_seq_len: int | None = None) -> dict[str, Any]:
        """Compile every step program this configuration can run (sequences up to
        ``max_seq_len`` tokens; default the model's context) on an idle engine, leaving its
        cache, pools and metrics as they were (``engine/warmup.py``). Returns ``programs``,
        ``compiles`` (XLA compiles JAX reported), ``compile_s``, ``seconds``."""
        from mambacache.engine.warmup import warmup

        return warmup(self, max_seq_len)

    # ---- [parallel] warm restarts: mambacache/checkpoint.py -------------------------------------
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
        return {**self.stats.as_dict(self), **spec_metrics(self.scheduler.speculative)}

    @owned
    def check_integrity(self) -> None:
        """Raise if any invariant of the tree, the pools or the requests is broken."""
        check_engine_integrity(self)
