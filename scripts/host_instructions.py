"""The engine's host path in instructions, not seconds (issue 23): on a shared, loaded machine
the thread's CPU time of the same code varies by 30-50% between runs; an instruction count under
valgrind does not. Every ``Engine.step`` call runs inside ``functools.reduce``, and callgrind
collects only there, so the count is the engine's host path (the runner is a stand-in returning
fixed read-only tokens, a few hundred instructions a step):

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \\
        --callgrind-out-file=/tmp/cg.out python scripts/host_instructions.py trace --concurrency 16
    grep ^summary /tmp/cg.out    # instructions; divide by the printed requests (or steps)

``trace``: ``shared_prefix_trace(--requests, 16, 512, 64, output_len=16)`` through
``mambacache.bench.simulate`` (200k KV tokens, 256 state slots), per request. ``decode``:
``--concurrency`` requests of 576 random tokens decoding, ``--steps`` steady decode steps after
their prefills and 4 warm-up steps, per step (before 2026-12-02's fourth session the warm-up
was 4 steps only: at concurrency 16 the counted steps were still prefill chunks).
``--decode-steps K`` (> 1): ``scheduler.decode_steps`` (multi-step decode: K tokens per row
per step). Runs against older trees too (public API only; without ``--decode-steps``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from mambacache.config import EngineConfig  # noqa: E402
from mambacache.engine.engine import Engine  # noqa: E402
from mambacache.engine.sampling.params import SamplingParams  # noqa: E402
from mambacache.engine.shadow.runner import ShadowRunner  # noqa: E402

_OUT: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _stand_in(self: ShadowRunner, scheduled) -> tuple[np.ndarray, np.ndarray]:
    """The shadow runner's ``_run`` without its checks: fixed tokens per row count."""
    self.last_request_ids = [s.req.request_id for s in scheduled]
    out = _OUT.get(len(scheduled))
    if out is None:
        k = len(scheduled)
        out = _OUT[k] = (np.ones(k, np.int32), np.zeros(k, np.float32))
    return out


def _stand_in_multi(self: ShadowRunner, scheduled, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[multi-step decode] ``_stand_in`` for ``_run_multi``: ``[k, rows]`` fixed tokens."""
    self.last_request_ids = [s.req.request_id for s in scheduled]
    key = (k, len(scheduled))
    out = _OUT.get(key)
    if out is None:
        out = _OUT[key] = (np.ones(key, np.int32), np.zeros(key, np.float32))
    return out


def _collected(step):
    """``Engine.step`` inside ``functools.reduce`` (callgrind's ``--toggle-collect``)."""
    def wrapper(self):
        return functools.reduce(lambda acc, _: step(self), range(1), None)
    return wrapper


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("trace", "decode"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--decode-steps", type=int, default=1)
    args = ap.parse_args(argv)
    ShadowRunner._run = _stand_in
    sets = {"cache.num_kv_tokens": 200_000, "cache.num_mamba_slots": 256}
    if args.decode_steps > 1:
        ShadowRunner._run_multi = _stand_in_multi
        sets["scheduler.decode_steps"] = args.decode_steps
    cfg = EngineConfig.load(None, overrides=sets)
    if args.mode == "trace":
        from mambacache.bench.simulate import shared_prefix_trace, simulate

        trace = shared_prefix_trace(args.requests, 16, 512, 64, output_len=16, seed=0)
        Engine.step = _collected(Engine.step)
        res = simulate(trace, cfg, concurrency=args.concurrency)
        print(f"requests {res['num_requests']}, steps {res['steps']}")
        return
    cfg = cfg.replace(**{"scheduler.max_running_requests": args.concurrency})
    engine = Engine(cfg, runner=ShadowRunner.for_config(cfg, vocab_size=1000))
    rng = np.random.default_rng(0)
    for _ in range(args.concurrency):
        engine.add_request(rng.integers(2, 900, 576).astype(np.int32),
                           SamplingParams(max_new_tokens=(args.steps + 20) * args.decode_steps
                                          + 1024, ignore_eos=True))  # none ends while counted
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    step = _collected(Engine.step)
    first = sum(len(r.output_ids) for r in engine.scheduler.running)
    for _ in range(args.steps):
        step(engine)
    done = sum(len(r.output_ids) for r in engine.scheduler.running) - first
    print(f"steps {args.steps}, rows {len(engine.scheduler.running)}, tokens read while "
          f"counted {done}")


if __name__ == "__main__":
    main()
