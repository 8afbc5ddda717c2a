"""Time every Pallas kernel against its plain-jnp reference on the current backend.

    python -m pallas_kernels.bench [--large] [--iters N] [--out PATH]

Prints, per op and impl, the median time, the achieved bytes/s and FLOP/s (algorithmic counts:
the inputs/outputs and states each op must move; the chunked algorithm's FLOPs for the prefill)
and, where the device is known, the fraction of its HBM bandwidth and of the dense peak of the
dtype the kernel computes in (``COMPUTE_DTYPE``; e.g. H200 fp32 67, tf32 494, bf16 989 TFLOP/s).
The pools are donated in the timed jit (a fresh copy per call, made outside the timing), as
the engine donates them; decode runs at B=64 with ``--large``.
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
from pallas_kernels.reference import kda as kda_ref
from pallas_kernels.reference import mla_attention as mla
from pallas_kernels.reference import paged_attention as attn
from pallas_kernels.reference import ssd as ssd_ref
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args

# device_kind -> HBM bytes/s and dense peak FLOP/s per compute dtype (None: not published).
# Exact device_kind first ("TPU v5" is v5p, "TPU v5 lite" v5e), then a substring (GPUs).
_V5E = (819e9, {"bfloat16": 197e12, "float32": None})
ROOFLINES = {
    "TPU v5 lite": _V5E, "TPU v5e": _V5E,
    "TPU v5": (2765e9, {"bfloat16": 459e12, "float32": None}),
    "TPU v5p": (2765e9, {"bfloat16": 459e12, "float32": None}),
    "TPU v6 lite": (1640e9, {"bfloat16": 918e12, "float32": None}),
    "TPU v6e": (1640e9, {"bfloat16": 918e12, "float32": None}),
    "TPU v4": (1200e9, {"bfloat16": 275e12, "float32": None}),
    "H200": (4.8e12, {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),
    "H100": (3.35e12, {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}),
}
# The dtype each kernel's FLOPs run in, per family: the Mosaic kernels compute in f32 (inputs
# upcast); the Triton GDR products use tf32 tensor cores, its attention bf16 operands; the Triton
# KDA products are tf32 too (W, U and the state products 3 passes: its %FLOP counts one).
COMPUTE_DTYPE = {
    "tpu": {"gated_delta_rule_extend": "float32", "gated_delta_rule_decode": "float32",
            "causal_conv1d_extend": "float32", "paged_attention": "float32",
            "mla_attention": "float32", "mla_attention_decode": "float32",
            "ssd_extend": "float32", "kda_extend": "float32"},
    "gpu": {"gated_delta_rule_extend": "tf32", "gated_delta_rule_decode": "float32",
            "causal_conv1d_extend": "float32", "paged_attention": "bfloat16",
            "mla_attention": "bfloat16", "mla_attention_decode": "bfloat16",
            "ssd_extend": "bfloat16", "kda_extend": "tf32"},
}


def roofline(kind: str):
    """``(bytes/s, {dtype: FLOP/s})`` of a ``device_kind``, or None if unknown."""
    if kind in ROOFLINES:
        return ROOFLINES[kind]
    return next((v for k, v in ROOFLINES.items()
                 if not k.startswith("TPU") and k.lower() in kind.lower()), None)


def _roofline():
    kind = jax.devices()[0].device_kind
    return kind, roofline(kind)


def _time(fn, args, iters, donate: int | None = None):
    """Median seconds of ``fn(*args)``; with ``donate`` (the pool's index, donated by ``fn``) a
    fresh copy of that argument is made before each call, outside the timed region."""
    def call():
        a = list(args)
        if donate is not None:
            a[donate] = jax.block_until_ready(jnp.copy(args[donate]))
        start = time.perf_counter()
        jax.block_until_ready(fn(*a))
        return time.perf_counter() - start

    call()
    return statistics.median(call() for _ in range(iters))


def gdr_chunked_flops(num_tokens: int, num_seqs: int, hv: int, dk: int, dv: int,
                      chunk: int = 64) -> int:
    """FLOPs of the chunked prefill (what the kernels compute, padding chunks excluded): per
    (chunk, head) the K K^T and Q K^T products, the triangular inverse (BT^3 / 3 multiply-adds),
    its application to the values and keys (W, U), Q S0 / K S0 and the state update K^T U."""
    chunks = -(-num_tokens // chunk) + num_seqs - 1
    per = (2 * chunk * chunk * dk * 2 + 2 * chunk ** 3 // 3 + 2 * chunk * chunk * (dk + dv)
           + 2 * chunk * dk * dv * 3 + 2 * chunk * chunk * dv)
    return chunks * hv * per


def _gdr_cases(size):
    t, b, hk, hv, d = (4096, 8, 16, 32, 128) if size == "large" else (256, 4, 2, 4, 64)
    dec_b = 64 if size == "large" else 8
    rng = np.random.default_rng(0)
    lens = [t // b - 3 * i for i in range(b)]
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=[(0, 7), (1, 64)])
    x = gdr_inputs(rng, case, hk, hv, d, d)
    for n in "qkv":
        x[n] = jnp.asarray(x[n], jnp.bfloat16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + list(slot_args(case))
    state = hv * d * d * 4
    ext = dict(args=args, bytes=t * (2 * hk * d + 2 * hv * d) * 2 + t * hv * 8
               + (2 * b + 2) * state, flops=gdr_chunked_flops(t, b, hv, d, d), donate=5)
    dcase = ragged_case(rng, [1] * dec_b, num_tokens=dec_b, num_seqs=dec_b)
    dx = gdr_inputs(rng, dcase, hk, hv, d, d)
    dec_args = [jnp.asarray(dx[n], jnp.bfloat16 if n in "qkv" else None)
                for n in ("q", "k", "v", "g", "beta", "ssm_pool")]
    dec_args += [dcase.read_slot, dcase.write_slot]
    dec = dict(args=dec_args, bytes=2 * dec_b * state + dec_b * (2 * hk + 2 * hv) * d * 2,
               flops=6 * dec_b * hv * d * d, donate=5)
    return ext, dec


def ssd_chunked_flops(num_tokens: int, num_seqs: int, h: int, g: int, n: int, p: int,
                      chunk: int = 128) -> int:
    """FLOPs of the chunked Mamba2 SSD prefill (padding chunks excluded): per (chunk, head) the
    chunk's state ``B^T u``, ``C S0`` and the scores times x; ``C B^T`` per (chunk, group)."""
    chunks = -(-num_tokens // chunk) + num_seqs - 1
    per_head = 2 * chunk * n * p * 2 + 2 * chunk * chunk * p
    return chunks * (h * per_head + g * 2 * chunk * chunk * n)


def _ssd_case(size):
    """Nemotron-H's Mamba2 mixer with ``--large`` (128 heads of 64, state 128, 8 groups), bf16."""
    t, b, h, g, n, p = (4096, 8, 128, 8, 128, 64) if size == "large" else (256, 4, 4, 2, 16, 16)
    rng = np.random.default_rng(4)
    case = ragged_case(rng, [t // b] * b, num_tokens=t, num_seqs=b, snapshots=[(0, 7), (1, 64)])
    bf16 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    args = [bf16(t, h, p), jnp.asarray(rng.uniform(0.01, 0.5, (t, h)), jnp.float32),
            -jnp.asarray(rng.uniform(0.5, 4.0, h), jnp.float32), bf16(t, g, n), bf16(t, g, n),
            jnp.ones((h,), jnp.float32), jnp.zeros((case.num_slots, h, n, p), jnp.float32)]
    state = h * n * p * 4
    return dict(args=args + list(slot_args(case)), donate=6,
                flops=ssd_chunked_flops(t, b, h, g, n, p),
                bytes=2 * t * h * p * 2 + 2 * t * g * n * 2 + t * h * 4 + (2 * b + 2) * state)


def _kda_case(size):
    """Kimi Linear's KDA with ``--large`` (32 heads of 128, a decay per key channel), bf16 q, k,
    v; FLOPs as the gated delta rule's chunked count at the GPU kernel's chunk of 32."""
    t, b, h, d = (4096, 8, 32, 128) if size == "large" else (256, 4, 4, 64)
    rng = np.random.default_rng(5)
    case = ragged_case(rng, [t // b - 3 * i for i in range(b)], num_tokens=t, num_seqs=b,
                       snapshots=[(0, 7), (1, 64)])
    x = gdr_inputs(rng, case, h, h, d, d)
    x["g"] = np.log(rng.uniform(0.5, 1.0, (t, h, d))).astype(np.float32)
    for n in "qkv":
        x[n] = jnp.asarray(x[n], jnp.bfloat16)
    state = h * d * d * 4
    return dict(args=[x[n] for n in ("q", "k", "v", "g", "beta", "ssm_pool")]
                + list(slot_args(case)), donate=5, flops=gdr_chunked_flops(t, b, h, d, d, 32),
                bytes=4 * t * h * d * 2 + t * h * (d + 1) * 4 + (2 * b + 2) * state)


def _conv_case(size):
    t, b, c, kw = (4096, 8, 8192, 4) if size == "large" else (256, 4, 256, 4)
    rng = np.random.default_rng(1)
    case = ragged_case(rng, [t // b] * b, num_tokens=t, num_seqs=b, snapshots=[(0, 5)])
    x = jnp.asarray(rng.normal(size=(t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(kw, c)), jnp.bfloat16)
    pool = jnp.zeros((case.num_slots, kw - 1, c), jnp.bfloat16)
    return dict(args=[x, w, None, pool] + list(slot_args(case)), bytes=2 * t * c * 2,
                flops=2 * kw * t * c, donate=3)


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


def _mla_case(size, decode: bool):
    """Weight-absorbed MLA (Kimi Linear: 32 heads, latent 512 + rope 64) over latent pages."""
    b, ext, prefix, hq, r, dr, ps = ((8, 512, 1536, 32, 512, 64, 16) if size == "large"
                                     else (4, 32, 96, 4, 32, 8, 16))
    if decode:
        b, ext, prefix = (64 if size == "large" else 8), 1, ext + prefix - 1
    rng = np.random.default_rng(3)
    per = -(-(ext + prefix) // ps)
    pages = jnp.asarray(rng.normal(size=(b * per + 1, ps, 1, r + dr)), jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(b * per).reshape(b, per), jnp.int32)
    cu = jnp.asarray(np.arange(b + 1) * ext, jnp.int32)
    seq_lens = jnp.full((b,), ext + prefix, jnp.int32)
    q = jnp.asarray(rng.normal(size=(b * ext, hq, r + dr)), jnp.bfloat16)
    pairs = b * sum(prefix + i + 1 for i in range(ext))
    return dict(args=[q, pages, cu, seq_lens, table], rank=r,
                bytes=b * ext * hq * (2 * r + dr) * 2 + b * (ext + prefix) * (r + dr) * 2,
                flops=2 * pairs * hq * (2 * r + dr))


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
        "ssd_extend": (_ssd_case(size), ssd_ref.ssd_extend_reference,
                       functools.partial(kern.ssd_extend, interpret=interp)),
        "kda_extend": (_kda_case(size), kda_ref.kda_extend_reference,
                       functools.partial(kern.kda_extend, interpret=interp)),
    }
    for name, decode in (("mla_attention", False), ("mla_attention_decode", True)):
        case = _mla_case(size, decode)
        kw = dict(kv_lora_rank=case["rank"], scale=0.07)
        ops[name] = (case, functools.partial(mla.mla_attention_reference, **kw),
                     functools.partial(kern.mla_attention, interpret=interp, **kw))
    rows = []
    for name, (case, ref_fn, kern_fn) in ops.items():
        args = [None if a is None else jnp.asarray(a) for a in case["args"]]
        impls = [("reference", ref_fn), ("pallas", kern_fn)]
        if interp and size == "large":  # interpreted kernels at these sizes take minutes
            impls = impls[:1]
        donate = case.get("donate")
        for impl, fn in impls:
            jitted = jax.jit(fn, donate_argnums=() if donate is None else (donate,))
            seconds = _time(jitted, args, iters, donate)
            rows.append(dict(op=name, impl=impl if impl == "reference" else f"pallas-{family}",
                             interpret=interp and impl == "pallas",
                             compute_dtype=("float32" if impl == "reference"
                                            else COMPUTE_DTYPE[family][name]),
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
          + (f"{roof[0] / 1e12:.2f} TB/s, peaks (TFLOP/s) "
             + ", ".join(f"{k} {'?' if v is None else round(v / 1e12)}"
                         for k, v in roof[1].items()) if roof else "unknown"))
    print(f"{'op':26s} {'impl':22s} {'dtype':8s} {'ms':>9s} {'GB/s':>9s} {'GFLOP/s':>10s} "
          f"{'%HBM':>6s} {'%FLOP':>6s}")
    for r in rows:
        peak = roof[1].get(r["compute_dtype"]) if roof else None
        hbm = f"{100 * r['bytes_per_s'] / roof[0]:6.1f}" if roof else f"{'-':>6s}"
        flop = f"{100 * r['flops_per_s'] / peak:6.1f}" if peak else f"{'-':>6s}"
        label = r["impl"] + (" (interp)" if r["interpret"] else "")
        print(f"{r['op']:26s} {label:22s} {r['compute_dtype']:8s} {r['ms']:9.3f} "
              f"{r['bytes_per_s'] / 1e9:9.2f} {r['flops_per_s'] / 1e9:10.2f} {hbm} {flop}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(device=kind, roofline=roof, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
