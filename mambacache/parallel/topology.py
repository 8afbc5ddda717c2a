"""Chips and topologies the plan sizes for: HBM per chip, peak FLOPs and HBM bandwidth.

``parse_topology("v6e:2x4")`` names a TPU slice that libtpu can compile for without a chip
(``compile_devices``: the devices of ``jax.experimental.topologies.get_topology_desc``); ``h200:N``
names N H200 GPUs, sized by arithmetic (no compiler for them on this host). Chip numbers are the
vendors' published per-chip figures (dense, no sparsity); the roofline in ``parallel.plan`` reads
them and says that it is an estimate. Host only except ``compile_devices`` (imports jax/libtpu).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: ``hbm_bytes`` of device memory, ``hbm_bytes_per_s`` of bandwidth,
    ``bf16_flops_per_s`` dense matmul peak; ``fp32_flops_per_s`` what fp32 matmuls reach (TPU:
    three bf16 MXU passes; H200: TF32 tensor cores). ``compiler``: "tpu" (libtpu topology) or
    None (arithmetic only)."""

    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp32_flops_per_s: float
    compiler: str | None

    def peak_flops_per_s(self, dtype: str) -> float:
        return self.bf16_flops_per_s if dtype == "bfloat16" else self.fp32_flops_per_s


# TPU HBM: what libtpu's compiler says a program may use per device ("exceeds available HBM
# (15.75G)" for an oversized program; v5e 16 GiB, v6e 32 GiB chips, v4 per TensorCore).
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", int(15.75 * GIB), 819e9, 197e12, 197e12 / 3, "tpu"),
    "v6e": Chip("v6e", int(31.25 * GIB), 1640e9, 918e12, 918e12 / 3, "tpu"),
    "v5p": Chip("v5p", int(95.74 * GIB), 2765e9, 459e12, 459e12 / 3, "tpu"),
    "v4": Chip("v4", int(15.25 * GIB), 1228e9, 275e12 / 2, 275e12 / 6, "tpu"),
    "h200": Chip("h200", 141 * 10**9, 4.8e12, 989e12, 494e12, None),
    "h100": Chip("h100", 80 * 10**9, 3.35e12, 989e12, 494e12, None),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """``name`` as given (``"v6e:2x4"``, ``"h200:8"``), its ``chip`` and ``num_devices``."""

    name: str
    chip: Chip
    num_devices: int

    @property
    def compiled(self) -> bool:
        """True when the plan compiles for it (a libtpu topology); False: arithmetic only."""
        return self.chip.compiler is not None


def parse_topology(name: str) -> Topology:
    """``"<chip>:<A>x<B>[x<C>]"`` for TPU slices, ``"<gpu>:<N>"`` for GPUs; ``ValueError``
    naming the chip or the shape otherwise."""
    chip_name, sep, shape = name.partition(":")
    if not sep or chip_name not in CHIPS:
        raise ValueError(f"topology {name!r} must be '<chip>:<shape>' with a chip in "
                         f"{sorted(CHIPS)} (e.g. 'v6e:2x4', 'h200:8')")
    chip = CHIPS[chip_name]
    pattern = r"\d+(x\d+){1,2}" if chip.compiler == "tpu" else r"\d+"
    if not re.fullmatch(pattern, shape):
        want = "'AxB' or 'AxBxC' chips" if chip.compiler == "tpu" else "a device count N"
        raise ValueError(f"topology {name!r}: the shape {shape!r} must be {want}")
    count = math.prod(int(x) for x in shape.split("x"))
    if count < 1:
        raise ValueError(f"topology {name!r} has {count} devices; it needs at least 1")
    return Topology(name, chip, count)


@functools.cache
def compile_devices(name: str) -> tuple:
    """The compile-only devices of a TPU topology (libtpu, no chip needed), in mesh order."""
    topo = parse_topology(name)
    if topo.chip.compiler != "tpu":
        raise ValueError(f"topology {name!r} has no compiler on this host (arithmetic only)")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling takes no chip
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # silences a probe warning
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(name, "tpu").devices)


_KINDS = {"h200": "h200", "h100": "h100", "tpu v5 lite": "v5e", "tpu v5e": "v5e",
          "tpu v6 lite": "v6e", "tpu v6e": "v6e", "tpu v5p": "v5p", "tpu v5": "v5p",
          "tpu v4": "v4"}


def local_topology() -> Topology:
    """``"local"``: this machine's devices (the engine's case). HBM from the allocator's
    ``bytes_limit`` (the smallest device's); peaks from ``CHIPS`` when the device kind is known
    (else 0: no roofline). ``ValueError`` on a backend that reports no memory (CPU)."""
    import jax

    devices = jax.devices()
    stats = [d.memory_stats() or {} for d in devices]
    limits = [s.get("bytes_limit", 0) for s in stats]
    if not all(limits):
        raise ValueError(f"the {devices[0].platform} devices report no memory limit "
                         f"(memory_stats); size the cache with cache.memory_bytes instead")
    kind = devices[0].device_kind.lower()
    known = next((CHIPS[v] for k, v in _KINDS.items() if k in kind), None)
    chip = Chip(kind, min(limits), known.hbm_bytes_per_s if known else 0.0,
                known.bf16_flops_per_s if known else 0.0,
                known.fp32_flops_per_s if known else 0.0, "local")
    return Topology("local", chip, len(devices))
