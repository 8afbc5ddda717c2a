"""The engine fuzz of ``tests/test_engine_fuzz.py`` for as long as you like, over fresh seeds.

    python scripts/fuzz_engine.py --minutes 20 [--first-seed 10000] [--timeout-s 60]

Each seed runs every variant (plain, multi-step decode K = 3, host tier, byte budget, moving
device split, K = 4 + host tier, K = 2 + byte budget + host tier) with ``scheduler.overlap`` on
and off, on the data-flow oracle (``ShadowRunner``: every read, every transfer between tiers
and the engine's integrity checked). A scenario that raises, or runs past ``--timeout-s`` (a
stall: the scheduler spinning), is printed as one ``FAIL`` line with its seed and variant, so
it can be replayed with ``run_fuzz(seed, overlap=..., **variant)``. Exit status 1 if any
failed. No model, no device; one core.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ({}, {"decode_steps": 3}, {"host_tier": True}, {"byte_budget": True},
            {"rebalance": True}, {"decode_steps": 4, "host_tier": True},
            {"decode_steps": 2, "byte_budget": True, "host_tier": True})


def _stalled(*_args) -> None:
    raise TimeoutError("scenario stalled here:\n" + "".join(traceback.format_stack(limit=8)))


def run_seed(run_fuzz, seed: int, timeout_s: int) -> list[str]:
    """Every variant of ``seed``, overlap on and off; a line per failure."""
    failures = []
    for variant in VARIANTS:
        for overlap in (True, False):
            signal.alarm(timeout_s)
            try:
                run_fuzz(seed, overlap=overlap, **variant)
            except Exception as err:  # noqa: BLE001 (every failure is a finding)
                failures.append(f"FAIL seed={seed} overlap={overlap} {variant} "
                                f"{type(err).__name__}: {str(err)[:600]}")
            finally:
                signal.alarm(0)
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--first-seed", type=int, default=10_000)
    p.add_argument("--timeout-s", type=int, default=60, help="a scenario's limit (a stall)")
    args = p.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from test_engine_fuzz import run_fuzz

    signal.signal(signal.SIGALRM, _stalled)
    deadline = time.monotonic() + 60 * args.minutes
    seed, failures = args.first_seed, []
    while time.monotonic() < deadline:
        for line in run_seed(run_fuzz, seed, args.timeout_s):
            print(line, flush=True)
            failures.append(line)
        seed += 1
    print(f"seeds {args.first_seed}..{seed - 1}: {seed - args.first_seed} seeds x "
          f"{2 * len(VARIANTS)} scenarios, {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
