"""Read Hugging Face safetensors checkpoints into numpy (no torch), single file or sharded.

Tensors are opened with the ``safetensors`` numpy API. numpy has no bfloat16, so BF16 tensors
are read from the file's raw bytes (the header gives dtype, shape and byte offsets) and viewed as
``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open


def checkpoint_files(path: Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint directory (index first, else the single file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"shard(s) {missing} listed in {index} do not exist")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r}")


def _raw_header(file: Path) -> tuple[int, dict]:
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return 8 + size, json.loads(f.read(size))


class TensorSource:
    """Name -> numpy array over the files of one checkpoint; remembers what was read."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Path] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    self._where[key] = file
        self.used: set[str] = set()

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor ``name``; ``ValueError`` if it is missing or not of ``shape``."""
        if name not in self._where:
            raise ValueError(f"checkpoint tensor {name!r} is missing (expected shape {shape})")
        file = self._where[name]
        with safe_open(str(file), framework="numpy") as f:
            sl = f.get_slice(name)
            got, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if got != tuple(shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {got}, expected {shape}")
            arr = self._read_bf16(file, name) if dtype == "BF16" else f.get_tensor(name)
        self.used.add(name)
        return arr

    def _read_bf16(self, file: Path, name: str) -> np.ndarray:
        if file not in self._headers:
            self._headers[file] = _raw_header(file)
        base, header = self._headers[file]
        meta = header[name]
        start, end = meta["data_offsets"]
        with file.open("rb") as f:
            f.seek(base + start)
            buf = f.read(end - start)
        return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).reshape(meta["shape"])
