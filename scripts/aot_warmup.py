"""A real-size engine's warm-up compiled for a TPU slice without one: its program set, in a
thread pool, through JAX's persistent compile cache (run it twice: cold, then from the cache).

    python scripts/aot_warmup.py --set model.preset=qwen3_5_35b_a3b --set model.dtype=bfloat16 \
        --set parallel.tensor_parallel=4 --set cache.page_size=16 \
        --set model.context_length=32768 --topology v6e:2x2 --cache-dir DIR [--limit N]

The programs are ``warmup.engine_buckets``' program set for the config (the engine's own shape
rules), each the engine's step callable for the topology's platform
(``sampler_program.step_callables``: the fused ``step_program.jitted_sharded_step``, or with
``compile.separate_sampler`` on, as ``auto`` is on TPU, the step without its sampler plus the
sampler program once per logits-row count; Mosaic kernels) lowered on abstract sharded params
and pools (``parallel/sizing.step_args``: nothing
allocated) and compiled for the topology's compile-only devices, ``--threads`` at a time,
largest first (``--limit N``: the N largest). Prints each program's seconds and whether it came
from the cache, then the total wall and CPU time. Needs the ``aot`` extra.

libtpu's compile-only client writes cache entries but cannot load them ("PjRtCompiler must be
constructed with a Client to call DeserializeLoadedExecutable", jax 0.10.2 / libtpu 0.0.42):
a second run compiles again, so from-the-cache numbers need a TPU host.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from mambacache.config import EngineConfig, parse_set_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--cache-dir", required=True, help="the persistent compile cache")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--limit", type=int, default=0, help="only the N largest programs")
    opts = ap.parse_args(argv)
    os.environ.setdefault("PALLAS_FAMILY", "tpu")
    os.environ.setdefault("PALLAS_INTERPRET", "0")
    cfg = EngineConfig.load(None, parse_set_args(opts.set) | {"compile.cache_dir": opts.cache_dir})
    t0 = time.perf_counter()
    from mambacache.engine.runners.compile_cache import use_compile_cache
    from mambacache.engine.runners.compiles import CompileCounter
    from mambacache.engine.runners.loading import model_dtype
    from mambacache.engine.runners.sampler_program import separate_sampler_on, step_callables
    from mambacache.engine.runners.warmup import engine_buckets
    from mambacache.engine.speculative.verify import max_rows
    from mambacache.engine.step.buckets import bucket
    from mambacache.parallel import sizing
    from mambacache.parallel.mesh import pool_shardings, replicate_kv_heads, replicated
    from mambacache.parallel.plan import _mesh_for, load_model_config
    from mambacache.parallel.topology import parse_topology

    use_compile_cache(cfg.compile)
    tp = cfg.parallel.tensor_parallel
    model_cfg = replicate_kv_heads(cfg.model.capped(load_model_config(cfg)), tp)
    mesh = _mesh_for(parse_topology(opts.topology), tp)
    dtype, page_size = model_dtype(cfg), cfg.cache.page_size
    params = sizing.abstract_params(model_cfg, dtype)
    pools = sizing.abstract_pools(model_cfg, 64, page_size,
                                  cfg.scheduler.max_running_requests + 1, dtype)
    shapes = engine_buckets(cfg, model_cfg, bucket(max_rows(cfg), 1)).program_set()
    shapes = sorted(shapes, key=lambda s: -s.compile_weight)
    shapes = shapes[:opts.limit] if opts.limit else shapes
    counter = CompileCounter()
    platform = next(iter(mesh.devices.flat)).platform
    split = separate_sampler_on(cfg.compile.separate_sampler, platform)

    def compile_one(shape) -> tuple[float, int]:
        args = sizing.step_args(shape, page_size, params, pools, mesh)
        fn = step_callables(model_cfg, "pallas", separate=split, mesh=mesh,
                            pool_sh=pool_shardings(pools, mesh),
                            out_sh=replicated(mesh))[shape.decode]
        hits = counter.cache_hits
        t = time.perf_counter()
        with counter.track():
            fn.lower(*args).compile()
        return time.perf_counter() - t, counter.cache_hits - hits

    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(opts.threads) as pool:
        futures = {pool.submit(compile_one, s): s for s in shapes}
        for fut in concurrent.futures.as_completed(futures):
            s, (seconds, hit) = futures[fut], fut.result()
            print(f"{s.describe()}: {seconds:7.1f} s{' (cache hit)' if hit else ''}",
                  flush=True)
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{cfg.model.preset} {cfg.model.dtype} TP {tp} on {opts.topology}: {len(shapes)} "
          f"programs (sampler {'split' if split else 'fused'}) in "
          f"{time.perf_counter() - t1:.1f} s wall ({opts.threads} threads; setup "
          f"{setup_s:.1f} s), {counter.compiles} compiled, {counter.cache_hits} from the cache, "
          f"process CPU {use.ru_utime + use.ru_stime:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
