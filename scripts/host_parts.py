"""Instructions per request of each part of the request's cache lifecycle (issue 23), load
independent: ``host_instructions.py``'s shared-prefix trace with each part called through its own
C trampoline (``itertools.starmap`` / ``takewhile`` / ``dropwhile`` / ``filterfalse`` /
``accumulate``), so callgrind's inclusive cost of that C function is the part's instructions:

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \\
        --callgrind-out-file=/tmp/parts.out python scripts/host_parts.py --concurrency 16
    python scripts/host_parts.py --report /tmp/parts.out --concurrency 16 --requests 200

Parts (``--parts tree``, the default): admission (``admission.admit``: match, lock, plan, dedup),
publish (``Lease.publish``: the mid-prefill insert), release (``Lease.release``: the finish
insert), page growth (``Lease.grow`` and ``CacheManager.grow_rows``), the metrics' step record;
``--parts admit``: inside admission, the match, ``Lease.admit``, dedup's two halves and the
snapshot slots. Each call of a part pays the trampoline too: ``TRAMPOLINE`` instructions (a
wrapped no-op under the same command), subtracted in the report with the calls counted here.
Runs against older trees (public names only; a part missing there is reported as 0).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: instructions a wrapped call costs beyond the part itself (a no-op wrapped, callgrind)
TRAMPOLINE = 5400
TRAMPOLINES = ("starmap", "takewhile", "dropwhile", "filterfalse", "accumulate")
#: part label -> (module, attribute path) per ``--parts``; one trampoline each, in order
PARTS = {
    "tree": [("admission", "mambacache.engine.scheduler", "admit"),
             ("publish", "mambacache.engine.leases.lease", "Lease.publish"),
             ("release", "mambacache.engine.leases.lease", "Lease.release"),
             ("page growth", "mambacache.engine.leases.lease", "Lease.grow"),
             ("metrics.on_step", "mambacache.engine.metrics", "EngineMetrics.on_step")],
    "admit": [("match", "mambacache.engine.leases.cache_manager", "CacheManager.match"),
              ("Lease.admit", "mambacache.engine.leases.lease", "Lease.admit"),
              ("dedup.shared_with_waiting", "mambacache.engine.leases.admission",
               "shared_with_waiting"),
              ("assign_snapshot_slots", "mambacache.engine.leases.lease", "assign_snapshot_slots"),
              ("dedup.inflight_branch", "mambacache.engine.leases.admission", "inflight_branch")],
}
#: also counted under "page growth" (same trampoline)
EXTRA = {"tree": [("mambacache.engine.leases.cache_manager", "CacheManager.grow_rows")]}
CALLS: dict[str, int] = {}


def _through(kind: str, fn, label: str):
    """``fn`` called through the C function of ``kind`` (its ``*_next``), counted."""
    def wrapper(*a, **k):
        CALLS[label] = CALLS.get(label, 0) + 1
        out = []
        body = (lambda *_: out.append(fn(*a, **k)))
        if kind == "starmap":
            next(itertools.starmap(body, ((),)))
        elif kind == "takewhile":
            for _ in itertools.takewhile(lambda _: body() or True, (0,)):
                pass
        elif kind == "dropwhile":
            for _ in itertools.dropwhile(body, (0,)):
                pass
        elif kind == "filterfalse":
            for _ in itertools.filterfalse(body, (0,)):
                pass
        else:
            list(itertools.accumulate((0, 0), body))
        return out[0]
    return wrapper


def _patch(parts: str) -> None:
    import importlib

    def wrap(module: str, attr: str, kind: str, label: str) -> None:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        if hasattr(owner, name):
            setattr(owner, name, _through(kind, getattr(owner, name), label))

    for (label, module, attr), kind in zip(PARTS[parts], TRAMPOLINES, strict=True):
        wrap(module, attr, kind, label)
        for m, a in EXTRA.get(parts, []) if label == "page growth" else []:
            wrap(m, a, kind, label)


def report(path: str, parts: str, requests: int, calls: dict[str, float]) -> None:
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(.*?\)\s+\S*:(\w+)", line)
        if m and m.group(2) not in found:
            found[m.group(2)] = int(m.group(1).replace(",", ""))
    print("| part | instructions per request (net of the trampoline) | calls per request |")
    print("|---|---|---|")
    print(f"| Engine.step, all of it (trampolines included) | "
          f"{found.get('functools_reduce', 0) / requests / 1e3:.1f}k | |")
    for (label, _, _), kind in zip(PARTS[parts], TRAMPOLINES, strict=True):
        n = calls.get(label, 0.0)
        net = found.get(f"{kind}_next", 0) / requests - n * TRAMPOLINE
        print(f"| {label} | {net / 1e3:.1f}k | {n:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--parts", choices=sorted(PARTS), default="tree")
    ap.add_argument("--report", default=None, help="a callgrind output of this script's run")
    args = ap.parse_args(argv)
    calls_file = Path(f"/tmp/host_parts_{args.parts}_c{args.concurrency}.calls")
    if args.report:
        calls = {}
        for line in calls_file.read_text().splitlines():
            label, n = line.rsplit("\t", 1)
            calls[label] = float(n)
        report(args.report, args.parts, args.requests, calls)
        return
    import host_instructions

    _patch(args.parts)
    host_instructions.main(["trace", "--concurrency", str(args.concurrency),
                            "--requests", str(args.requests)])
    calls_file.write_text("".join(f"{k}\t{v / args.requests}\n" for k, v in CALLS.items()))


if __name__ == "__main__":
    main()
