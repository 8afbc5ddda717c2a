"""Compile the Pallas-Triton kernels for sm_90 without a GPU, and read their SASS.

``jax.jit(fn).trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas -> Triton lowering
on this machine; ``capture`` records each kernel's Triton IR module (and its ``num_warps`` /
``num_stages``) as it is lowered. ``triton.compile`` then takes the IR through Triton's own
pipeline to a cubin for ``GPUTarget("cuda", 90, 32)`` (what XLA's Triton emitter does on an
H100/H200), and the ``cuobjdump`` bundled with triton reports registers, shared memory and the
SASS: spill instructions (``STL`` / ``LDL``: local memory), tensor-core instructions
(``HGMMA``: Hopper warpgroup MMA, ``HMMA``: warp MMA) and global loads: 16-byte vector ones
(``LDG.E.128``, ``LDGSTS...128``), ``cp.async`` ones (``LDGSTS``) and scalar 16-bit ones
(``LDG.E.U16``: a gather Triton could not vectorise). A kernel needing more than 227 KB of
shared memory fails the gate: it compiles but cannot launch.

Without a GPU, JAX >= 0.11 asks which GPU a Triton kernel is lowered for ("No supported GPU
devices found, please specify an abstract GPU device using AbstractDevice"): ``sm90_target``
names an abstract H200 (sm_90) through ``jax.sharding.use_abstract_mesh``. JAX 0.10 ignores the
abstract device and lowers for its fallback, sm_90, so the same code serves both.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile

import jax

SM = 90
SHARED_LIMIT = 227 * 1024  # H100 / H200: most shared memory one block may have (opt-in)
SM90_DEVICE_KIND = "NVIDIA H200"  # JAX's gpu_info maps it to compute capability 9.0
SM90_CORES = 132  # streaming multiprocessors of an H200 (SXM)


def sm90_target() -> contextlib.AbstractContextManager:
    """Lower Triton kernels inside this context for an H200 (sm_90), with or without a GPU.

    An abstract one-device mesh whose device is an H200: JAX >= 0.11's Triton lowering reads the
    target from it when no GPU (or another one) is attached; on a machine whose GPU is an H200
    it changes nothing.
    """
    device = jax.sharding.AbstractDevice(device_kind=SM90_DEVICE_KIND, num_cores=SM90_CORES,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("sm90",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def _triton_bin(tool: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


@contextlib.contextmanager
def capture():
    """Collect ``(name, ttir_text, num_warps, num_stages)`` of every Triton kernel lowered."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    lowering = reg.lowering
    original = lowering.lower_jaxpr_to_triton_module
    seen = []

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering: its launch parameters
        module = result.module.operation
        name = module.attributes["sym_name"].value if "sym_name" in module.attributes else "k"
        seen.append((name, module.get_asm(enable_debug_info=False),
                     int(caller.get("num_warps", 4)), int(caller.get("num_stages", 3))))
        return result

    lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        yield seen
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def lower_kernels(fn, args) -> list[tuple[str, str, int, int]]:
    """The Triton IR of every kernel in ``fn(*args)`` lowered for CUDA."""
    with capture() as seen, sm90_target():
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return list(seen)


def compile_kernel(name: str, ttir: str, num_warps: int, num_stages: int) -> dict:
    """Compile one kernel's Triton IR for sm_90. Returns its resource and SASS counts."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{name}.ttir")
        with open(src, "w") as f:
            f.write(ttir)
        kernel = triton.compile(src, target=GPUTarget("cuda", SM, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(tmp, f"{name}.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = _run(_triton_bin("cuobjdump"), "--dump-resource-usage", cubin)
        sass = _run(_triton_bin("cuobjdump"), "-sass", cubin)
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return dict(
        kernel=name, num_warps=num_warps, num_stages=num_stages,
        registers=int(regs.group(1)) if regs else -1,
        shared_bytes=int(kernel.metadata.shared),
        local_bytes=int(local.group(1)) if local else -1,
        spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass)),
        hgmma=len(re.findall(r"\bHGMMA\.", sass)),
        hmma=len(re.findall(r"\bHMMA\.", sass)),
        vec_loads=len(re.findall(r"\bLDG(?:STS)?(?:\.\w+)*\.128\s", sass)),
        cp_async=len(re.findall(r"\bLDGSTS(?:\.\w+)*\s", sass)),
        u16_loads=len(re.findall(r"\bLDG(?:\.\w+)*\.U16\s", sass)),
        sass_instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
    )


def compile_for_sm90(fn, args) -> dict:
    """Lower ``fn(*args)`` for CUDA and compile every Triton kernel in it for sm_90.
    Returns ``{"ok", "error", "kernels": [per-kernel dicts]}``."""
    try:
        lowered = lower_kernels(fn, args)
        kernels = [compile_kernel(*k) for k in lowered]
    except Exception as e:  # noqa: BLE001 - the gate reports every failure as a table row
        return {"ok": False, "error": " ".join(str(e).split())[:300], "kernels": []}
    if not kernels:
        return {"ok": False, "error": "no Triton kernel was lowered", "kernels": []}
    over = [f"{k['kernel']} needs {k['shared_bytes'] // 1024} KB shared memory > 227 KB"
            for k in kernels if k["shared_bytes"] > SHARED_LIMIT]
    if over:  # compiles, but cannot launch (triton raises OutOfResources at load)
        return {"ok": False, "error": "; ".join(over), "kernels": kernels}
    return {"ok": True, "error": None, "kernels": kernels}


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
