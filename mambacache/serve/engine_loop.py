"""The engine in one background thread, and the asyncio front the HTTP handlers await.

Only the engine thread touches the ``Engine``: requests, aborts and any other call (metrics, the
integrity check) are commands queued to it and run between two steps, in the order sent. After
each step the thread hands every live request's new token ids and logprobs to that request's
``RequestStream`` (an ``asyncio.Queue`` on the server's event loop: ``streams.py``), and the
final ``RequestOutput`` when it finished.

Invariants: a request is live from its ``add_request`` until the step that finished it or its
abort, and ``in_flight`` counts the live ones plus those being added, less those whose abort was
asked for: an abort gives its capacity back at once (``_release``, once per stream), before
the engine thread frees the request between two steps. A request is refused (``Overloaded``,
HTTP 503) when ``in_flight`` would exceed ``max_running_requests + max_waiting``. Output ids are
only ever appended, so a stream never takes back a token it sent.

Nothing the event loop serves waits behind a step: ``/health`` reads ``ready`` (set after the
warm-up: ``Engine.warmup``, every step program of the configuration compiled), ``metrics()``
waits ``METRICS_WAIT_S`` for the engine thread and otherwise answers with the snapshot the
thread leaves after its steps (at most ``SNAPSHOT_EVERY_S`` old when the last step ended).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mambacache.engine.request import RequestOutput
from mambacache.engine.sampling.params import SamplingParams
from mambacache.serve.streams import Delta, Overloaded, RequestStream

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine

log = logging.getLogger(__name__)
WARMUP_PROMPT = list(range(1, 17))
METRICS_WAIT_S = 0.5
SNAPSHOT_EVERY_S = 0.5


class EngineLoop:
    """Owns ``engine`` and the thread that steps it. ``observer`` (optional) gets
    ``first_token(s)``, ``inter_token(s)``, ``finished(output, e2e_s)`` from that thread."""

    def __init__(self, engine: Engine | Callable[[], Engine], *, max_waiting: int,
                 observer: Any = None, warmup: bool = True,
                 warmup_max_seq_len: int | None = None, warmup_logit_controls: bool = False,
                 max_running: int | None = None):
        """``engine``: the engine, or a function that builds it (loads the weights, sizes the
        cache), called first in the engine thread so that ``/health`` answers with the stage
        from the very start; then ``max_running`` (its ``scheduler.max_running_requests``)."""
        self._build = None if hasattr(engine, "step") else engine
        self.engine: Any = None if self._build is not None else engine
        if max_running is None:
            max_running = self.engine.cfg.scheduler.max_running_requests
        self.capacity = max_running + max_waiting
        self.observer = observer
        self.warmup = warmup
        self.warmup_max_seq_len = warmup_max_seq_len
        self.warmup_logit_controls = warmup_logit_controls
        self.warmup_error: str | None = None
        self.warmup_report: dict[str, Any] = {}
        self.stage = "starting"  # what the start is doing (``/health`` says it until ready)
        self.snapshot: dict[str, Any] = {}  # the engine's metrics() after a recent step
        self._snapshot_s = 0.0
        self.ready = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, RequestStream] = {}
        self._lock = threading.Lock()
        self.in_flight = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mambacache-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._commands.put((lambda e: None, concurrent.futures.Future()))
        self._thread.join(timeout=30)

    # ---- called from the event loop --------------------------------------------------------
    def call_soon(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the engine thread between steps (thread-safe)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return fut

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call_soon(fn))

    async def metrics(self) -> dict[str, Any]:
        """``Engine.metrics()`` fresh if the engine thread answers within ``METRICS_WAIT_S``,
        else (a step or the warm-up running) the last snapshot; never waits for a step."""
        try:
            return await asyncio.wait_for(self.call(lambda e: e.metrics()), METRICS_WAIT_S)
        except TimeoutError:  # the command was cancelled with its future: it will not run
            return self.snapshot

    async def submit(self, prompt: Sequence[int], params: SamplingParams,
                     extra_key: str | None = None) -> RequestStream:
        """Queue a request (``extra_key``: its cache namespace); ``ValueError`` (bad input,
        nothing held) or ``Overloaded``."""
        with self._lock:
            if self.in_flight >= self.capacity:
                raise Overloaded(f"{self.in_flight} requests in the server, the limit is "
                                 f"{self.capacity} (scheduler.max_running_requests + "
                                 "serve.max_waiting)")
            self.in_flight += 1
        stream = RequestStream(asyncio.get_running_loop())
        fut = self.call_soon(lambda e: self._add(e, stream, prompt, params, extra_key))
        try:
            await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            self.abort(stream)  # runs after the add: commands are in order
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stop ``stream``'s request: its capacity now, what the engine holds between two steps
        (no-op once it finished)."""
        self._release(stream)
        self.call_soon(lambda e: self._abort(e, stream))

    def _release(self, stream: RequestStream) -> None:
        """Give ``stream``'s place back (any thread; once per stream)."""
        with self._lock:
            if not stream.released:
                stream.released = True
                self.in_flight -= 1

    # ---- the engine thread -----------------------------------------------------------------

    def _add(self, engine: Engine, stream: RequestStream, prompt: Sequence[int],
             params: SamplingParams, extra_key: str | None) -> None:
        try:
            stream.request_id = engine.add_request(prompt, params, extra_key=extra_key)
        except BaseException:
            self._release(stream)  # here, not in ``submit``: its caller may be gone
            raise
        self._live[stream.request_id] = stream

    def _abort(self, engine: Engine, stream: RequestStream) -> None:
        if self._live.pop(stream.request_id, None) is None:
            return
        out = engine.abort(stream.request_id)
        self._release(stream)
        if self.observer is not None and out is not None:
            self.observer.finished(out, time.perf_counter() - stream.submitted_s)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.25) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as err:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _warm_up(self) -> None:
        """Compile the configuration's step programs (``Engine.warmup``; an engine without it
        runs one short generation), then take the first metrics snapshot."""
        t = time.perf_counter()
        self.set_stage("warm-up: compiling the step programs")
        try:
            if hasattr(self.engine, "warmup"):
                controls = {"logit_controls": True} if self.warmup_logit_controls else {}
                self.warmup_report = self.engine.warmup(self.warmup_max_seq_len, **controls,
                                                        progress=self.set_stage)
            else:
                self.engine.generate([WARMUP_PROMPT], SamplingParams(max_new_tokens=2))
        except Exception as err:  # noqa: BLE001 - reported by /health, then served anyway
            log.exception("warm-up failed")
            self.warmup_error = f"{type(err).__name__}: {err}"
        log.info("warm-up done in %.1f s: %s", time.perf_counter() - t, self.warmup_report)

    def set_stage(self, line: str) -> None:
        """The start's current stage (any thread; logged)."""
        self.stage = line
        log.info("start: %s", line)

    def _load(self) -> bool:
        """Build the engine (``engine`` given as a function): the weights, the cache's pools;
        False (``warmup_error`` set, ``ready``: /health says the error) if that failed."""
        t = time.perf_counter()
        self.set_stage("loading the weights, then sizing the cache")
        try:
            self.engine = self._build()
        except Exception as err:  # noqa: BLE001 - reported by /health
            log.exception("loading the model failed")
            self.warmup_error = f"{type(err).__name__}: {err}"
            self.ready.set()
            return False
        cfg, model_cfg = self.engine.cfg, self.engine.model_cfg
        self.set_stage(f"weights loaded and cache sized in {time.perf_counter() - t:.1f} s: "
                       f"{cfg.cache.num_pages} KV pages of {cfg.cache.page_size} tokens, "
                       f"{cfg.cache.num_mamba_slots} state slots, context length "
                       f"{model_cfg.max_position_embeddings}")
        return True

    def _run(self) -> None:
        if self._build is not None and not self._load():
            return
        if self.warmup:
            self._warm_up()
        self._take_snapshot(force=True)
        self.set_stage("ready")
        self.ready.set()
        while not self._stop:
            try:
                self._drain(block=not self.engine.has_unfinished())
                if self._stop or not self.engine.has_unfinished():
                    continue
                finished = self.engine.step()
                self._publish(finished)
                self._take_snapshot(force=bool(finished))
            except Exception as err:  # noqa: BLE001 - fail the live requests, keep serving
                log.exception("engine loop failed")
                self._fail_all(err)

    def _take_snapshot(self, force: bool) -> None:
        now = time.perf_counter()
        if force or now - self._snapshot_s >= SNAPSHOT_EVERY_S:
            self.snapshot, self._snapshot_s = self.engine.metrics(), now

    def _publish(self, finished: list[RequestOutput]) -> None:
        now = time.perf_counter()
        done = {out.request_id: out for out in finished}
        for rid, stream in list(self._live.items()):
            out = done.get(rid)
            req = None if out is not None else self.engine.requests.get(rid)
            if out is None and req is None:
                continue
            ids = out.output_token_ids if out is not None else req.output_ids
            lps = out.output_logprobs if out is not None else req.output_logprobs
            if len(ids) > stream.sent or out is not None:
                self._observe_tokens(stream, len(ids) - stream.sent, now)
                cached = out.cached_tokens if out is not None else req.cached_tokens
                stream.put(Delta(list(ids[stream.sent:]), list(lps[stream.sent:]), cached, out))
                stream.sent = len(ids)
            if out is not None:
                del self._live[rid]
                self._release(stream)
                if self.observer is not None:
                    self.observer.finished(out, now - stream.submitted_s)

    def _observe_tokens(self, stream: RequestStream, n: int, now: float) -> None:
        if self.observer is None or n <= 0:
            return
        if stream.last_token_s is None:
            self.observer.first_token(now - stream.submitted_s)
        else:
            self.observer.inter_token(now - stream.last_token_s)
        stream.last_token_s = now

    def _fail_all(self, err: Exception) -> None:
        """An error outside a model step: abort every live request and report it to each."""
        for rid, stream in list(self._live.items()):
            out = RequestOutput(rid, [], [], [], 0, "error", f"{type(err).__name__}: {err}")
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the request is reported failed either way
                log.exception("abort of request %d failed", rid)
            stream.put(Delta([], [], 0, out))
            del self._live[rid]
            self._release(stream)

    def live_requests(self) -> int:
        return len(self._live)
