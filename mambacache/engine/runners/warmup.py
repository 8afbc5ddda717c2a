"""``Engine.warmup``: compile every step program a configuration can run, before the clock starts.

The set is ``engine/step/buckets.py``'s ``Buckets.program_set`` for the engine's config: decode
widths x pages per sequence (twice with ``scheduler.decode_steps`` > 1: the multi-step
programs), extend token buckets (x logits rows with verify rows), plus the
speculative slot copy and the host tier's gather / scatter widths
(``engine/runners/host_pools.py``). ``max_seq_len`` bounds the pages per sequence (default: the
model's context): a request longer than it still runs, on a program outside the warmed set.

Ahead of time (``compile.ahead_of_time``, the default): every program is first lowered from
abstract shapes and compiled in a thread pool (``compile.threads``), nothing allocated; JAX keeps
each executable, so running the program once on the dummy rows after compiles nothing. With
JAX's persistent compile cache (``engine/runners/compile_cache.py``) a restart loads every program
from disk (``cache_hits``) instead. The report lists each program's shape and compile seconds.

Invariants: warm-up runs only on an idle engine (no request waiting, running or in flight) and
leaves it as it was: the dummy rows read and write only the dump page 0 and the zero slot 0
(whose writes are dropped), so the tree, the allocators, every cached page and state and the
request metrics are unchanged; only the compile counters of the warm-up move. After it, no step
of a request within the bounds compiles (``metrics()["programs_compiled"]`` stays 0).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from mambacache.engine.step.buckets import DETERMINISTIC_MIN_ROWS, Buckets, StepShape

#: the sampler program's name in JAX's compile events (``engine/runners/sampler_program.py``)
SAMPLER_FUNCTION = "jit(_sample_into)"
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
    ``model.deterministic`` (``engine/step/buckets.py``), else 0 (the buckets' own minimums)."""
    return DETERMINISTIC_MIN_ROWS if cfg.model.deterministic else 0


