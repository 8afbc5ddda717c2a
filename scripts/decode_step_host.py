"""Host cost of one decode step of ``--rows`` requests: the engine's own time per ``Engine.step``
(scheduling, the lease transitions, row specs, appends), the shadow runner's checks excluded.

    python scripts/decode_step_host.py --rows 256 [--steps 60] [--overlap 0|1] [--page-size 16] \
        [--decode-steps K]

No model and no device: the engine runs on the data-flow oracle (``ShadowRunner``), whose own
``run`` time is subtracted. Times are the thread's CPU time (``time.thread_time``: on a shared,
loaded machine wall time mostly measures the other processes); the wall-time median is printed
beside. Prints the median and the 10th / 90th percentiles in ms (one line of JSON with
``--json``). ``--decode-steps K`` (> 1): ``scheduler.decode_steps``, multi-step decode; each
step then gives every row K tokens, and the per-token figure (``token_median_ms``: a step's
cost over its tokens per row) is printed beside. Uses only the public engine API, so it runs
against older trees too (without ``--decode-steps``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from mambacache.config import EngineConfig
from mambacache.engine.engine import Engine
from mambacache.engine.sampling.params import SamplingParams
from mambacache.engine.shadow.runner import ShadowRunner


def decode_step_ms(rows: int, steps: int, overlap: bool, page_size: int,
                   decode_steps: int = 1) -> tuple[list[float], list[float]]:
    """Milliseconds of engine host time (CPU, wall) of ``steps`` decode steps of ``rows``
    requests."""
    sets = {"cache.num_kv_tokens": rows * 512 * decode_steps,
            "cache.num_mamba_slots": 4 * rows, "cache.page_size": page_size,
            "scheduler.max_running_requests": rows,
            "scheduler.chunked_prefill_size": rows * 128, "scheduler.overlap": overlap}
    if decode_steps > 1:
        sets["scheduler.decode_steps"] = decode_steps
    cfg = EngineConfig().replace(**sets)
    runner = ShadowRunner.for_config(cfg, vocab_size=32000)
    oracle = {"cpu": 0.0, "wall": 0.0}
    run = runner.run

    def timed_run(scheduled):  # the oracle's own time, subtracted below
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return run(scheduled)
        finally:
            oracle["cpu"] += time.thread_time() - c0
            oracle["wall"] += time.perf_counter() - w0

    runner.run = timed_run
    if decode_steps > 1:
        run_multi = runner.run_multi

        def timed_multi(scheduled, k):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return run_multi(scheduled, k)
            finally:
                oracle["cpu"] += time.thread_time() - c0
                oracle["wall"] += time.perf_counter() - w0

        runner.run_multi = timed_multi
    engine = Engine(cfg, runner=runner)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=(steps + 8) * decode_steps, ignore_eos=True)
    for _ in range(rows):
        engine.add_request(rng.integers(1, 32000, 100).tolist(), params)
    for _ in range(3):  # the prefill, then every request decodes
        engine.step()
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0, o = time.thread_time(), time.perf_counter(), dict(oracle)
        engine.step()
        cpu.append((time.thread_time() - c0 - (oracle["cpu"] - o["cpu"])) * 1e3)
        wall.append((time.perf_counter() - w0 - (oracle["wall"] - o["wall"])) * 1e3)
        if len(runner.last_request_ids) != rows:
            raise RuntimeError(f"a step ran {len(runner.last_request_ids)} rows, not {rows}")
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--overlap", type=int, choices=(0, 1), default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ms, wall = decode_step_ms(args.rows, args.steps, bool(args.overlap), args.page_size,
                              args.decode_steps)
    res = {"rows": args.rows, "overlap": args.overlap, "median_ms": float(np.median(ms)),
           "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
           "wall_median_ms": float(np.median(wall))}
    if args.decode_steps > 1:
        res["decode_steps"] = args.decode_steps
        res["token_median_ms"] = res["median_ms"] / args.decode_steps
    print(json.dumps(res) if args.json else
          f"{args.rows} rows, overlap {args.overlap}: {res['median_ms']:.2f} CPU ms per decode "
          f"step (p10 {res['p10_ms']:.2f}, p90 {res['p90_ms']:.2f}; wall median "
          f"{res['wall_median_ms']:.2f})"
          + (f"; {res['token_median_ms']:.3f} ms per token of a row (K = {args.decode_steps})"
             if args.decode_steps > 1 else ""))


if __name__ == "__main__":
    main()
