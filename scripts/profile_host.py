"""Where the engine's host time per request goes, by function, on the shared-prefix trace of
``scripts/compare_sglang_tree.py`` (issue 23): ``cProfile`` on the thread's CPU clock over
``mambacache.bench.simulate`` (the engine on the shadow runner), the runner's own checks left
out.

    python scripts/profile_host.py [--concurrency 16] [--requests 1000]

Prints one row per part of the host path: its cumulative CPU share of the engine's time (all of
``Engine.step`` less ``ShadowRunner.run``) and that share of the unprofiled CPU microseconds per
request (measured first, without the profiler; the profiler slows small calls more than big
ones, so the shares are approximate). The parts nest as the table says ("of which").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

#: (label, (file suffix, function name) of each function summed; cumulative times)
PARTS = [
    ("Engine.step, all of it", [("engine/engine.py", "step")]),
    ("  schedule: Scheduler.schedule", [("engine/scheduler.py", "schedule")]),
    ("    of which admission (match, lock, plan, dedup)",
     [("engine/leases/admission.py", "admit")]),
    ("    of which publish (mid-prefill insert)", [("engine/leases/lease.py", "publish")]),
    ("    of which page growth of rows", [("engine/leases/lease.py", "grow"),
                                          ("engine/leases/cache_manager.py", "grow_rows")]),
    ("    of which row specs of chunks and snapshot rows (_spec)",
     [("engine/scheduler.py", "_spec")]),
    ("    of which decode rows (their specs too) / prefill chunks",
     [("engine/scheduler.py", "_decode_scheduled"), ("engine/scheduler.py", "_add_chunk")]),
    ("  dispatch: StepLoop._dispatch (less the runner)", [("engine/step_loop.py", "_dispatch")]),
    ("    of which Scheduler.advance (lease.written)", [("engine/scheduler.py", "advance")]),
    ("  read: StepLoop._read (appends, stops)", [("engine/step_loop.py", "_read")]),
    ("    of which finish (release: tree insert)", [("engine/scheduler.py", "finish")]),
    ("  metrics: EngineMetrics.on_step", [("engine/metrics.py", "on_step")]),
]


def _cum(stats: pstats.Stats, file: str, name: str) -> float:
    return sum(v[3] for (f, _, n), v in stats.stats.items()
               if n == name and f.replace("\\", "/").endswith(file))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=1)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_sglang_tree import replay_ours

    from mambacache.bench.simulate import shared_prefix_trace

    trace = shared_prefix_trace(args.requests, 16, 512, 64, output_len=16, seed=0)
    plain = replay_ours(trace, 200_000, 256, args.concurrency)["engine_cpu_us_per_request"]
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    replay_ours(trace, 200_000, 256, args.concurrency)
    prof.disable()
    stats = pstats.Stats(prof)
    runner = _cum(stats, "engine/shadow/runner.py", "run")
    engine = _cum(stats, "engine/engine.py", "step") - runner
    print(f"concurrency {args.concurrency}, {args.requests} requests: engine CPU "
          f"{plain:.1f} us per request unprofiled")
    print("| part | share | us per request |\n|---|---|---|")
    for label, funcs in PARTS:
        t = sum(_cum(stats, f, n) for f, n in funcs)
        if label.startswith(("Engine.step", "  dispatch")):
            t -= runner  # the shadow runner's checks are not the engine's
        print(f"| {label.strip()} | {t / engine:.0%} | {t / engine * plain:.0f} |")


if __name__ == "__main__":
    main()
