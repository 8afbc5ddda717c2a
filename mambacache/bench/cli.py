"""``python -m mambacache.bench --config configs/bench/<name>.toml``: cache on vs off, one process.

The TOML is a full engine config ([model] [cache] [scheduler] [parallel]) plus ``[workload]``
(``kind`` = one of ``workloads.WORKLOADS``, then that kind's fields) and ``[bench]``
(``bench_runner.BenchSection``). ``--set section.key=value`` overrides any of them.

Both modes share one loaded model and, through ``jitted_step``'s cache, the compiled programs.
Warm-up covers the timed passes by construction: every engine first runs ``Engine.warmup``
bounded by the workload's longest request (``workloads.max_seq_len``), which compiles every step
shape a request within that bound can take; then ``bench.warmup`` untimed passes run the whole
workload per mode. Compiles are counted from JAX's own events: ``timed_compiles`` (and
``timed_compile_s``) per mode must be 0; a timed pass that compiled is flagged in the table and
the JSON (``compiled_while_timed``) and fails the run under ``--strict``.
Timed passes alternate on/off (``repeats`` pairs, who goes first alternating); medians reported.

A config with ``[speculative] method != "none"`` compares speculative decoding on vs off instead
(``spec_on`` / ``spec_off``, the cache as configured): same model, same workload, same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging as absl_logging

from mambacache.bench.report import format_table, modes_of, ratios, write_json, write_plot
from mambacache.bench.runner import BenchSection, run_pass
from mambacache.bench.workloads import max_seq_len, workload_from_dict
from mambacache.config import (
    EngineConfig,
    apply_overrides,
    build_sections,
    parse_set_args,
    read_toml,
)

MODES = {"cache_on": True, "cache_off": False}
SPEC_MODES = ("spec_on", "spec_off")


def mode_configs(engine: EngineConfig) -> dict[str, EngineConfig]:
    """The two engine configs a benchmark compares, by mode name (on first)."""
    if engine.speculative.enabled:
        return {"spec_on": engine, "spec_off": engine.replace(**{"speculative.method": "none"})}
    return {m: engine.replace(**{"cache.enable": on}) for m, on in MODES.items()}


@dataclasses.dataclass(frozen=True)
class BenchSetup:
    engine: EngineConfig
    workload: Any
    bench: BenchSection


def load_setup(path: str, overrides: dict[str, Any] | None = None) -> BenchSetup:
    """Parse the TOML at ``path`` with dotted ``overrides`` into the three configs."""
    data = apply_overrides(read_toml(path), overrides or {})
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(data) - engine_names - {"workload", "bench"})
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown} in {path!r}")
    if "workload" not in data:
        raise ValueError(f"{path!r} has no [workload] section")
    engine = EngineConfig.from_dict({k: v for k, v in data.items() if k in engine_names})
    return BenchSetup(engine, workload_from_dict(data["workload"]),
                      build_sections(BenchSection, data.get("bench", {})))


def _median_dict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            out[key] = value
        else:
            out[key] = float(np.median([r[key] for r in runs]))
            if isinstance(value, int):
                out[key] = int(round(out[key]))
    return out


def run_bench(setup: BenchSetup, *, progress: bool = True) -> dict[str, Any]:
    """Warm up, then time ``repeats`` alternating on/off pairs; the JSON-ready result."""
    from mambacache.engine.engine import Engine, load_model
    from mambacache.engine.runners.compile_cache import use_compile_cache

    use_compile_cache(setup.engine.compile)  # the random init's compiles too
    t = time.perf_counter()
    model = load_model(setup.engine)
    load_s = time.perf_counter() - t
    vocab, context = model[0].vocab_size, model[0].max_position_embeddings
    cfgs = mode_configs(setup.engine)
    modes = list(cfgs)
    bound = min(max_seq_len(setup.workload.source(vocab, setup.bench.seed)), context)
    warm = {"programs": 0, "compiles": 0, "compile_s": 0.0}

    def one_pass(mode: str, label: str, show: bool) -> dict[str, Any]:
        engine = Engine(cfgs[mode], model=model)
        w = engine.warmup(bound)  # untimed; after the first engine nothing compiles here
        warm.update(programs=w["programs"], compiles=warm["compiles"] + w["compiles"],
                    compile_s=warm["compile_s"] + w["compile_s"])
        source = setup.workload.source(vocab, setup.bench.seed)
        return run_pass(engine, source, setup.bench, label=label, progress=show)

    t = time.perf_counter()
    for i in range(setup.bench.warmup):
        for mode in modes:
            stats = one_pass(mode, f"warmup {i + 1} {mode}", progress)
            warm.update(compiles=warm["compiles"] + stats["pass_compiles"],
                        compile_s=warm["compile_s"] + stats["pass_compile_s"])
    warmup_s = time.perf_counter() - t
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(setup.bench.repeats):
        order = modes if r % 2 == 0 else modes[::-1]
        for mode in order:
            runs[mode].append(one_pass(mode, f"run {r + 1} {mode}", progress))
    result: dict[str, Any] = {"model_load_s": load_s, "warmup_s": warmup_s,
                              "warmup_max_seq_len": bound, "warmup_programs": warm["programs"],
                              "warmup_programs_compiled": warm["compiles"],
                              "warmup_compile_s": warm["compile_s"], "modes": modes}
    for mode in modes:
        result[mode] = {**_median_dict(runs[mode]), **timed_compiles(runs[mode])}
    result["ratios"] = ratios(result[modes[0]], result[modes[1]])
    result["runs"] = {m: [{k: r[k] for k in ("request_throughput", "input_throughput",
                                             "output_throughput", "duration_s",
                                             "pass_compiles")}
                          for r in runs[m]] for m in modes}
    return result


def timed_compiles(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the timed passes of one mode compiled, summed (JAX's events; 0 when warm)."""
    functions: dict[str, int] = {}
    for r in runs:
        for name, n in r["pass_compiled_functions"].items():
            functions[name] = functions.get(name, 0) + n
    n = sum(r["pass_compiles"] for r in runs)
    return {"timed_compiles": n, "timed_compile_s": sum(r["pass_compile_s"] for r in runs),
            "compiled_while_timed": n > 0, "timed_compiled_functions": functions}


