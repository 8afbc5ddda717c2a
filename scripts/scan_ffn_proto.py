"""Prototype (not the model): the feed-forward / MoE part of N decoder layers at real width,
compiled unrolled (a Python loop over per-layer weights, as ``models/model.py`` runs today) and
as one ``lax.scan`` over stacked weights, for a TPU topology without a chip; no pools.

    python scripts/scan_ffn_proto.py --set model.preset=qwen3_5_35b_a3b \
        --set model.dtype=bfloat16 --set parallel.tensor_parallel=4 --topology v6e:2x2 \
        --layers 8 --tokens 16 --mode scan

Each layer is ``h += ffn(rms_norm(h))`` with the model's own ``Family.ffn`` (the grouped MoE:
router, the Pallas grouped matmul kernel under ``shard_map``, the shared expert) and weights
sharded as the engine shards them (``mesh.param_shardings``; stacked: the layer axis
replicated in front). Prints compile seconds and, per device, ``cost_analysis`` bytes accessed
and flops and ``memory_analysis`` temporaries: a scan that copies each layer's sliced weights
before the kernel shows as temporaries of about one layer's weights and more bytes accessed.
``cost_analysis`` counts a loop body once, not once per trip: a scan's numbers are one layer's.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _ffn_weights(layer: dict[str, Any]) -> dict[str, Any]:
    return {k: layer[k] for k in ("post_norm", "moe", "mlp") if k in layer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--topology", default="v6e:2x2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="rows of h [T, H]")
    ap.add_argument("--mode", choices=("unrolled", "scan"), default="scan")
    ap.add_argument("--kernels", choices=("pallas", "ragged_dot"), default="pallas")
    ap.add_argument("--hlo", default="", help="write the compiled HLO text here")
    opts = ap.parse_args(argv)
    os.environ.setdefault("PALLAS_FAMILY", "tpu")
    os.environ.setdefault("PALLAS_INTERPRET", "0")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mambacache.config import EngineConfig, parse_set_args
    from mambacache.engine.runners.loading import model_dtype
    from mambacache.parallel import sizing
    from mambacache.parallel.mesh import param_shardings, replicate_kv_heads, replicated
    from mambacache.parallel.plan import _mesh_for, load_model_config
    from mambacache.parallel.topology import parse_topology

    jax.config.update("jax_enable_compilation_cache", False)
    cfg = EngineConfig.load(None, parse_set_args(opts.set))
    tp = cfg.parallel.tensor_parallel
    model_cfg = replicate_kv_heads(cfg.model.capped(load_model_config(cfg)), tp)
    mesh = _mesh_for(parse_topology(opts.topology), tp)
    dtype = model_dtype(cfg)
    layers = sizing.abstract_params(model_cfg, dtype)["layers"][:opts.layers]
    one = _ffn_weights(layers[0])
    one_sh = param_shardings({"layers": [one]}, mesh)["layers"][0]
    family, eps = model_cfg.model_family, model_cfg.rms_norm_eps

    def block(h: jax.Array, w: dict[str, Any]) -> jax.Array:
        x = family.norm(h, w["post_norm"], eps)
        return h + family.ffn(model_cfg, w, x, opts.kernels, mesh)

    if opts.mode == "unrolled":
        ws = [_ffn_weights(la) for la in layers]
        w_sh = [one_sh] * len(ws)

        def run(h, ws):
            for w in ws:
                h = block(h, w)
            return h
    else:
        ws = jax.tree.map(lambda a: jax.ShapeDtypeStruct((len(layers), *a.shape), a.dtype), one)
        w_sh = jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s.spec)), one_sh)

        def run(h, ws):
            return jax.lax.scan(lambda h, w: (block(h, w), None), h, ws)[0]

    h = jax.ShapeDtypeStruct((opts.tokens, model_cfg.hidden_size), dtype)
    fn = jax.jit(run, in_shardings=(replicated(mesh), w_sh), out_shardings=replicated(mesh))
    t0 = time.perf_counter()
    lowered = fn.lower(h, ws)
    t1, cpu1 = time.perf_counter(), _cpu_s()
    compiled = lowered.compile()
    t2, cpu2 = time.perf_counter(), _cpu_s()
    if opts.hlo:
        with open(opts.hlo, "w") as f:
            f.write(compiled.as_text())
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    mem = compiled.memory_analysis()
    w_bytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(one)) / tp
    print(f"{cfg.model.preset} {opts.mode} {opts.layers} layers, T {opts.tokens}, "
          f"{opts.kernels} on {opts.topology}: lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s "
          f"(cpu {cpu2 - cpu1:.1f}); "
          f"per device: bytes accessed {float(cost.get('bytes accessed', 0)) / 1e9:.3f} GB, "
          f"flops {float(cost.get('flops', 0)):.4g}, temp {mem.temp_size_in_bytes / 1e6:.1f} MB,"
          f" args {mem.argument_size_in_bytes / 1e9:.3f} GB; one layer's FFN weights "
          f"{w_bytes / 1e6:.1f} MB per device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
