"""Compile for a TPU without one: libtpu's compile-only topologies, and bundle counts.

``jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")`` gives devices that can be
compiled for (not run on). ``compile_for`` puts the abstract inputs on its first device and runs
``jax.jit(fn).lower(...).compile()``: the whole XLA + Mosaic pipeline, including the Mosaic
checks the export-only lowering test cannot see (tile alignment of slices, VMEM limits).

Bundles: with ``dump_dir`` (set before libtpu starts, see ``init_env``) the LLO compiler writes
each kernel's final VLIW schedule (``*-final_bundles.txt``). ``step_bundles`` estimates the
bundles one grid step executes: the grid loop's body once, each inner loop's body times its
constant trip bound (``scmp ... N /* loop exit test */``; once when the bound is data-dependent,
e.g. the snapshot writes). Prologue and epilogue are left out. A static estimate of issue slots,
not a timing: DMA waits and MXU latency are not in it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re

import jax

_BUNDLE = re.compile(r"^\s*0x([0-9a-f]+)\s+(?:LB|LH|LE|PB|PF|CT)?:\s*>*\s*\{")
_EXIT = re.compile(r"scmp\.\w+\.s32\.totalorder %s\w+, (\d+) /\* loop exit test \*/")
_START = re.compile(r"Start region (\d+)")


def init_env(dump_dir: str | None) -> None:
    """Before jax touches libtpu: let several processes load it (compile-only use takes no
    chip) and, with ``dump_dir``, ask the LLO compiler for its bundle dumps."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # silences a probe warning
    if dump_dir:
        flags = f"--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text=true"
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                          + flags).strip()


def tpu_target(device_kind: str = "TPU v5 lite") -> contextlib.AbstractContextManager:
    """Lower Mosaic kernels inside this context for ``device_kind`` without a TPU.

    JAX >= 0.12 reads the TPU generation while lowering a Pallas TPU kernel ("Unsupported TPU
    device kind: cpu ... wrap your code in a ``jax.sharding.use_abstract_mesh``"): an abstract
    one-device mesh names it. JAX 0.10 does not ask and ignores it.
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("tpu",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@functools.cache
def device(topology: str):
    """First device of a compile-only TPU topology such as "v5e:2x2" or "v6e:2x2"."""
    from jax.experimental import topologies
    return topologies.get_topology_desc(topology, "tpu").devices[0]


def on_device(args, dev):
    """``ShapeDtypeStruct``s (None kept) placed on ``dev``."""
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                 for a in args)


def compile_for(fn, args, topology: str, dump_dir: str | None = None) -> dict:
    """Compile ``fn(*args)`` for ``topology``. Returns ``{"ok": bool, "error": str | None,
    "bundles": {kernel: per-step estimate}}`` (bundles only with a dump dir)."""
    if dump_dir:
        _clear(dump_dir)
    dev = device(topology)
    try:
        with tpu_target(dev.device_kind):  # JAX >= 0.12 asks the Mosaic target's generation
            jax.jit(fn).lower(*on_device(args, dev)).compile()
    except Exception as e:  # noqa: BLE001 - the gate reports every failure as a table row
        return {"ok": False, "error": _first_line(e), "bundles": {}}
    bundles = {}
    if dump_dir:
        for path in sorted(_final_bundle_files(dump_dir)):
            name = os.path.basename(path).split("-", 1)[1].rsplit("-", 2)[0]
            if not name.startswith("TLP") and _is_kernel(path):
                bundles[name] = step_bundles(path)
        _clear(dump_dir)  # thousands of files per compile: keep only what was read
    return {"ok": True, "error": None, "bundles": bundles}


def _clear(dump_dir: str) -> None:
    for path in glob.glob(os.path.join(dump_dir, "*")):
        os.remove(path)


def _first_line(e: Exception) -> str:
    text = str(e)
    for key in ("Slice sizes", "Mosaic failed", "not implemented", "Unsupported", "error:"):
        i = text.find(key)
        if i >= 0:
            return " ".join(text[i:i + 300].split())
    return " ".join(text[:300].split())


def _final_bundle_files(dump_dir: str) -> list[str]:
    return glob.glob(os.path.join(dump_dir, "*-final_bundles.txt"))


def _is_kernel(path: str) -> bool:
    analysis = path.replace("-final_bundles.txt", "-schedule-analysis_final_bundles.txt")
    analysis = re.sub(r"-\d+-schedule-analysis", "-*-schedule-analysis", analysis)
    for f in glob.glob(analysis):
        with open(f) as fh:
            if "tpu_custom_call" in fh.read(20000):
                return True
    return False


def loops(path: str) -> list[tuple[int, int, int | None]]:
    """``(first, last, trip)`` bundle addresses of every loop in a final-bundles dump: from a
    loop-body (``LB``) bundle to the branch back to the region it starts; ``trip`` is the
    constant bound of its exit test, or None."""
    with open(path) as f:
        bundles = [(int(m.group(1), 16), line) for line in f
                   if (m := _BUNDLE.match(line))]
    found = []
    for i, (addr, line) in enumerate(bundles):
        if " LB:" not in line[:24]:
            continue
        targets = {f"target = $region{r}" for r in _START.findall(line)}
        for end, body in bundles[i:]:
            if "sbr.rel" in body and any(t in body for t in targets):
                trips = [int(t) for a, b in bundles if addr <= a <= end
                         for t in _EXIT.findall(b)]
                found.append((addr, end, trips[0] if trips else None))
                break
    return found


def step_bundles(path: str) -> int:
    """Estimated VLIW bundles one grid step runs: the grid loop (the widest) once, plus each
    inner loop with a constant bound ``(trip - 1)`` more times (see the module docstring)."""
    found = loops(path)
    if not found:
        return 0
    first, last, _ = max(found, key=lambda x: x[1] - x[0])
    total = last - first + 1
    for a, b, trip in found:
        if (a, b) != (first, last) and trip:
            total += (b - a + 1) * (trip - 1)
    return total