def warmup(engine: Any, max_seq_len: int | None = None, logit_controls: bool = False,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compile the engine's program set (module docstring); what it took:
    ``programs`` (shapes run), ``compiles`` (XLA compiles JAX reported: 0 when already warm),
    ``cache_hits`` (programs loaded from the persistent compile cache instead),
    ``compile_s``, ``seconds`` (wall), ``decode_programs``, ``extend_programs``,
    ``max_seq_len``, ``controls_programs``, ``ahead_of_time``, ``threads``, the sampler programs
    (``sampler_programs``, ``sampler_compiles``, ``sampler_compile_s``: ``_sampler_report``) and
    ``program_list`` (each program's shape and the seconds its compile took, longest first).
    ``logit_controls``: also the penalty / grammar variant of every single-step shape
    (``engine/sampling/logit_controls.py``). ``progress``: called with a line at each stage."""
    if engine.has_unfinished() or engine.in_flight is not None:
        raise ValueError("warmup needs an idle engine: "
                         f"{len(engine.scheduler.waiting)} waiting, "
                         f"{len(engine.scheduler.running)} running, "
                         f"in flight: {engine.in_flight is not None}")
    runner = engine.runner
    out: dict[str, Any] = {"programs": 0, "compiles": 0, "cache_hits": 0, "compile_s": 0.0,
                           "seconds": 0.0, "decode_programs": 0, "extend_programs": 0,
                           "max_seq_len": max_seq_len, "controls_programs": 0,
                           "program_list": [], "sampler_programs": 0, "sampler_compiles": 0,
                           "sampler_compile_s": 0.0}
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
    counter = runner.warm_compiles
    before = counter.compiles, counter.cache_hits, counter.seconds
    sampler_before = _sampler_counts(counter)
    t0 = time.perf_counter()
    controlled = [s for s in shapes if s.iterations == 1] if logit_controls else []
    jobs = [(s, False) for s in shapes] + [(s, True) for s in controlled]
    aot = getattr(engine.cfg, "compile", None)
    threads = compile_threads(aot.threads if aot else 1, len(jobs))
    ahead = bool(aot and aot.ahead_of_time and hasattr(runner, "compile_ahead"))
    loaded, while_loading = _join_loading(engine, progress)  # [compile.while_loading]
    todo = [j for j in jobs if j not in loaded]
    if ahead:  # the programs not compiled while loading, by job
        loaded = {**loaded, **dict(zip(todo, compile_ahead(runner, todo, threads, progress),
                                       strict=True))}
    times = [loaded.get(j, 0.0) for j in jobs]
    for i, (shape, controls) in enumerate(jobs):
        t = time.perf_counter()
        runner.warm(shape, logit_controls=controls)
        if not ahead:  # the compile happens in the run
            times[i] = time.perf_counter() - t
            _report(progress, f"compiled {i + 1} of {len(jobs)} programs")
    splits = _warm_splits(engine, shapes)
    if engine.cfg.speculative.enabled:
        runner.copy_slots([])  # the scratch end-state copy: slot 0 onto itself
        if engine.cfg.speculative.topk > 1 and engine.cfg.cache.page_size > 1:
            runner.copy_pages([])  # [tree] a branch's first page (page 0 onto itself)
    if engine.cache.host_tier is not None:  # [host tier] its copies, up to a whole sequence
        runner.warm_transfers(-(-buckets.max_seq_len // engine.cfg.cache.page_size))
    decode = sum(s.decode for s in shapes)
    listed = sorted(zip(times, jobs, strict=True), key=lambda x: -x[0])
    early = (while_loading or {}).get("counted", (0, 0, 0.0))  # compiled while loading
    out.update(programs=len(shapes), compiles=counter.compiles - before[0] + early[0],
               cache_hits=counter.cache_hits - before[1] + early[1],
               compile_s=counter.seconds - before[2] + early[2],
               seconds=time.perf_counter() - t0, decode_programs=decode,
               extend_programs=len(shapes) - decode, max_seq_len=buckets.max_seq_len,
               device_splits=splits, controls_programs=len(controlled), ahead_of_time=ahead,
               threads=threads if ahead else 1, while_loading=while_loading,
               program_list=[{**dataclasses.asdict(s), "logit_controls": c, "seconds": t}
                             for t, (s, c) in listed])
    out.update(_sampler_report(runner, jobs, sampler_before, while_loading))
    _report(progress, f"warm-up: {len(jobs)} programs ({out['compiles']} compiled, "
                      f"{out['cache_hits']} from the compile cache) in {out['seconds']:.1f} s"
                      + (f"; {out['sampler_programs']} sampler programs "
                         f"({out['sampler_compile_s']:.1f} s)" if out["sampler_programs"] else ""))
    return out


def _join_loading(engine: Any, progress: Callable[[str], None] | None
                  ) -> tuple[dict[tuple[StepShape, bool], float], dict[str, Any] | None]:
    """[compile.while_loading] The programs ``engine/runners/loading_compiles.py`` compiled while
    the weights loaded (``{(shape, logit_controls): seconds}``) and its report (None without it);
    a failed compile raises here, naming its program."""
    early = getattr(engine, "loading_compiles", None)
    if early is None:
        return {}, None
    engine.loading_compiles = None
    done, report = early.join(engine.runner, engine.model_cfg)
    counter = early.runner.warm_compiles
    report["counted"] = (counter.compiles, counter.cache_hits, counter.seconds)
    report["sampler_counted"] = _sampler_counts(counter)
    _report(progress, f"{len(done)} programs compiled while the weights loaded "
                      f"({report['seconds']:.1f} s from the start)")
    return done, report


def _sampler_counts(counter: Any) -> tuple[int, float]:
    """(sampler programs compiled, their seconds) in ``counter`` so far."""
    return (counter.by_function[SAMPLER_FUNCTION],
            counter.seconds_by_function[SAMPLER_FUNCTION])


def _sampler_report(runner: Any, jobs: list[tuple[StepShape, bool]], before: tuple[int, float],
                    while_loading: dict[str, Any] | None) -> dict[str, Any]:
    """[compile.separate_sampler] ``sampler_programs``: the sampler programs the set needs (one
    per logits-row count and controls variant of its single-step shapes; 0 when fused),
    ``sampler_compiles`` / ``sampler_compile_s``: what compiling them took here and while the
    weights loaded (``engine/runners/sampler_program.py``)."""
    if not getattr(runner, "separate_sampler", False):
        return {"sampler_programs": 0, "sampler_compiles": 0, "sampler_compile_s": 0.0}
    rows = {(s.num_logits, c) for s, c in jobs if s.iterations == 1}
    compiles, seconds = _sampler_counts(runner.warm_compiles)
    compiles, seconds = compiles - before[0], seconds - before[1]
    more = (while_loading or {}).get("sampler_counted", (0, 0.0))
    compiles, seconds = compiles + more[0], seconds + more[1]
    return {"sampler_programs": len(rows), "sampler_compiles": compiles,
            "sampler_compile_s": seconds}


def compile_threads(threads: int, jobs: int) -> int:
    """``compile.threads`` (0: the CPU count), at most one per program, at least 1."""
    return max(1, min(threads or os.cpu_count() or 1, jobs))


def compile_ahead(runner: Any, jobs: list[tuple[StepShape, bool]], threads: int,
                  progress: Callable[[str], None] | None) -> list[float]:
    """Compile every ``(shape, logit_controls)`` program of ``jobs`` from abstract shapes
    (``ModelRunner.compile_ahead``) in a pool of ``threads``, the largest first; the seconds
    each took, in ``jobs``' order. Tracing and lowering hold the GIL; XLA's compiles run in
    parallel."""
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].compile_weight)
    seconds = [0.0] * len(jobs)
    with concurrent.futures.ThreadPoolExecutor(threads, "mambacache-compile") as pool:
        futures = {pool.submit(runner.compile_ahead, *jobs[i]): i for i in order}
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            i = futures[fut]
            seconds[i] = fut.result()
            _report(progress, f"compiled {done} of {len(jobs)} programs "
                              f"({jobs[i][0].describe()}: {seconds[i]:.1f} s)")
    return seconds


def _report(progress: Callable[[str], None] | None, line: str) -> None:
    logging.info("%s", line)
    if progress is not None:
        progress(line)


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
