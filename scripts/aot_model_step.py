"""Compile the model's whole jitted step for a TPU without one (``kernels="pallas"``, Mosaic).

    python scripts/aot_model_step.py [--preset tiny_qwen3_next] [--targets v5e:2x2,v6e:2x2]
                                     [--dtype bfloat16]

``models.forward`` with the pools donated, prefill (T=256 over 4 sequences, 2 snapshots) and
decode (B=8), lowered on abstract inputs placed on a libtpu compile-only topology device and
compiled (XLA + Mosaic). Prints one line per program; exit status 1 if any fails. Needs the
``aot`` extra. Lives in scripts/ because ``pallas_kernels`` may not import ``models``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.aot import tpu


def _abstract(tree, dev):
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def compile_step(preset: str, target: str, dtype, decode: bool) -> str | None:
    """Compile one step program; None if it compiled, else the error's first words."""
    from mambacache.engine.runners.pools import PoolState
    from mambacache.engine.step.batch import SeqSpec, build_forward_batch
    from models import forward, get_preset, init_params

    cfg = get_preset(preset)
    page_size, pages_per_seq, seqs = 16, 32, (8 if decode else 4)
    tokens = seqs if decode else 256
    specs = [SeqSpec(tokens=[1] * (1 if decode else tokens // seqs), prefix_len=0,
                     page_ids=list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)),
                     read_slot=0, write_slot=i + 1) for i in range(seqs)]
    batch = build_forward_batch(specs, page_size, num_tokens=tokens, num_seqs=seqs,
                                num_pages_per_seq=pages_per_seq, num_snapshots=2,
                                num_logits=seqs, as_numpy=True)
    params = jax.eval_shape(functools.partial(init_params, cfg, 0, dtype))
    pools = jax.eval_shape(lambda: PoolState.create(cfg, num_pages=seqs * pages_per_seq,
                                                    page_size=page_size, num_slots=2 * seqs + 2,
                                                    dtype=dtype))
    step = jax.jit(functools.partial(forward, cfg=cfg, kernels="pallas", decode=decode),
                   donate_argnums=(1,))
    dev = tpu.device(target)
    try:
        step.lower(_abstract(params, dev), _abstract(pools, dev),
                   _abstract(jax.tree.map(jnp.asarray, batch), dev)).compile()
    except Exception as e:  # noqa: BLE001 - reported as a line
        return " ".join(str(e).split())[:300]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny_qwen3_next")
    p.add_argument("--targets", default="v5e:2x2,v6e:2x2")
    p.add_argument("--dtype", default="bfloat16")
    opts = p.parse_args(argv)
    tpu.init_env(None)
    os.environ["PALLAS_FAMILY"] = "tpu"
    os.environ["PALLAS_INTERPRET"] = "0"
    failed = 0
    for target in opts.targets.split(","):
        for decode in (False, True):
            err = compile_step(opts.preset, target, jnp.dtype(opts.dtype), decode)
            kind = "decode" if decode else "prefill"
            print(f"{target:8s} {opts.preset} {opts.dtype} {kind:8s} "
                  + ("ok" if err is None else f"FAIL {err}"))
            failed += err is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
