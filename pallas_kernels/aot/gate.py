"""The compile gate: every family kernel, every target, dtype and size; a table; exit status.

    python -m pallas_kernels.aot [--targets v5e:2x2,v6e:2x2,sm_90] [--dtypes float32,bfloat16]
                                 [--sizes tiny,qwen3_next,...] [--cases gdr_extend,...]
                                 [--bundles] [--fixed-order] [--json PATH]

TPU targets compile the ``tpu`` family (Mosaic) on libtpu's compile-only topologies
(``aot.tpu``); ``sm_90`` compiles the ``gpu`` family (Triton) for Hopper (``aot.gpu``) and
reports registers, shared memory, spill and tensor-core instruction counts per Triton kernel.
``--bundles`` adds the estimated VLIW bundles per grid step of each TPU kernel (LLO dump), and
per (chunk, head) for kernels whose module sets ``CHUNKS_PER_STEP`` (per step / chunks).
``--fixed-order`` compiles the kernels of ``ops.FIXED_ORDER_KERNELS`` with ``fixed_order`` on
(``model.deterministic``'s variants; the other kernels as they are, which the mode runs). Exit
status 1 if any case fails to compile or a family kernel has no case (``aot.cases``). Needs the
``aot`` extra (libtpu, triton).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile

import jax.numpy as jnp

from pallas_kernels.aot import gpu, tpu
from pallas_kernels.aot.cases import CASES, SIZES, kernel_name

TPU_TARGETS = ("v5e:2x2", "v6e:2x2")
GPU_TARGETS = ("sm_90",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def family_of(target: str) -> str:
    if target in GPU_TARGETS:
        return "gpu"
    if target.startswith("v") and ":" in target:
        return "tpu"
    raise ValueError(f"target {target!r} must be a TPU topology like 'v5e:2x2' or 'sm_90'")


def missing_cases() -> list[str]:
    """Family kernels (``ops.FAMILIES`` attributes) without a compile-gate case."""
    from pallas_kernels.ops import FAMILIES
    names = {kernel_name(c) for c in CASES}
    return sorted({k for fam in FAMILIES.values() for k in vars(fam)} - names)


def run_case(target: str, case: str, size: str, dtype: str, dump_dir: str | None,
             fixed_order: bool = False) -> dict:
    """Compile one case; a row of the table (``fixed_order``: the deterministic variant of a
    kernel that has one, ``ops.FIXED_ORDER_KERNELS``)."""
    from pallas_kernels.ops import FAMILIES, FIXED_ORDER_KERNELS
    family = family_of(target)
    kernel = getattr(FAMILIES[family], kernel_name(case), None)
    row = dict(target=target, case=case, size=size, dtype=dtype)
    if kernel is None:  # a case registered ahead of (or without) this family's kernel
        return row | {"ok": True, "absent": True, "error": None}
    args, kwargs = CASES[case](SIZES[size], DTYPES[dtype])
    if fixed_order and kernel_name(case) in FIXED_ORDER_KERNELS[family]:
        kwargs = kwargs | {"fixed_order": True}
        row["fixed_order"] = True
    fn = functools.partial(kernel, interpret=False, **kwargs)
    if family == "gpu":
        return row | gpu.compile_for_sm90(fn, args)
    chunks = chunks_per_step(kernel)
    return row | tpu.compile_for(fn, args, target, dump_dir) | (
        {"chunks_per_step": chunks} if chunks else {})


def chunks_per_step(kernel) -> int | None:
    """``CHUNKS_PER_STEP`` of the kernel's module (a grid step of that kernel does several
    chunks of a head; its bundles are reported per (chunk, head) too), else None."""
    return getattr(sys.modules.get(getattr(kernel, "__module__", ""), None), "CHUNKS_PER_STEP",
                   None)


def run(targets, cases, sizes, dtypes, dump_dir: str | None = None, echo=print,
        case_runner=run_case) -> list[dict]:
    """Every (target, size, dtype, case) the size runs (``Sizes.runs``), one row each."""
    rows = []
    for target in targets:
        for size in sizes:
            for dtype in dtypes:
                for case in (c for c in cases if SIZES[size].runs(c)):
                    row = case_runner(target, case, size, dtype, dump_dir)
                    rows.append(row)
                    echo(format_row(row))
    return rows


def format_row(r: dict) -> str:
    case = r["case"] + (" [fixed]" if r.get("fixed_order") else "")
    head = f"{r['target']:8s} {r['size']:10s} {r['dtype']:8s} {case:22s} "
    if not r["ok"]:
        return head + "FAIL  " + (r.get("error") or "")
    if r.get("absent"):
        return head + "-     (no kernel in this family)"
    if r["target"] in GPU_TARGETS:
        parts = [f"{k['kernel']}: regs {k['registers']} smem {k['shared_bytes'] // 1024}K "
                 f"spill {k['spills']} hgmma {k['hgmma']} hmma {k['hmma']} "
                 f"ld128 {k['vec_loads']} cp.async {k['cp_async']} ld16 {k['u16_loads']} "
                 f"w{k['num_warps']}s{k['num_stages']}"
                 for k in r["kernels"]]
        return head + "ok    " + "; ".join(parts)
    n = r.get("chunks_per_step")
    bundles = "; ".join(f"{k}: {v} bundles/step" + (f" = {v / n:.0f} per (chunk, head), {n} "
                                                    "chunks/step" if n else "")
                        for k, v in r.get("bundles", {}).items())
    return head + "ok    " + bundles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TPU_TARGETS + GPU_TARGETS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--bundles", action="store_true", help="TPU bundles per grid step (slower)")
    p.add_argument("--fixed-order", action="store_true",
                   help="model.deterministic's kernel variants (ops.FIXED_ORDER_KERNELS)")
    p.add_argument("--json", help="write the rows here")
    opts = p.parse_args(argv)
    dump_dir = tempfile.mkdtemp(prefix="aot-llo-") if opts.bundles else None
    tpu.init_env(dump_dir)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    for name in split(opts.cases):
        if name not in CASES:
            p.error(f"unknown case {name!r}; known: {sorted(CASES)}")
    print(f"{'target':8s} {'size':10s} {'dtype':8s} {'case':22s} result")
    rows = run(split(opts.targets), split(opts.cases), split(opts.sizes), split(opts.dtypes),
               dump_dir, case_runner=functools.partial(run_case, fixed_order=opts.fixed_order))
    missing = missing_cases()
    for name in missing:
        print(f"FAIL: family kernel {name!r} has no case in pallas_kernels/aot/cases.py")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} compiled")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
