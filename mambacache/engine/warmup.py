"""``Engine.warmup``: compile every step program a configuration can run, before the clock starts.

The set is ``engine/buckets.py``'s ``Buckets.program_set`` for the engine's config: decode
widths x pages per sequence (twice with ``scheduler.decode_steps`` > 1: the multi-step
programs), extend token buckets (x logits rows with verify rows), plus the
speculative slot copy and the host tier's gather / scatter widths (``engine/host_pools.py``).
``max_seq_len`` bounds the pages per sequence (default: the model's context): a request longer
than it still runs, on a program outside the warmed set.

Invariants: warm-up runs only on an idle engine (no request waiting, running or in flight) and
leaves it as it was: the dummy rows read and write only the dump page 0 and the zero slot 0
(whose writes are dropped), so the tree, the allocators, every cached page and state and the
request metrics are unchanged; only the compile counters of the warm-up move. After it, no step
of a request within the bounds compiles (``metrics()["programs_compiled"]`` stays 0).
"""

from __future__ import annotations

import time
from typing import Any

from absl import logging

from mambacache.engine.buckets import DETERMINISTIC_MIN_ROWS, Buckets

#: a warmed set larger than this is logged as too large (bound it with ``max_seq_len``)
LARGE_PROGRAM_SET = 64


def engine_buckets(cfg: Any, model_cfg: Any, max_seqs: int,
                   max_seq_len: int | None = None) -> Buckets:
    """The shape rules of an engine config; ``max_seq_len`` at most the model's context."""
    context = int(model_cfg.max_position_embeddings)
    if max_seq_len is None:
        max_seq_len = context
    if not 1 <= max_seq_len <= context:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be in [1, the model's context "
                         f"length {context}]")
    sched = cfg.scheduler
    k = cfg.speculative.num_draft_tokens if cfg.speculative.enabled else 0
    verify = sched.max_running_requests * (cfg.speculative.topk if k else 1) * (1 + k)
    interval = cfg.cache.checkpoint_interval or sched.chunked_prefill_size
    return Buckets(
        page_size=cfg.cache.page_size, max_seqs=max_seqs, max_seq_len=max_seq_len,
        max_step_tokens=sched.chunked_prefill_size + verify,
        max_logit_rows=verify if k else 0,
        max_snapshots=(2 * max_seqs + sched.chunked_prefill_size // max(interval, 1)
                       + (verify if k else 0)),  # a verify row: a state per draft + its window's
        min_rows=min_rows(cfg), decode_steps=sched.decode_steps)


def min_rows(cfg: Any) -> int:
    """The fewest rows a step program has: ``DETERMINISTIC_MIN_ROWS`` under
    ``model.deterministic`` (``engine/buckets.py``), else 0 (the buckets' own minimums)."""
    return DETERMINISTIC_MIN_ROWS if cfg.model.deterministic else 0


def warmup(engine: Any, max_seq_len: int | None = None,
           logit_controls: bool = False) -> dict[str, Any]:
    """Compile the engine's program set (module docstring); what it took:
    ``programs`` (shapes run), ``compiles`` (XLA compiles JAX reported: 0 when already warm),
    ``compile_s``, ``seconds`` (wall), ``decode_programs``, ``extend_programs``,
    ``max_seq_len``, ``controls_programs``. ``logit_controls``: also the penalty / grammar
    variant of every single-step shape (``engine/logit_controls.py``)."""
    if engine.has_unfinished() or engine.in_flight is not None:
        raise ValueError("warmup needs an idle engine: "
                         f"{len(engine.scheduler.waiting)} waiting, "
                         f"{len(engine.scheduler.running)} running, "
                         f"in flight: {engine.in_flight is not None}")
    runner = engine.runner
    out: dict[str, Any] = {"programs": 0, "compiles": 0, "compile_s": 0.0, "seconds": 0.0,
                           "decode_programs": 0, "extend_programs": 0,
                           "max_seq_len": max_seq_len, "controls_programs": 0}
    if not hasattr(runner, "warm"):  # the shadow runner compiles nothing
        return out
    buckets = engine_buckets(engine.cfg, engine.model_cfg, runner.max_seqs, max_seq_len)
    shapes = buckets.program_set()
    if len(shapes) > LARGE_PROGRAM_SET:
        logging.warning("warm-up compiles %d step programs (more than %d): bound them with "
                        "max_seq_len (now %d), scheduler.max_running_requests or "
                        "scheduler.chunked_prefill_size", len(shapes), LARGE_PROGRAM_SET,
                        buckets.max_seq_len)
    runner.use_buckets(buckets)
    before = runner.warm_compiles.snapshot()
    t0 = time.perf_counter()
    for shape in shapes:
        runner.warm(shape)
    controlled = [s for s in shapes if s.iterations == 1] if logit_controls else []
    for shape in controlled:
        runner.warm(shape, logit_controls=True)
    splits = _warm_splits(engine, shapes)
    if engine.cfg.speculative.enabled:
        runner.copy_slots([])  # the scratch end-state copy: slot 0 onto itself
    if engine.cache.host_tier is not None:  # [host tier] its copies, up to a whole sequence
        runner.warm_transfers(-(-buckets.max_seq_len // engine.cfg.cache.page_size))
    compiles, compile_s = runner.warm_compiles.snapshot()
    decode = sum(s.decode for s in shapes)
    out.update(programs=len(shapes), compiles=compiles - before[0],
               compile_s=compile_s - before[1], seconds=time.perf_counter() - t0,
               decode_programs=decode, extend_programs=len(shapes) - decode,
               max_seq_len=buckets.max_seq_len, device_splits=splits,
               controls_programs=len(controlled))
    logging.info("warm-up: %d step programs (%d compiled) in %.1f s", len(shapes),
                 out["compiles"], out["seconds"])
    return out


def _warm_splits(engine: Any, shapes: list) -> int:
    """[rebalance] Move the pools along every split (``Rebalancer.walk``) and compile the
    program set at each, the moves' resize programs included; returns the splits warmed.
    Tree entries above a split's rows are evicted on the way (the cache is usually empty at
    warm-up; otherwise it keeps what fits the smallest split)."""
    rb = engine.rebalancer
    if rb is None:
        return 1
    warmed = {rb.current}
    for k in rb.walk():
        rb.move_now(k, warm=True)
        if k not in warmed:
            warmed.add(k)
            for shape in shapes:
                engine.runner.warm(shape)
    return len(warmed)
