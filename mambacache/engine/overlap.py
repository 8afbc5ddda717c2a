"""The overlapped step loop (``scheduler.overlap = true``): schedule and dispatch step N+1, then
read step N's sampled tokens, so the device never waits for the host between steps.

Per ``Engine.step`` call:
  1. schedule step N+1 while step N runs. A request whose token from N is still on the device
     gets a decode row whose last token is a placeholder; ``SeqSpec.prev_index`` names the row
     of N that samples it and the step resolves it from the runner's ``future`` buffer on the
     device. A request whose token from N is its last one by length (``max_new_tokens``) gets
     no row; a request with a token in flight is never admitted (``Request.num_pending``);
  2. dispatch N+1 and record its progress (``Scheduler.advance``: device order puts every later
     step after it, so its states and pages may be published and read from now on);
  3. read N's tokens: append them, check stop conditions, finish requests. A request that
     stopped at N has a row in N+1 computing the stop token: it is released with everything up
     to the stop token inserted (the running slot is the state after it; any later reader is
     dispatched after N+1) and its N+1 token is dropped when read (it is FINISHED by then);
  4. mark N+1's sampling rows as pending (``num_pending``, ``pending_row``).

Failures: a dispatch that raises fails its own requests (``Engine._fail_step``) and N is still
read for the others; a read that raises fails every request running or with a token in flight
and the pools and the cache restart empty (the device state behind the steps in flight is
unknown). Once nothing is unfinished, a step still in flight holds only dropped rows: it is read
then, so an idle engine has nothing in flight.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from mambacache.engine.request import RequestOutput, Status
from mambacache.engine.step_plan import ScheduledSeq


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose sampled tokens have not been read."""

    scheduled: list[ScheduledSeq]
    rows: list[int]  # indices into ``scheduled`` (= logits rows) that sample a token
    tokens: Any  # [L] int32, on the device until read
    logprobs: Any  # [L] float32


def overlap_step(engine: Any) -> list[RequestOutput]:
    """One overlapped ``Engine.step``: the requests that finished (read in this call)."""
    t_start = time.perf_counter()
    scheduled = engine.scheduler.schedule()
    outs: list[RequestOutput] = []
    launched = None
    if scheduled:
        if engine.cfg.scheduler.check_integrity_every_step:
            engine.scheduler.check_step(scheduled)
        launched, failed = _dispatch(engine, scheduled)
        outs += failed
    prev, engine.in_flight = engine.in_flight, launched
    wait_s = 0.0
    if prev is not None:
        read, wait_s = _read(engine, prev)
        outs += read
    if launched is not None and engine.in_flight is launched:
        _mark_pending(launched)
    if engine.in_flight is not None and not engine.has_unfinished():
        _drop(engine)  # only dropped rows are left in flight
    now = time.perf_counter()
    engine.stats.on_step(engine, scheduled, host_s=now - t_start - wait_s, wall_s=now - t_start,
                         t_start=t_start)
    if engine.cfg.scheduler.check_integrity_every_step:
        engine.check_integrity()
    return outs


def _dispatch(engine: Any, scheduled: list[ScheduledSeq]) -> tuple[InFlight | None, list]:
    """Run ``scheduled`` (asynchronously) and record its progress; (the step, []) or, if the
    dispatch raised, (None, the outputs of the requests it failed)."""
    prev = engine.in_flight
    ready = getattr(prev.tokens, "is_ready", None) if prev is not None else None
    host_bound = ready() if ready is not None else None  # before the batch is built
    try:
        tokens, logprobs = engine.runner.run(scheduled)
    except AssertionError:
        raise  # a broken invariant (the shadow runner's data-flow check) is a bug: no retry
    except Exception as err:  # noqa: BLE001 - a failed step fails its requests only
        return None, engine._fail_step(scheduled, err)
    engine.stats.on_flight(time.perf_counter(), +1, host_bound=host_bound)
    rows = [i for i, s in enumerate(scheduled) if s.samples]  # before any token is pending
    for s in scheduled:
        engine._advance(s)
    return InFlight(scheduled, rows, tokens, logprobs), []


def _read(engine: Any, fl: InFlight) -> tuple[list[RequestOutput], float]:
    """Wait for ``fl``'s tokens; append them to the requests still waiting for them. The
    finished requests' outputs and the seconds spent waiting for the device."""
    t_wait = time.perf_counter()
    try:
        tokens, logprobs = np.asarray(fl.tokens), np.asarray(fl.logprobs)
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001 - the device state behind the steps is unknown
        engine.stats.on_flight(time.perf_counter(), -1)
        return _fail_all(engine, err), time.perf_counter() - t_wait
    now = time.perf_counter()
    engine.stats.on_flight(now, -1)
    outs = []
    for i in fl.rows:
        req = fl.scheduled[i].req
        if req.status is Status.FINISHED:
            continue  # finished (stop, abort, error) while this row ran: its token is dropped
        engine.scheduler.token_read(req)
        out = engine._append(req, int(tokens[i]), float(logprobs[i]), now)
        if out is not None:
            outs.append(out)
    return outs, now - t_wait


def _mark_pending(fl: InFlight) -> None:
    for i in fl.rows:
        req = fl.scheduled[i].req
        if req.status is Status.RUNNING:
            req.num_pending += 1
            req.pending_row = i


def _drop(engine: Any) -> None:
    """Read the step in flight when no row of it has a reader left (the engine goes idle)."""
    fl, engine.in_flight = engine.in_flight, None
    if any(fl.scheduled[i].req.status is not Status.FINISHED for i in fl.rows):
        raise AssertionError("a step in flight samples for an unfinished request")
    try:
        np.asarray(fl.tokens)
    except Exception as err:  # noqa: BLE001 - no request is left to fail; the pools may be
        _fail_all(engine, err)
    finally:
        engine.stats.on_flight(time.perf_counter(), -1)


def _fail_all(engine: Any, err: Exception) -> list[RequestOutput]:
    """A read raised: every request running or with a token in flight fails, and the step in
    flight with them (the pools lost path of ``Engine._fail_step``)."""
    if engine.in_flight is not None:
        engine.in_flight = None
        engine.stats.on_flight(time.perf_counter(), -1)
    return engine._fail_step([], err, lost=True)
