"""Fold the device check's outputs into one JSON: measured fractions of roofline per kernel.

    python scripts/device_report.py DIR [BACKEND]   # DIR/steps.txt, DIR/*.json -> device_check.json

``kernels.json`` (``pallas_kernels.bench --large --out``): per op and impl the measured share of
the device's HBM bandwidth (``hbm_fraction``) and of the dense peak of the dtype the kernel
computes in (``flops_fraction``). ``plan.json`` (``mambacache.plan --topology local``): the
pool sizes ``cache.memory_fraction`` gave on this device next to the compiler's estimates.
``bench.json``: the cache on / off ratios. ``steps.txt``: each step's name, exit status and
seconds (124: its timeout). ``agreement_fp32.json`` / ``agreement_bf16.json``
(``mambacache.bench.agreement``) and ``step.json`` (``mambacache.bench.step``) are copied in
whole. A missing file is reported as missing, so a partial run still writes its report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def kernel_fractions(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (op, impl): ms and the fractions of the roofline (None: peak unknown)."""
    roof = bench.get("roofline")
    out = []
    for r in bench["rows"]:
        peak = roof[1].get(r["compute_dtype"]) if roof else None
        out.append(dict(op=r["op"], impl=r["impl"], compute_dtype=r["compute_dtype"], ms=r["ms"],
                        hbm_fraction=r["bytes_per_s"] / roof[0] if roof else None,
                        flops_fraction=r["flops_per_s"] / peak if peak else None))
    return out


def read_steps(path: Path) -> dict[str, dict[str, Any]]:
    """``steps.txt`` lines ``NAME STATUS [SECONDS]`` -> {name: {"status", "seconds"}}; status
    is the exit code, or the word the script wrote (``missing``)."""
    steps = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, *rest = line.split()
        steps[name] = {"status": int(status) if status.lstrip("-").isdigit() else status,
                       "seconds": int(rest[0]) if rest else None}
    return steps


def report(root: Path, backend: str | None = None) -> dict[str, Any]:
    kernels, plan, bench = (_read(root / f"{n}.json") for n in ("kernels", "plan", "bench"))
    out: dict[str, Any] = {"backend": backend, "steps": read_steps(root / "steps.txt")}
    for name in ("agreement_fp32", "agreement_bf16", "step"):
        out[name] = _read(root / f"{name}.json") or "missing"
    out["device"] = kernels["device"] if kernels else None
    out["kernels"] = kernel_fractions(kernels) if kernels else "missing"
    if plan:
        keep = ("fits", "hbm_bytes", "weight_bytes", "temp_bytes", "memory_fraction",
                "cache_budget_bytes", "num_mamba_slots", "num_kv_tokens", "roofline")
        out["plan"] = {k: plan.get(k) for k in keep}
    else:
        out["plan"] = "missing"
    out["bench"] = {"ratios": bench.get("ratios")} if bench else "missing"
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.splitlines()[2].strip())
        return 2
    root = Path(argv[0])
    result = report(root, argv[1] if len(argv) == 2 else None)
    (root / "device_check.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {root / 'device_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
