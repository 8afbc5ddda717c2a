"""Where one real-size step program's compile time goes: tracing, lowering and XLA compile,
cold, for a TPU topology without a chip (libtpu compile-only) or this machine (``local``).

    python scripts/compile_split.py --set model.preset=qwen3_5_35b_a3b \
        --set model.dtype=bfloat16 --set parallel.tensor_parallel=4 --set cache.page_size=16 \
        --set model.context_length=32768 --topology v6e:2x2 --program decode --layers 8

``--list`` prints the config's program set (``warmup.engine_buckets``, the engine's own shape
rules) and the layer count. ``--program decode`` is the widest decode program, ``extend`` the
extend program with ``--tokens`` tokens and the most pages. ``--layers N`` keeps the model's
first N layers (a multiple of the repeating block keeps its 3 linear + 1 attention pattern).
The program is the engine's jitted step (``step_program.jitted_sharded_step``) on abstract
sharded params and pools (``parallel/sizing.step_args``: nothing allocated), traced
(``jit(...).trace``: jaxpr), lowered (StableHLO) and compiled, with no persistent cache,
after a one-element program is compiled first (the backend's one-time start-up, timed apart).
Prints each stage's wall and process CPU seconds, the custom calls in the lowered module (all
and distinct bodies; JAX emits one function per distinct jitted callee, called per layer),
the compiled module's instruction count and Mosaic calls (one per call site once XLA
inlines the functions) and ``cost_analysis`` flops / bytes accessed.
``--kernels reference`` compiles the plain-jnp references instead of the Pallas kernels (what
``auto`` means on CPU). ``--part logits`` / ``--part sampler_program``: the two programs a step
is with ``compile.separate_sampler`` (``engine/runners/sampler_program.py``); ``--rows N``: the
program's logits rows (the sampler program's row count: 4, 8 or 16 in a usual set).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from typing import Any


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _timed(label: str, fn: Callable[[], Any], out: dict[str, float]) -> Any:
    wall, cpu = time.perf_counter(), _cpu_s()
    result = fn()
    out[f"{label}_s"], out[f"{label}_cpu_s"] = time.perf_counter() - wall, _cpu_s() - cpu
    return result


def custom_calls(module_text: str) -> tuple[int, int, dict[str, int]]:
    """(custom calls, distinct call bodies, calls per target) in a StableHLO module's text.
    A body is the call line without its SSA names, so two layers calling the same kernel with
    the same serialised payload count once."""
    lines = [ln for ln in module_text.splitlines() if "stablehlo.custom_call" in ln]
    per_target: dict[str, int] = {}
    bodies = set()
    for ln in lines:
        target = re.search(r"custom_call\s*@([\w.]+)", ln)
        name = target.group(1) if target else "?"
        per_target[name] = per_target.get(name, 0) + 1
        bodies.add(re.sub(r"%[\w#.]+", "%", ln.split("=", 1)[-1]))
    return len(lines), len(bodies), per_target


def truncated(model_cfg: Any, layers: int) -> Any:
    """``model_cfg`` with its first ``layers`` layers (0: all)."""
    if not layers:
        return model_cfg
    if layers > model_cfg.num_hidden_layers:
        raise ValueError(f"--layers {layers} exceeds the model's {model_cfg.num_hidden_layers}")
    return dataclasses.replace(model_cfg, layer_types=model_cfg.layer_types[:layers],
                               mlp_types=model_cfg.mlp_types[:layers])


def pick(shapes: list, program: str, tokens: int) -> Any:
    """The widest decode program, or the extend program of ``tokens`` tokens with most pages."""
    if program == "decode":
        return max((s for s in shapes if s.decode),
                   key=lambda s: (s.num_tokens, s.num_pages_per_seq))
    found = [s for s in shapes if not s.decode and s.num_tokens == tokens]
    if not found:
        have = sorted({s.num_tokens for s in shapes if not s.decode})
        raise ValueError(f"no extend program of {tokens} tokens; the set has {have}")
    return max(found, key=lambda s: s.num_pages_per_seq)


def _part(part: str, step: Any, args: tuple, model_cfg: Any, kernels: str, shape: Any,
          mesh: Any) -> tuple[Any, tuple]:
    """The jitted function and its abstract arguments of ``part``: the engine's step, the model
    forward alone (params, pools donated, batch), the sampler alone (logits ``[L, V]``
    float32 replicated, the step's sampling rows), or the two programs of
    ``compile.separate_sampler`` (``engine/runners/sampler_program.py``): ``logits``, the step
    without its sampler (``step_program.jitted_step_logits``), and ``sampler_program``, the
    sampler program (logits, sampling rows, the carry donated; replicated outputs)."""
    import functools

    import jax
    import jax.numpy as jnp

    from mambacache.engine.runners.sampler_program import jitted_sampler
    from mambacache.engine.runners.step_program import jitted_step_logits
    from mambacache.engine.sampling.sampler import sample
    from mambacache.parallel.mesh import pool_shardings, replicated
    from models.model import forward
    from pallas_kernels import ops

    if part == "step":
        return step, args
    if part == "forward":
        fn = jax.jit(functools.partial(forward, cfg=model_cfg, kernels=kernels,
                                       decode=shape.decode, mesh=mesh), donate_argnums=(1,))
        return fn, (args[0], args[1], args[3])
    if part == "logits":
        fn = jitted_step_logits(model_cfg, kernels, shape.decode, ops.kernel_family(),
                                pool_shardings(args[1], mesh), replicated(mesh), mesh)
        return fn, args[:4] + args[5:]
    logits = jax.ShapeDtypeStruct((shape.num_logits, model_cfg.vocab_size), jnp.float32,
                                  sharding=replicated(mesh))
    if part == "sampler_program":
        return jitted_sampler(False, replicated(mesh)), (logits, args[4], args[2])
    return jax.jit(sample), (logits, args[4])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--program", choices=("decode", "extend"), default="decode")
    ap.add_argument("--tokens", type=int, default=128, help="extend program's tokens")
    ap.add_argument("--layers", type=int, default=0, help="the first N layers (0: all)")
    ap.add_argument("--kernels", choices=("pallas", "reference"), default="pallas")
    ap.add_argument("--part", choices=("step", "forward", "sampler", "logits",
                                       "sampler_program"), default="step",
                    help="the whole step, the model forward alone, the sampler alone, or the "
                         "two programs of compile.separate_sampler: the step without its "
                         "sampler (logits) and the sampler program")
    ap.add_argument("--rows", type=int, default=0,
                    help="the program's logits rows (0: its own; the sampler parts' row count)")
    ap.add_argument("--list", action="store_true", help="print the program set and stop")
    ap.add_argument("--dump", default="", help="write the lowered module's text here")
    opts = ap.parse_args(argv)
    local = opts.topology == "local"
    os.environ.setdefault("PALLAS_FAMILY", "tpu")
    os.environ.setdefault("PALLAS_INTERPRET", "1" if local else "0")
    import jax
    import jax.numpy as jnp

    from mambacache.config import EngineConfig, parse_set_args
    from mambacache.engine.runners.loading import model_dtype
    from mambacache.engine.runners.step_program import jitted_sharded_step
    from mambacache.engine.runners.warmup import engine_buckets
    from mambacache.engine.speculative.verify import max_rows
    from mambacache.engine.step.buckets import bucket
    from mambacache.parallel import sizing
    from mambacache.parallel.mesh import make_mesh, pool_shardings, replicate_kv_heads, replicated
    from mambacache.parallel.plan import _mesh_for, load_model_config
    from mambacache.parallel.topology import parse_topology

    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    cfg = EngineConfig.load(None, parse_set_args(opts.set))
    tp = cfg.parallel.tensor_parallel
    full_cfg = replicate_kv_heads(cfg.model.capped(load_model_config(cfg)), tp)
    shapes = engine_buckets(cfg, full_cfg, bucket(max_rows(cfg), 1)).program_set()
    if opts.list:
        print(f"{full_cfg.num_hidden_layers} layers {full_cfg.layer_types[:4]}...; "
              f"{len(shapes)} programs")
        for s in sorted(shapes, key=lambda s: (s.decode, s.num_tokens, s.num_pages_per_seq)):
            print(f"  {s}")
        return 0
    model_cfg = truncated(full_cfg, opts.layers)
    shape = pick(list(shapes), opts.program, opts.tokens)
    if opts.rows:
        shape = dataclasses.replace(shape, num_logits=opts.rows)
    mesh = make_mesh(tp) if local else _mesh_for(parse_topology(opts.topology), tp)
    dtype, page_size = model_dtype(cfg), cfg.cache.page_size
    params = sizing.abstract_params(model_cfg, dtype)
    pools = sizing.abstract_pools(model_cfg, 64, page_size,
                                  cfg.scheduler.max_running_requests + 1, dtype)
    args = sizing.step_args(shape, page_size, params, pools, mesh)
    fn = jitted_sharded_step(model_cfg, opts.kernels, shape.decode,
                             pool_shardings(pools, mesh), replicated(mesh), mesh)
    fn, args = _part(opts.part, fn, args, model_cfg, opts.kernels, shape, mesh)
    t: dict[str, float] = {}
    tiny = jax.jit(lambda x: x + 1, in_shardings=replicated(mesh), out_shardings=replicated(mesh))
    _timed("init", lambda: tiny.lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile(), t)
    traced = _timed("trace", lambda: fn.trace(*args), t)
    lowered = _timed("lower", traced.lower, t)
    text = lowered.as_text()
    if opts.dump:
        with open(opts.dump, "w") as f:
            f.write(text)
    compiled = _timed("compile", lowered.compile, t)
    calls, distinct, per_target = custom_calls(text)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    hlo = compiled.as_text().splitlines()
    hlo_ops = sum(1 for ln in hlo if " = " in ln)
    hlo_calls = sum(1 for ln in hlo if "custom-call(" in ln and "custom_call_target=" in ln
                    and "tpu_custom_call" in ln)
    print(f"{cfg.model.preset} {cfg.model.dtype} TP {tp} on {opts.topology} ({opts.kernels}, "
          f"{opts.part}), "
          f"{model_cfg.num_hidden_layers} layers, {shape}")
    print(f"first tiny compile (one-time init) {t['init_s']:.1f} s (cpu {t['init_cpu_s']:.1f}); "
          f"trace {t['trace_s']:.1f} s (cpu {t['trace_cpu_s']:.1f}), lower {t['lower_s']:.1f} s "
          f"(cpu {t['lower_cpu_s']:.1f}), compile {t['compile_s']:.1f} s "
          f"(cpu {t['compile_cpu_s']:.1f})")
    print(f"jaxpr eqns {len(traced.jaxpr.eqns)}, stablehlo lines {text.count(chr(10))}, "
          f"custom calls {calls} ({distinct} distinct) {per_target}, compiled hlo instrs "
          f"{hlo_ops} (Mosaic custom calls {hlo_calls}), flops "
          f"{float(cost.get('flops', 0)):.4g}, bytes accessed "
          f"{float(cost.get('bytes accessed', 0)):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
