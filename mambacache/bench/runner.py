"""One timed pass of a workload through an ``Engine``, and its serving statistics.

Arrival: ``"all"`` sends every request at time 0 (at most ``concurrency`` in flight; 0 = no
cap); ``"poisson"`` spaces the first requests by exponential gaps at ``rate`` requests/s (also
capped by ``concurrency``). A multi-turn client's next turn arrives when its previous turn
finished. TTFT / latency are measured by the engine from ``add_request``.

Every XLA compile made during a pass (engine steps or anything else on the calling thread) is
counted from JAX's own events: ``pass_compiles``, ``pass_compile_s`` (0 in a warm pass).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.bench.workloads import BenchItem, IdealHits, check_ints
from mambacache.engine.runners.compiles import count_compiles
from mambacache.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine

ARRIVALS = ("all", "poisson")


@dataclasses.dataclass(frozen=True)
class BenchSection:
    """The ``[bench]`` table: arrival process, concurrency cap, seed, warm-up and repeats.

    ``warmup``: untimed passes of the whole workload per mode before timing (compiles every
    program the timed passes need). ``repeats``: timed on/off pairs, alternating which goes
    first; the report takes medians.
    """

    arrival: str = "all"
    concurrency: int = 0
    rate: float = 0.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    progress: bool = True

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            raise ValueError(f"bench.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        check_ints(self, ("concurrency", "seed", "warmup"), 0, section="bench")
        check_ints(self, ("repeats",), 1, section="bench")
        if not isinstance(self.rate, int | float) or self.rate < 0:
            raise ValueError(f"bench.rate must be >= 0, got {self.rate!r}")
        if self.arrival == "poisson" and self.rate <= 0:
            raise ValueError(f"bench.arrival = 'poisson' needs bench.rate > 0, got {self.rate!r}")


@dataclasses.dataclass
class Finished:
    prompt_len: int
    output_len: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    error: str | None


def _arrival_times(bench: BenchSection, n: int) -> np.ndarray:
    if bench.arrival == "all":
        return np.zeros(n)
    rng = np.random.default_rng(bench.seed + 1)
    return np.cumsum(rng.exponential(1.0 / bench.rate, n))


def run_pass(engine: Engine, source: Any, bench: BenchSection, *, label: str = "",
             progress: bool = False) -> dict[str, Any]:
    """Drive ``source`` through ``engine`` to completion; returns the pass statistics."""
    ideal = IdealHits()
    done: list[Finished] = []
    bar = _progress_bar(source.total, label) if progress else None
    t0 = time.perf_counter()
    with count_compiles() as compiled:  # every XLA compile of the pass (engine/runners/compiles.py)
        _drive(engine, source, bench, ideal, done, bar, t0)
    duration_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    stats = summarize(done, duration_s)
    stats["ideal_hit_rate"] = ideal.rate
    stats.update(_engine_stats(engine.metrics()))
    stats.update(pass_compiles=compiled.compiles, pass_compile_s=compiled.seconds,
                 pass_compiled_functions=dict(compiled.by_function))
    return stats


def _drive(engine: Engine, source: Any, bench: BenchSection, ideal: IdealHits,
           done: list[Finished], bar: Any, t0: float) -> None:
    """The closed loop: send what is due (arrival times, concurrency cap), step, follow up."""
    order = itertools.count()
    items = source.start()
    heap = [(float(t), next(order), it) for t, it in
            zip(_arrival_times(bench, len(items)), items, strict=True)]
    heapq.heapify(heap)
    cap = bench.concurrency or None
    inflight: dict[int, BenchItem] = {}
    while heap or inflight:
        now = time.perf_counter() - t0
        while heap and heap[0][0] <= now and (cap is None or len(inflight) < cap):
            item = heapq.heappop(heap)[2]
            params = SamplingParams(max_new_tokens=item.max_new_tokens, temperature=0.0,
                                    ignore_eos=True)
            inflight[engine.add_request(item.prompt, params)] = item
            ideal.send(item.prompt)
        if not engine.has_unfinished():
            if inflight:
                raise RuntimeError(f"engine idle with {len(inflight)} requests in flight")
            if heap:
                time.sleep(max(0.0, heap[0][0] - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            item = inflight.pop(out.request_id)
            ideal.insert(item.prompt + out.output_token_ids[:-1])
            done.append(Finished(len(item.prompt), len(out.output_token_ids), out.cached_tokens,
                                 out.ttft_s or 0.0, out.latency_s or 0.0, out.error))
            nxt = source.follow_up(item, out.output_token_ids)
            if nxt is not None:
                heapq.heappush(heap, (time.perf_counter() - t0, next(order), nxt))
            if bar is not None:
                bar.update(1)


def _progress_bar(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False, dynamic_ncols=True,
                mininterval=0.5)


def distribution(prefix: str, values: list[float]) -> dict[str, float | None]:
    """Mean, p50, p99 of ``values``; None when there are none (e.g. TPOT of 1-token outputs)."""
    if not values:
        return {f"{prefix}_{s}": None for s in ("mean", "p50", "p99")}
    arr = np.asarray(values, np.float64)
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(np.percentile(arr, 50)),
            f"{prefix}_p99": float(np.percentile(arr, 99))}


def summarize(done: list[Finished], duration_s: float) -> dict[str, Any]:
    """Throughputs (per second of wall time) and TTFT / TPOT / latency in seconds."""
    ok = [f for f in done if f.error is None]
    input_tokens = sum(f.prompt_len for f in ok)
    output_tokens = sum(f.output_len for f in ok)
    tpots = [(f.latency_s - f.ttft_s) / (f.output_len - 1) for f in ok if f.output_len > 1]
    out = {"duration_s": duration_s, "completed": len(ok), "failed": len(done) - len(ok),
           "input_tokens": input_tokens, "output_tokens": output_tokens,
           "request_throughput": len(ok) / duration_s,
           "input_throughput": input_tokens / duration_s,
           "output_throughput": output_tokens / duration_s,
           "total_token_throughput": (input_tokens + output_tokens) / duration_s}
    out.update(distribution("ttft", [f.ttft_s for f in ok]))
    out.update(distribution("tpot", tpots))
    out.update(distribution("e2e_latency", [f.latency_s for f in ok]))
    return out


ENGINE_KEYS = ("hit_rate", "prompt_tokens", "cached_tokens", "computed_prefill_tokens",
               "peak_token_usage", "peak_mamba_usage", "snapshots_kept", "snapshots_skipped",
               "snapshots_evicted", "programs_compiled", "compile_s", "step_programs",
               "host_share", "num_steps", "preemptions",
               "kv_bytes_per_token", "kv_bytes_per_token_expanded", "spec_verify_steps",
               "spec_draft_tokens", "spec_accepted_tokens", "spec_accept_rate",
               "spec_tokens_per_verify", "spec_verify_rows", "spec_verify_width",
               "spec_branch_wins",
               "device_idle_share",
               "host_bound_share")


def _engine_stats(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: metrics[k] for k in ENGINE_KEYS if k in metrics}


def alternating_pairs(cfgs: dict[bool, Any], model: Any, setup: Any, pairs: int,
                      keys: tuple[str, ...], label: str) -> dict[bool, list[dict[str, Any]]]:
    """A / B of two engine configurations on one loaded model: one untimed pass per config
    (compiles), then ``pairs`` timed pairs of the whole workload, who goes first alternating (in
    ``cfgs``' order on even pairs). Returns each config's ``keys`` of ``run_pass`` per pair;
    ``label`` names the switch in the progress lines (``pair 1 overlap=True: {...}``)."""
    from mambacache.engine.engine import Engine

    order = tuple(cfgs)

    def one(on: bool) -> dict[str, Any]:
        engine = Engine(cfgs[on], model=model)
        source = setup.workload.source(model[0].vocab_size, setup.bench.seed)
        stats = run_pass(engine, source, setup.bench)
        return {k: stats.get(k) for k in keys}

    for on in order:
        one(on)  # warm-up: compiles
    runs: dict[bool, list[dict[str, Any]]] = {on: [] for on in order}
    for i in range(pairs):
        for on in (order if i % 2 == 0 else order[::-1]):
            runs[on].append(one(on))
            print(f"pair {i + 1} {label}={on}: {runs[on][-1]}", flush=True)
    return runs
