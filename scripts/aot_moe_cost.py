"""The MoE feed-forward compiled for a TPU without one: XLA's FLOPs against the active FLOPs.

    python scripts/aot_moe_cost.py [--presets qwen3_5_35b_a3b,...] [--tokens 64,2048]
                                   [--target v5e:2x2] [--forms pallas,ragged_dot,reference]

The first MoE layer of each real-size preset (bf16, abstract weights: nothing is allocated),
its family's ``ffn`` (router, routed experts, shared expert) jitted and compiled for a libtpu
compile-only topology in each form: ``pallas`` (the TPU family's grouped matmul, megablox
``gmm``), ``ragged_dot`` (sort + two ``lax.ragged_dot``, XLA's native TPU lowering) and
``reference`` (every expert on every token). Prints ``cost_analysis()["flops"]`` beside the
active FLOPs of ``mambacache.bench.step_cost.moe_layer_cost`` and their ratio (the gate of
issue 37: <= 1.5 for the grouped forms). XLA's GPU backend cannot be compiled for without a
GPU here; its ``RaggedDotRewriter`` turns ``ragged_dot`` into the dense product over every
expert, whose FLOPs are the ``reference`` row's. Needs the ``aot`` extra (libtpu).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.aot import tpu


def layer_flops(preset: str, tokens: int, form: str, target: str) -> dict:
    """Compile one form; ``{"xla_flops", "active_flops", "ratio"}`` or ``{"error"}``."""
    from mambacache.bench.step_cost import moe_layer_cost
    from models.params import param_shapes
    from models.presets import get_preset

    cfg = get_preset(preset)
    i = cfg.mlp_types.index("moe")
    shapes = param_shapes(cfg)["layers"][i]
    dev = tpu.device(target)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding),
                            shapes, is_leaf=lambda s: isinstance(s, tuple) and all(
                                isinstance(d, int) for d in s))
    x = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.bfloat16, sharding=sharding)
    ffn = functools.partial(cfg.model_family.ffn, cfg)
    active = moe_layer_cost(cfg, shapes["moe"], tokens, 2).flops
    try:
        with tpu.tpu_target():
            compiled = jax.jit(lambda layer, x: ffn(layer, x, form, None)).lower(
                abstract, x).compile()
    except Exception as e:  # noqa: BLE001 - reported as a line
        return {"error": " ".join(str(e).split())[:300]}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0))
    return {"xla_flops": flops, "active_flops": active, "ratio": flops / active}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="qwen3_5_35b_a3b,qwen3_next_80b_a3b,kimi_linear_48b_a3b,"
                   "nemotron_3_nano_30b_a3b,granite_4_0_h_small")
    p.add_argument("--tokens", default="64,2048")
    p.add_argument("--target", default="v5e:2x2")
    p.add_argument("--forms", default="pallas,ragged_dot,reference")
    p.add_argument("--json", help="write the rows here")
    opts = p.parse_args(argv)
    tpu.init_env(None)
    os.environ["PALLAS_FAMILY"] = "tpu"
    os.environ["PALLAS_INTERPRET"] = "0"
    rows, bad = [], 0
    print(f"{'preset':<26}{'tokens':>7} {'form':<11}{'XLA GFLOP':>11}{'active':>9}{'ratio':>8}")
    for preset in opts.presets.split(","):
        for tokens in (int(t) for t in opts.tokens.split(",")):
            for form in opts.forms.split(","):
                r = {"preset": preset, "tokens": tokens, "form": form,
                     **layer_flops(preset, tokens, form, opts.target)}
                rows.append(r)
                if "error" in r:
                    bad += 1
                    print(f"{preset:<26}{tokens:>7} {form:<11}FAIL {r['error']}")
                    continue
                print(f"{preset:<26}{tokens:>7} {form:<11}{r['xla_flops'] / 1e9:>11.2f}"
                      f"{r['active_flops'] / 1e9:>9.2f}{r['ratio']:>8.2f}")
                bad += form != "reference" and r["ratio"] > 1.5
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
