"""Every Pallas kernel lowers for TPU (Mosaic) from this CPU machine, fp32 and bf16.

``jax.export`` with ``platforms=["tpu"]`` runs the Pallas -> Mosaic lowering and its verifier
(block shapes, layouts); the final Mosaic compile happens only on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.aot.tpu import tpu_target
from pallas_kernels.tpu import causal_conv1d as conv
from pallas_kernels.tpu import gated_delta_rule as gdr
from pallas_kernels.tpu import paged_attention as attn
from pallas_kernels.tpu.gated_delta_rule_decode import gated_delta_rule_decode

T, B, S, N = 256, 4, 4, 9
HK, HV, DK, DV = 2, 4, 128, 128
C, KW = 256, 4
I32 = jnp.int32


def _sd(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _slots():
    return (_sd((B + 1,), I32), _sd((B,), I32), _sd((B,), I32), _sd((S,), I32),
            _sd((S,), I32), _sd((S,), I32))


def _export(fn, *args):
    with tpu_target():  # JAX >= 0.12 lowers Mosaic kernels for a named TPU generation
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gdr_kernels_lower_for_tpu(dtype):
    f = functools.partial(gdr.gated_delta_rule_extend, chunk_size=64, interpret=False)
    _export(f, _sd((T, HK, DK), dtype), _sd((T, HK, DK), dtype), _sd((T, HV, DV), dtype),
            _sd((T, HV)), _sd((T, HV)), _sd((N, HV, DK, DV)), *_slots())
    f = functools.partial(gated_delta_rule_decode, interpret=False)
    _export(f, _sd((B, HK, DK), dtype), _sd((B, HK, DK), dtype), _sd((B, HV, DV), dtype),
            _sd((B, HV)), _sd((B, HV)), _sd((N, HV, DK, DV)), _sd((B,), I32), _sd((B,), I32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_conv_kernels_lower_for_tpu(dtype):
    f = functools.partial(conv.causal_conv1d_extend, chunk_size=64, interpret=False)
    _export(f, _sd((T, C), dtype), _sd((KW, C), dtype), _sd((C,), dtype),
            _sd((N, KW - 1, C), dtype), *_slots())
    f = functools.partial(conv.causal_conv1d_decode, interpret=False)
    _export(f, _sd((B, C), dtype), _sd((KW, C), dtype), None, _sd((N, KW - 1, C), dtype),
            _sd((B,), I32), _sd((B,), I32))


@pytest.mark.parametrize("dtype,page_size", [(jnp.float32, 1), (jnp.bfloat16, 16)])
def test_paged_attention_lowers_for_tpu(dtype, page_size):
    f = functools.partial(attn.paged_attention, scale=0.1, interpret=False)
    pages = _sd((65, page_size, 2, 128), dtype)
    _export(f, _sd((T, 8, 128), dtype), pages, pages, _sd((B + 1,), I32), _sd((B,), I32),
            _sd((B, 16), I32))
