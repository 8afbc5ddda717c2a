"""Time every Pallas kernel against its plain-jnp reference on the current backend.

    python -m pallas_kernels.bench [--large] [--iters N] [--out PATH]

Prints, per op and impl, the median time, the achieved bytes/s and FLOP/s (algorithmic counts:
the inputs/outputs and states each op must move, the token-recurrence FLOPs) and, where the
device is known, the fraction of its roofline (H200: 4.8 TB/s HBM, ~990 bf16 dense TFLOP/s).
The kernels are the backend's family (``ops.kernel_family``: Triton on GPU, Mosaic on TPU;
``PALLAS_FAMILY`` overrides). On CPU they run interpreted, so their times there say nothing
about the kernel's speed (with ``--large`` they are skipped); the reference times are
XLA-compiled.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import interpret_default
from pallas_kernels.ops import FAMILIES, kernel_family
from pallas_kernels.reference import causal_conv1d as conv
from pallas_kernels.reference import gated_delta_rule as gdr
from pallas_kernels.reference import paged_attention as attn
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args

ROOFLINES = {  # device_kind substring -> (bytes/s, bf16 FLOP/s)
    "H200": (4.8e12, 990e12), "H100": (3.35e12, 990e12), "v5 lite": (819e9, 197e12),
    "v5e": (819e9, 197e12), "v6": (1640e9, 918e12), "v5p": (2765e9, 459e12),
    "v4": (1200e9, 275e12),
}


def _roofline():
    kind = jax.devices()[0].device_kind
    return kind, next((v for k, v in ROOFLINES.items() if k.lower() in kind.lower()), None)


def _time(fn, args, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gdr_cases(size):
    t, b, hk, hv, d = (4096, 8, 16, 32, 128) if size == "large" else (256, 4, 2, 4, 64)
    rng = np.random.default_rng(0)
    lens = [t // b - 3 * i for i in range(b)]
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=[(0, 7), (1, 64)])
    x = gdr_inputs(rng, case, hk, hv, d, d)
    for n in "qkv":
        x[n] = jnp.asarray(x[n], jnp.bfloat16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + list(slot_args(case))
    state = hv * d * d * 4
    ext = dict(args=args, bytes=t * (2 * hk * d + 2 * hv * d) * 2 + t * hv * 8
               + (2 * b + 2) * state, flops=6 * t * hv * d * d)
    dec_args = [a[:b] for a in args[:5]] + [args[5], case.read_slot, case.write_slot]
    dec = dict(args=dec_args, bytes=2 * b * state + b * (2 * hk + 2 * hv) * d * 2,
               flops=6 * b * hv * d * d)
    return ext, dec


def _conv_case(size):
    t, b, c, kw = (4096, 8, 8192, 4) if size == "large" else (256, 4, 256, 4)
    rng = np.random.default_rng(1)
    case = ragged_case(rng, [t // b] * b, num_tokens=t, num_seqs=b, snapshots=[(0, 5)])
    x = jnp.asarray(rng.normal(size=(t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(kw, c)), jnp.bfloat16)
    pool = jnp.zeros((case.num_slots, kw - 1, c), jnp.bfloat16)
    return dict(args=[x, w, None, pool] + list(slot_args(case)), bytes=2 * t * c * 2,
                flops=2 * kw * t * c)


def _attn_case(size):
    b, ext, prefix, hq, hkv, d, ps = ((8, 512, 1536, 16, 2, 256, 16) if size == "large"
                                      else (4, 32, 96, 4, 1, 64, 16))
    rng = np.random.default_rng(2)
    per = (ext + prefix) // ps
    pages = jnp.asarray(rng.normal(size=(b * per + 1, ps, hkv, d)), jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(b * per).reshape(b, per), jnp.int32)
    cu = jnp.asarray(np.arange(b + 1) * ext, jnp.int32)
    seq_lens = jnp.full((b,), ext + prefix, jnp.int32)
    q = jnp.asarray(rng.normal(size=(b * ext, hq, d)), jnp.bfloat16)
    pairs = b * sum(prefix + i + 1 for i in range(ext))
    return dict(args=[q, pages, pages, cu, seq_lens, table],
                bytes=2 * b * ext * hq * d * 2 + 2 * b * (ext + prefix) * hkv * d * 2,
                flops=4 * pairs * hq * d)


def run(size: str, iters: int) -> list[dict]:
    family = kernel_family()
    kern = FAMILIES[family]
    interp = interpret_default(family)
    gdr_ext, gdr_dec = _gdr_cases(size)
    ops = {
        "gated_delta_rule_extend": (gdr_ext, gdr.gated_delta_rule_extend_reference,
                                    functools.partial(kern.gdr_extend, interpret=interp)),
        "gated_delta_rule_decode": (gdr_dec, gdr.gated_delta_rule_decode_reference,
                                    functools.partial(kern.gdr_decode, interpret=interp)),
        "causal_conv1d_extend": (_conv_case(size), conv.causal_conv1d_extend_reference,
                                 functools.partial(kern.conv_extend, interpret=interp)),
        "paged_attention": (_attn_case(size), functools.partial(
            attn.paged_attention_reference, scale=0.0625), functools.partial(
            kern.paged_attention, scale=0.0625, interpret=interp)),
    }
    rows = []
    for name, (case, ref_fn, kern_fn) in ops.items():
        args = [None if a is None else jnp.asarray(a) for a in case["args"]]
        impls = [("reference", ref_fn), ("pallas", kern_fn)]
        if interp and size == "large":  # interpreted kernels at these sizes take minutes
            impls = impls[:1]
        for impl, fn in impls:
            seconds = _time(jax.jit(fn), args, iters)  # outer jit: the pools are not donated
            rows.append(dict(op=name, impl=impl if impl == "reference" else f"pallas-{family}",
                             interpret=interp and impl == "pallas",
                             ms=seconds * 1e3, bytes_per_s=case["bytes"] / seconds,
                             flops_per_s=case["flops"] / seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="production-like sizes (GPU/TPU)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", help="write the rows as JSON here")
    opts = parser.parse_args()
    kind, roof = _roofline()
    rows = run("large" if opts.large else "small", opts.iters)
    print(f"backend {jax.default_backend()} ({kind}); roofline "
          + (f"{roof[0] / 1e12:.2f} TB/s, {roof[1] / 1e12:.0f} TFLOP/s" if roof else "unknown"))
    print(f"{'op':26s} {'impl':22s} {'ms':>9s} {'GB/s':>9s} {'GFLOP/s':>10s} "
          f"{'%HBM':>6s} {'%FLOP':>6s}")
    for r in rows:
        frac = (f"{100 * r['bytes_per_s'] / roof[0]:6.1f} {100 * r['flops_per_s'] / roof[1]:6.1f}"
                if roof else f"{'-':>6s} {'-':>6s}")
        label = r["impl"] + (" (interp)" if r["interpret"] else "")
        print(f"{r['op']:26s} {label:22s} {r['ms']:9.3f} {r['bytes_per_s'] / 1e9:9.2f} "
              f"{r['flops_per_s'] / 1e9:10.2f} {frac}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(device=kind, roofline=roof, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
