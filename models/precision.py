"""The precision rule: a model in float32 computes in float32 on every backend.

JAX runs a float32 matmul at the backend's default precision, which on a GPU is TF32 (10-bit
mantissa inputs) and on a TPU bf16 passes: "fp32" would mean different arithmetic on each chip,
and cache on = off within 1e-4 would hold on CPU only (on an H200 logprobs were 2.4e-4 apart).
So every program over float32 weights is traced under ``jax.default_matmul_precision("highest")``:
each ``dot_general`` with no precision of its own, the Pallas kernels' included (they are traced
inside the forward), gets ``Precision.HIGHEST``. Any other dtype (bf16, the serving dtype) keeps
the backend's default: its products already run on the bf16 units, accumulating in fp32.

Who relies on it: ``models.model.forward`` and ``models.mtp.mtp_draft`` enter it by the dtype of
their weights, so a user's own JAX loop gets the rule too (``tests/test_precision.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax

from pallas_kernels.ops import dot_precision


def exact_matmuls(dtype: Any) -> contextlib.AbstractContextManager:
    """The context to trace a program over weights of ``dtype`` in: HIGHEST matmul precision for
    float32, nothing otherwise (the backend's default for bf16). The rule is the kernels' own
    (``pallas_kernels.ops.dot_precision``), so the model and its kernels cannot disagree."""
    if dot_precision(dtype) is not None:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()