def compiled_while_timed(result: dict[str, Any]) -> list[str]:
    """The modes whose timed passes compiled anything."""
    return [m for m in modes_of(result) if result[m].get("timed_compiles")]


def machine_info() -> dict[str, Any]:
    import jax

    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mambacache.bench", description=__doc__.split(
        "\n")[0])
    p.add_argument("--config", required=True, help="TOML: engine sections + [workload] [bench]")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--out", help="write the results as one JSON object")
    p.add_argument("--plot", help="write a PNG plot (needs the 'plot' extra: matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a timed pass compiled anything (JAX's compile events)")
    p.add_argument("-v", "--verbosity", type=int, default=-1,
                   help="absl log level: -1 warnings (default), 0 info, 1 preemptions")
    args = p.parse_args(argv)
    absl_logging.set_verbosity(args.verbosity)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    overrides = parse_set_args(args.set)
    setup = load_setup(args.config, overrides)
    if args.plot:
        from mambacache.bench.report import require_matplotlib

        require_matplotlib()  # fail before the run, not after it
    progress = setup.bench.progress and not args.quiet
    result = run_bench(setup, progress=progress)
    result = {"config": args.config, "overrides": overrides,
              "workload": {"kind": _kind(setup.workload), **dataclasses.asdict(setup.workload)},
              "bench": dataclasses.asdict(setup.bench),
              "engine": dataclasses.asdict(setup.engine), "machine": machine_info(), **result}
    print(format_table(result), file=sys.stdout)
    if args.out:
        write_json(result, args.out)
    if args.plot:
        write_plot(result, args.plot)
    bad = compiled_while_timed(result)
    if args.strict and bad:
        raise SystemExit("--strict: timed passes compiled " + ", ".join(
            f"{m}: {result[m]['timed_compiles']} ({result[m]['timed_compile_s']:.1f} s, "
            f"{result[m]['timed_compiled_functions']})" for m in bad))
    return result


def _kind(workload: Any) -> str:
    from mambacache.bench.workloads import WORKLOADS

    return next(k for k, cls in WORKLOADS.items() if isinstance(workload, cls))


if __name__ == "__main__":
    main()
