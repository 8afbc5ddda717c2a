"""The warm-up of a bench config four ways, side by side, each start in its own process:
``sequential`` (each program compiled as it first runs, no persistent cache: before issue 38),
``ahead`` (lowered from abstract shapes and compiled in a thread pool, into a fresh persistent
cache), ``loading`` (the same, started while the weights load: ``compile.while_loading``, into
another fresh cache) and ``restart`` (``ahead``'s command again over its cache).

    python scripts/bench_warmup.py --config configs/bench/gsp_identical.toml [--set k=v ...]
                                   [--threads N] [--modes ahead,loading] [--out warmup.json]

Each start builds the engine (the model's random init or checkpoint) and runs
``Engine.warmup`` bounded as ``mambacache.bench`` bounds it (the workload's longest sequence),
then one greedy request; the table gives the engine's start, the warm-up's wall time, the start
to ready (engine + warm-up, from the child's first line), its
programs, XLA compiles, persistent-cache hits, the process's wall and CPU seconds (CPU time
says what a start costs on a loaded machine) and the tokens (the same in every start).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import mambacache as mc
from mambacache.bench.cli import load_setup, max_seq_len
from mambacache.engine.engine import Engine
from mambacache.parallel.plan import load_model_config
setup = load_setup(sys.argv[1], json.loads(sys.argv[2]))
model_cfg = setup.engine.model.capped(load_model_config(setup.engine))  # no weight read
vocab, context = model_cfg.vocab_size, model_cfg.max_position_embeddings
bound = min(max_seq_len(setup.workload.source(vocab, setup.bench.seed)), context)
engine = Engine(setup.engine, warmup_max_seq_len=bound)
t1 = time.perf_counter()
warm = engine.warmup(bound)
t2 = time.perf_counter()
out = engine.generate([[5, 17, 3, 99]], mc.SamplingParams(max_new_tokens=4))
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"engine_s": t1 - t0, "ready_s": t2 - t0, "warm": warm,
                  "tokens": out[0].output_token_ids,
                  "total_s": time.perf_counter() - t0, "cpu_s": use.ru_utime + use.ru_stime}))
"""


#: ``loading``: ahead of time with ``compile.while_loading`` on (issue 38 item 2), into a
#: fresh cache of its own; ``ahead`` has it off
MODES = ("sequential", "ahead", "loading", "restart")


def start(config: str, overrides: dict) -> dict:
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", CHILD, config, json.dumps(overrides)],
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-4000:])
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return out | {"process_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    from mambacache.config import parse_set_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--threads", type=int, default=0, help="compile.threads (0: CPU count)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, in order, of {','.join(MODES)} (repeats allowed: "
                         "alternating pairs; restart: over the last ahead's cache)")
    ap.add_argument("--out")
    opts = ap.parse_args(argv)
    base = parse_set_args(opts.set) | {"compile.threads": opts.threads}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        last_ahead = str(Path(root) / "none")
        for i, name in enumerate(opts.modes.split(",")):
            fresh = str(Path(root) / str(i))  # each cold start its own empty cache
            last_ahead = fresh if name == "ahead" else last_ahead
            modes = {"sequential": base | {"compile.ahead_of_time": False,
                                           "compile.cache_dir": "off"},
                     "ahead": base | {"compile.cache_dir": fresh,
                                      "compile.while_loading": "off"},
                     "loading": base | {"compile.cache_dir": fresh,
                                        "compile.while_loading": "on"},
                     "restart": base | {"compile.cache_dir": last_ahead}}
            results[name if name not in results else f"{name}#{i}"] = start(opts.config,
                                                                            modes[name])
    print(f"{'start':11s} {'engine s':>8s} {'warm-up s':>9s} {'ready s':>8s} {'programs':>8s} "
          f"{'compiles':>8s} {'hits':>5s} {'threads':>7s} {'process s':>9s} {'CPU s':>7s}")
    for name, r in results.items():
        w = r["warm"]
        print(f"{name:11s} {r['engine_s']:8.1f} {w['seconds']:9.1f} {r['ready_s']:8.1f} "
              f"{w['programs']:8d} {w['compiles']:8d} {w['cache_hits']:5d} "
              f"{w.get('threads', 1):7d} {r['process_s']:9.1f} {r['cpu_s']:7.1f}")
    same = len({tuple(r["tokens"]) for r in results.values()}) == 1
    print(f"same tokens in every start: {same}")
    if opts.out:
        Path(opts.out).write_text(json.dumps(results, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
