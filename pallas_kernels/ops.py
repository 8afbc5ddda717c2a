"""The ops the model calls: each dispatches on ``impl`` in {"pallas", "reference"}.

"pallas" runs the Pallas kernel: compiled on TPU, ``interpret=True`` on a CPU backend (or when
the environment sets ``PALLAS_INTERPRET=1``). The kernels are Mosaic (TPU) kernels; they have
no GPU (Triton / Mosaic GPU) lowering, so on a GPU backend "pallas" runs the plain-jnp
reference (XLA-compiled) unless ``PALLAS_INTERPRET=1`` forces the interpreted kernel.
"reference" runs the plain-jnp form beside each kernel. Shapes, padding conventions and the math
are in ``docs/kernels.md`` and in each kernel module. All pools are returned updated (donate
them in the caller's jit). Ops listed in ``PALLAS_FALLBACK`` have no kernel yet.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import causal_conv1d as _conv
from pallas_kernels import gated_delta_rule as _gdr
from pallas_kernels import paged_attention as _attn
from pallas_kernels._common import interpret_default
from pallas_kernels.gated_delta_rule_decode import gated_delta_rule_decode as _gdr_decode

IMPLS = ("pallas", "reference")
PALLAS_FALLBACK: frozenset[str] = frozenset()


def resolve_impl(kernels: str) -> str:
    """Map ``"auto"`` to "pallas" on gpu/tpu backends and "reference" on cpu."""
    if kernels == "auto":
        return "reference" if jax.default_backend() == "cpu" else "pallas"
    if kernels not in IMPLS:
        raise ValueError(f"kernels must be 'auto', 'pallas' or 'reference', got {kernels!r}")
    return kernels


def _interpret() -> bool:
    return interpret_default()


def _arrays(args: tuple) -> tuple:
    return jax.tree.map(jnp.asarray, args)


def _use_pallas(impl: str, name: str) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if jax.default_backend() == "gpu" and os.environ.get("PALLAS_INTERPRET") != "1":
        return False  # Mosaic-TPU kernels: no GPU lowering (see the module docstring)
    return impl == "pallas" and name not in PALLAS_FALLBACK


def gated_delta_rule_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                            snap_seq, snap_offset, snap_slot, *, impl: str):
    """q, k ``[T, Hk, Dk]`` raw; v ``[T, Hv, Dv]``; g, beta ``[T, Hv]`` f32; ssm_pool ``[N, Hv,
    Dk, Dv]`` f32. Returns ``(o [T, Hv, Dv] in v.dtype, ssm_pool)``."""
    args = (q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
            snap_offset, snap_slot)
    args = _arrays(args)
    if _use_pallas(impl, "gated_delta_rule_extend"):
        return _gdr.gated_delta_rule_extend(*args, interpret=_interpret())
    return _gdr.gated_delta_rule_extend_reference(*args)


def gated_delta_rule_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, impl: str):
    """q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``. Returns ``(o, ssm_pool)``."""
    args = (q, k, v, g, beta, ssm_pool, read_slot, write_slot)
    args = _arrays(args)
    if _use_pallas(impl, "gated_delta_rule_decode"):
        return _gdr_decode(*args, interpret=_interpret())
    return _gdr.gated_delta_rule_decode_reference(*args)


def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, impl: str):
    """x ``[T, C]``; weight ``[K, C]``; bias ``[C]`` or None; conv_pool ``[N, K-1, C]``.
    Returns ``(y [T, C] in x.dtype, conv_pool)``."""
    args = (x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot, snap_seq,
            snap_offset, snap_slot)
    args = _arrays(args)
    if _use_pallas(impl, "causal_conv1d_extend"):
        return _conv.causal_conv1d_extend(*args, interpret=_interpret())
    return _conv.causal_conv1d_extend_reference(*args)


def causal_conv1d_decode(x, weight, bias, conv_pool, read_slot, write_slot, *, impl: str):
    """x ``[B, C]``, one token per sequence. Returns ``(y [B, C], conv_pool)``."""
    args = (x, weight, bias, conv_pool, read_slot, write_slot)
    args = _arrays(args)
    if _use_pallas(impl, "causal_conv1d_decode"):
        return _conv.causal_conv1d_decode(*args, interpret=_interpret())
    return _conv.causal_conv1d_decode_reference(*args)


def write_kv(k_pages, v_pages, k, v, out_cache_loc):
    """k_pages, v_pages ``[N, page_size, Hkv, D]``; k, v ``[T, Hkv, D]``; token i goes to page
    ``out_cache_loc[i] // page_size``, row ``out_cache_loc[i] % page_size``."""
    return _attn.write_kv(k_pages, v_pages, k, v, out_cache_loc)


def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    impl: str):
    """q ``[T, Hq, D]``; pages hold this step's K/V already. Returns ``[T, Hq, D]`` in q.dtype."""
    args = (q, k_pages, v_pages, cu_seqlens, seq_lens, page_table)
    args = _arrays(args)
    if _use_pallas(impl, "paged_attention"):
        return _attn.paged_attention(*args, scale=scale, interpret=_interpret())
    return _attn.paged_attention_reference(*args, scale=scale)
