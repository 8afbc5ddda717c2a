"""Per-device peak memory of a stretch of JAX code, on CPU as on GPU/TPU.

``DeviceMemoryTracker`` is a context manager. Two measurements, both per device:

* **Live-buffer count (every backend).** While the tracker is active it wraps the public JAX
  entry points that create device arrays from host data or move them: ``jax.device_put``,
  ``jax.make_array_from_single_device_arrays`` and ``jax.make_array_from_callback`` (Orbax's
  restore goes through the first two: it reads each shard into a host numpy array, puts it on
  its device, and assembles the global array). After every such call it sums the bytes of all
  live device buffers (``jax.live_arrays()``, each ``(device, buffer pointer)`` counted once, so
  a shard shared by a single-device array and the global array built from it counts once) and
  keeps each device's maximum. Deterministic: the peak is sampled at every creation point, not
  by a polling thread. It counts jax arrays only. It misses host staging buffers (numpy arrays
  Orbax reads into are host memory, not device memory), XLA's internal temporaries (inside a
  jitted computation or a resharding copy), and arrays created and freed between two hooked
  calls by code that does not go through a hooked function.
* **Allocator statistics (GPU/TPU).** Where ``device.memory_stats()`` is not ``None``:
  ``peak_bytes_in_use`` at exit minus ``bytes_in_use`` at entry. Nothing is reset, so if the
  process peaked higher before the tracker started, that value is only an upper bound
  (``stats_peak_is_upper_bound``); measure in a fresh process. On CPU the stats are ``None``.

Also recorded: the largest single-device buffer produced by a hooked call (``largest_buffer``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax

HOOKED = ("device_put", "make_array_from_single_device_arrays", "make_array_from_callback")


def live_device_bytes() -> dict[int, int]:
    """Bytes of live jax buffers per device id (each device buffer counted once)."""
    seen: set[tuple[int, int]] = set()
    out: dict[int, int] = {}
    for arr in jax.live_arrays():
        if arr.is_deleted():
            continue
        for shard in arr.addressable_shards:
            data = shard.data
            dev = shard.device.id
            try:
                key = (dev, data.unsafe_buffer_pointer())
            except Exception:  # some backends/zero-size buffers expose no pointer
                key = (dev, id(data))
            if key in seen:
                continue
            seen.add(key)
            out[dev] = out.get(dev, 0) + data.nbytes
    return out


def _stats(device: Any) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except Exception:  # backends without the query
        return None


class DeviceMemoryTracker:
    """``with DeviceMemoryTracker() as t: ...``; then ``t.report()``.

    Not reentrant; patches ``jax.device_put`` & co. module-wide while active (thread-safe:
    Orbax calls them from its own threads).
    """

    def __init__(self, devices: list | None = None) -> None:
        self.devices = list(jax.local_devices() if devices is None else devices)
        self._lock = threading.RLock()
        self._orig: dict[str, Any] = {}
        self.baseline: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.num_events = 0
        self.largest_buffer: dict[str, Any] = {"bytes": 0, "shape": None, "device": None}
        self._stats_start: dict[int, dict[str, int] | None] = {}
        self._stats_end: dict[int, dict[str, int] | None] = {}

    # -------------------------------------------------------------------------- context
    def __enter__(self) -> DeviceMemoryTracker:
        if self._orig:
            raise ValueError("DeviceMemoryTracker is not reentrant")
        self._stats_start = {d.id: _stats(d) for d in self.devices}
        self.baseline = live_device_bytes()
        self.peak = dict(self.baseline)
        for name in HOOKED:
            self._orig[name] = getattr(jax, name)
            setattr(jax, name, self._wrap(self._orig[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._orig.items():
            setattr(jax, name, fn)
        self._orig = {}
        self.sample()
        self._stats_end = {d.id: _stats(d) for d in self.devices}

    def _wrap(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self._record(out)
            return out
        return hooked

    # -------------------------------------------------------------------------- sampling
    def _record(self, created: Any) -> None:
        with self._lock:
            self.num_events += 1
            for leaf in jax.tree.leaves(created):
                if not isinstance(leaf, jax.Array):
                    continue
                for shard in leaf.addressable_shards:
                    if shard.data.nbytes > self.largest_buffer["bytes"]:
                        self.largest_buffer = {"bytes": int(shard.data.nbytes),
                                               "shape": list(shard.data.shape),
                                               "device": shard.device.id}
            self.sample()

    def sample(self) -> None:
        """Fold the current live bytes into each device's peak (hooked calls do this)."""
        with self._lock:
            for dev, nbytes in live_device_bytes().items():
                self.peak[dev] = max(self.peak.get(dev, 0), nbytes)

    # -------------------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """``{"devices": {id: {...}}, "largest_buffer": {...}, "num_events": int}``.

        Per device: ``baseline_bytes`` (live at entry), ``peak_bytes`` (live-buffer peak above
        the baseline), ``stats_peak_bytes`` (allocator peak above entry ``bytes_in_use``;
        ``None`` where the backend has no stats) and ``stats_peak_is_upper_bound``.
        """
        devices = {}
        for d in self.devices:
            base = self.baseline.get(d.id, 0)
            row: dict[str, Any] = {"baseline_bytes": base,
                                   "peak_bytes": self.peak.get(d.id, 0) - base,
                                   "stats_peak_bytes": None, "stats_peak_is_upper_bound": None}
            s0, s1 = self._stats_start.get(d.id), self._stats_end.get(d.id)
            if s0 and s1 and "peak_bytes_in_use" in s1:
                row["stats_peak_bytes"] = s1["peak_bytes_in_use"] - s0.get("bytes_in_use", 0)
                row["stats_peak_is_upper_bound"] = (
                    s1["peak_bytes_in_use"] == s0.get("peak_bytes_in_use")
                    and s0.get("peak_bytes_in_use", 0) > s0.get("bytes_in_use", 0))
            devices[d.id] = row
        return {"devices": devices, "largest_buffer": dict(self.largest_buffer),
                "num_events": self.num_events}


def measure_restore(out_dir: str, tp: int, mode: str) -> dict[str, Any]:
    """Per-device peak of restoring ``out_dir`` (``checkpoint.save_params``) onto a TP-``tp``
    mesh. ``mode``: ``"sharded"`` (``restore_params(out_dir, mesh)``) or ``"naive"`` (restore
    whole onto the default device, then ``jax.device_put`` to the shardings).

    Returns the tracker's report plus ``model_bytes``, ``largest_param_bytes`` and, per device,
    ``peak_over_model`` (live-buffer peak / model bytes). Run it first thing in a fresh process
    so that the allocator peak (GPU/TPU) is not an older one.
    """
    from mambacache.parallel.checkpoint import restore_params
    from mambacache.parallel.mesh import make_mesh, param_shardings

    if mode not in ("sharded", "naive"):
        raise ValueError(f"mode must be 'sharded' or 'naive', got {mode!r}")
    mesh = make_mesh(tp)
    with DeviceMemoryTracker(list(mesh.devices.flat)) as tracker:
        if mode == "sharded":
            _, params = restore_params(out_dir, mesh)
        else:
            _, params = restore_params(out_dir, None)
            params = jax.device_put(params, param_shardings(params, mesh))
        jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
    model_bytes = sum(x.nbytes for x in leaves)
    rep = tracker.report()
    for row in rep["devices"].values():
        row["peak_over_model"] = row["peak_bytes"] / model_bytes
    rep.update(mode=mode, tp=tp, model_bytes=model_bytes,
               largest_param_bytes=max(x.nbytes for x in leaves))
    return rep
