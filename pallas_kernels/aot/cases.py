"""The compile gate's registry: one abstract input builder per kernel of ``ops.FAMILIES``.

A case is ``build(sizes, dtype) -> (args, kwargs)``: ``jax.ShapeDtypeStruct`` inputs (None for an
absent optional input) and static keyword arguments for the family kernel named by the case's
key (an attribute of ``ops.FAMILIES[family]``). Adding a kernel to the families means adding a
case here with ``@case("its_name")``; the gate reports a kernel without a case as a failure.

Sizes (``SIZES``): ``tiny`` is the tiny presets' mixer shapes, ``qwen3_next`` Qwen3-Next-80B-A3B
(linear attention 16 key / 32 value heads of 128, conv channels 8192; full attention 16 query /
2 KV heads of 256), ``qwen3_5`` Qwen3.5-397B-A17B (16 key / 64 value heads of 128, conv 12288;
32 query / 2 KV heads of 256). Prefill packs ``tokens`` over ``seqs`` sequences with
``snaps`` snapshots; decode has ``decode_batch`` sequences. KDA (Kimi Delta Attention) uses the
value heads and head dims of the linear attention; SSD (Mamba2) sizes at the larger geometries
are Nemotron-H's (128 heads of 64, state 128, 8 groups), MLA sizes Kimi Linear's (32 query
heads over latent rows of ``kv_lora_rank`` 512 + rope 64; tiny: ``tiny_kimi_linear``'s 4 heads,
32 + 8). The family sizes ``nemotron_h`` (Nemotron-H-47B), ``granite_4_h`` (Granite 4.0-H Small)
and ``kimi_linear`` (Kimi-Linear-48B-A3B) run only that family's kernels (``Sizes.cases``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

I32 = jnp.int32
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Mixer shapes of one model at one batch geometry (names as ``ModelConfig``)."""

    tokens: int
    seqs: int
    snaps: int
    slots: int
    decode_batch: int
    key_heads: int
    value_heads: int
    head_k: int
    head_v: int
    conv_kernel: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    max_context: int
    ssd_heads: int = 4        # Mamba2 SSD: heads, head dim P, state N, B/C groups
    ssd_head_dim: int = 16
    ssd_state: int = 16
    ssd_groups: int = 2
    mla_heads: int = 4        # MLA: query heads, latent (kv_lora_rank) and rope widths of a row
    kv_lora_rank: int = 32
    qk_rope_dim: int = 8
    moe_hidden: int = 64      # MoE (grouped matmul): hidden size, experts, top-k, expert width
    moe_experts: int = 8
    moe_top_k: int = 2
    moe_inter: int = 32
    cases: tuple[str, ...] = ()  # case-name prefixes run at this size (empty: every case)

    def runs(self, case_name: str) -> bool:
        """Whether the gate compiles ``case_name`` at these sizes (a family's own kernels)."""
        return not self.cases or case_name.startswith(self.cases)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.head_k + self.value_heads * self.head_v


SIZES: dict[str, Sizes] = {
    "tiny": Sizes(tokens=64, seqs=3, snaps=2, slots=9, decode_batch=4, key_heads=2,
                  value_heads=4, head_k=16, head_v=16, conv_kernel=4, q_heads=4, kv_heads=2,
                  head_dim=16, page_size=16, max_context=256),
    "qwen3_next": Sizes(tokens=2048, seqs=4, snaps=4, slots=129, decode_batch=64, key_heads=16,
                        value_heads=32, head_k=128, head_v=128, conv_kernel=4, q_heads=16,
                        kv_heads=2, head_dim=256, page_size=16, max_context=4096,
                        ssd_heads=128, ssd_head_dim=64, ssd_state=128, ssd_groups=8,
                        mla_heads=32, kv_lora_rank=512, qk_rope_dim=64, moe_hidden=2048,
                        moe_experts=512, moe_top_k=10, moe_inter=512),
    "qwen3_5": Sizes(tokens=2048, seqs=4, snaps=4, slots=129, decode_batch=64, key_heads=16,
                     value_heads=64, head_k=128, head_v=128, conv_kernel=4, q_heads=32,
                     kv_heads=2, head_dim=256, page_size=16, max_context=4096,
                     ssd_heads=128, ssd_head_dim=64, ssd_state=128, ssd_groups=8,
                     mla_heads=32, kv_lora_rank=512, qk_rope_dim=64, moe_hidden=4096,
                     moe_experts=512, moe_top_k=10, moe_inter=1024),
    # One family's real sizes: only the kernels that family runs (its mixer, the conv, its
    # attention). Nemotron-H-47B: SSD 256 heads of 64, state 256, 8 groups (conv x|B|C 20480);
    # 64 query / 8 KV heads of 128, context 8192.
    "nemotron_h": Sizes(tokens=2048, seqs=4, snaps=4, slots=129, decode_batch=64, key_heads=8,
                        value_heads=256, head_k=256, head_v=64, conv_kernel=4, q_heads=64,
                        kv_heads=8, head_dim=128, page_size=16, max_context=8192,
                        ssd_heads=256, ssd_head_dim=64, ssd_state=256, ssd_groups=8,
                        cases=("ssd", "conv", "paged_attention")),
    # Granite 4.0-H Small: SSD 128 heads of 64, state 128, ONE group (conv 8448); 32 / 8 heads
    # of 128.
    "granite_4_h": Sizes(tokens=2048, seqs=4, snaps=4, slots=129, decode_batch=64,
                         key_heads=1, value_heads=128, head_k=128, head_v=64, conv_kernel=4,
                         q_heads=32, kv_heads=8, head_dim=128, page_size=16, max_context=4096,
                         ssd_heads=128, ssd_head_dim=64, ssd_state=128, ssd_groups=1,
                         cases=("ssd", "conv", "paged_attention")),
    # Kimi-Linear-48B-A3B: KDA 32 heads of 128 (conv q|k|v 12288); MLA 32 heads over latent
    # rows of 512 + 64.
    "kimi_linear": Sizes(tokens=2048, seqs=4, snaps=4, slots=129, decode_batch=64,
                         key_heads=32, value_heads=32, head_k=128, head_v=128, conv_kernel=4,
                         q_heads=32, kv_heads=32, head_dim=192, page_size=16, max_context=4096,
                         mla_heads=32, kv_lora_rank=512, qk_rope_dim=64,
                         cases=("kda", "conv", "mla")),
}
# The MoE alone (grouped matmul) of two more models: Qwen3.5-35B-A3B (hidden 2048, 256 experts,
# top 8, expert width 512) and Kimi-Linear-48B-A3B (2304, 256, top 8, 1024).
SIZES["qwen3_5_35b"] = dataclasses.replace(SIZES["qwen3_next"], moe_hidden=2048, moe_experts=256,
                                           moe_top_k=8, moe_inter=512, cases=("grouped_moe",))
SIZES["kimi_linear_moe"] = dataclasses.replace(SIZES["qwen3_next"], moe_hidden=2304,
                                               moe_experts=256, moe_top_k=8, moe_inter=1024,
                                               cases=("grouped_moe",))

Builder = Callable[[Sizes, jnp.dtype], tuple[tuple, dict]]
CASES: dict[str, Builder] = {}


def case(name: str) -> Callable[[Builder], Builder]:
    """Register ``build`` as the inputs of the family kernel ``name``."""
    def register(build: Builder) -> Builder:
        if name in CASES:
            raise ValueError(f"a compile-gate case for {name!r} is already registered")
        CASES[name] = build
        return build
    return register


def sd(shape: tuple[int, ...], dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def extend_slots(s: Sizes) -> tuple:
    """``cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot``."""
    return (sd((s.seqs + 1,), I32), sd((s.seqs,), I32), sd((s.seqs,), I32),
            sd((s.snaps,), I32), sd((s.snaps,), I32), sd((s.snaps,), I32))


def _gdr_inputs(s: Sizes, dtype, rows: int) -> tuple:
    return (sd((rows, s.key_heads, s.head_k), dtype), sd((rows, s.key_heads, s.head_k), dtype),
            sd((rows, s.value_heads, s.head_v), dtype), sd((rows, s.value_heads)),
            sd((rows, s.value_heads)), sd((s.slots, s.value_heads, s.head_k, s.head_v)))


@case("gdr_extend")
def _gdr_extend(s: Sizes, dtype):
    return _gdr_inputs(s, dtype, s.tokens) + extend_slots(s), {}


@case("gdr_decode")
def _gdr_decode(s: Sizes, dtype):
    b = s.decode_batch
    return _gdr_inputs(s, dtype, b) + (sd((b,), I32), sd((b,), I32)), {}


def _conv_inputs(s: Sizes, dtype, rows: int, bias: bool) -> tuple:
    c = s.conv_channels
    return (sd((rows, c), dtype), sd((s.conv_kernel, c), dtype),
            sd((c,), dtype) if bias else None, sd((s.slots, s.conv_kernel - 1, c), dtype))


@case("conv_extend")
def _conv_extend(s: Sizes, dtype):
    return _conv_inputs(s, dtype, s.tokens, True) + extend_slots(s), {}


@case("conv_decode")
def _conv_decode(s: Sizes, dtype):
    b = s.decode_batch
    return _conv_inputs(s, dtype, b, False) + (sd((b,), I32), sd((b,), I32)), {}


@case("paged_attention")
def _paged_attention(s: Sizes, dtype):
    pages_per_seq = s.max_context // s.page_size
    num_pages = s.seqs * pages_per_seq + 1
    kv = sd((num_pages, s.page_size, s.kv_heads, s.head_dim), dtype)
    return ((sd((s.tokens, s.q_heads, s.head_dim), dtype), kv, kv, sd((s.seqs + 1,), I32),
             sd((s.seqs,), I32), sd((s.seqs, pages_per_seq), I32)),
            {"scale": s.head_dim ** -0.5})


@case("paged_attention_decode")
def _paged_attention_decode(s: Sizes, dtype):
    b = s.decode_batch
    pages_per_seq = s.max_context // s.page_size
    kv = sd((b * pages_per_seq + 1, s.page_size, s.kv_heads, s.head_dim), dtype)
    return ((sd((b, s.q_heads, s.head_dim), dtype), kv, kv, sd((b + 1,), I32), sd((b,), I32),
             sd((b, pages_per_seq), I32)), {"scale": s.head_dim ** -0.5})


def _mla_inputs(s: Sizes, dtype, rows: int, seqs: int) -> tuple[tuple, dict]:
    pages_per_seq = s.max_context // s.page_size
    width = s.kv_lora_rank + s.qk_rope_dim
    return ((sd((rows, s.mla_heads, width), dtype),
             sd((seqs * pages_per_seq + 1, s.page_size, 1, width), dtype), sd((seqs + 1,), I32),
             sd((seqs,), I32), sd((seqs, pages_per_seq), I32)),
            {"kv_lora_rank": s.kv_lora_rank, "scale": 0.08})  # any float compiles the same


@case("mla_attention")
def _mla_attention(s: Sizes, dtype):
    return _mla_inputs(s, dtype, s.tokens, s.seqs)


@case("mla_attention_decode")
def _mla_attention_decode(s: Sizes, dtype):
    return _mla_inputs(s, dtype, s.decode_batch, s.decode_batch)


def _kda_inputs(s: Sizes, dtype, rows: int) -> tuple:
    h, dk, dv = s.value_heads, s.head_k, s.head_v
    return (sd((rows, h, dk), dtype), sd((rows, h, dk), dtype), sd((rows, h, dv), dtype),
            sd((rows, h, dk)), sd((rows, h)), sd((s.slots, h, dk, dv)))


@case("kda_extend")
def _kda_extend(s: Sizes, dtype):
    return _kda_inputs(s, dtype, s.tokens) + extend_slots(s), {}


@case("kda_decode")
def _kda_decode(s: Sizes, dtype):
    b = s.decode_batch
    return _kda_inputs(s, dtype, b) + (sd((b,), I32), sd((b,), I32)), {}


def _ssd_inputs(s: Sizes, dtype, rows: int) -> tuple:
    h, p, n, g = s.ssd_heads, s.ssd_head_dim, s.ssd_state, s.ssd_groups
    return (sd((rows, h, p), dtype), sd((rows, h)), sd((h,)), sd((rows, g, n), dtype),
            sd((rows, g, n), dtype), sd((h,)), sd((s.slots, h, n, p)))


@case("ssd_extend")
def _ssd_extend(s: Sizes, dtype):
    return _ssd_inputs(s, dtype, s.tokens) + extend_slots(s), {}


@case("ssd_decode")
def _ssd_decode(s: Sizes, dtype):
    b = s.decode_batch
    return _ssd_inputs(s, dtype, b) + (sd((b,), I32), sd((b,), I32)), {}


def _moe_inputs(s: Sizes, dtype, rows: int) -> tuple[tuple, dict]:
    h, e, k, i = s.moe_hidden, s.moe_experts, s.moe_top_k, s.moe_inter
    return ((sd((rows, h), dtype), sd((rows, k), dtype), sd((rows, k), I32),
             sd((e, h, 2 * i), dtype), sd((e, i, h), dtype)), {})


@case("grouped_moe")
def _grouped_moe(s: Sizes, dtype):
    return _moe_inputs(s, dtype, s.tokens)


@case("grouped_moe_decode")
def _grouped_moe_decode(s: Sizes, dtype):
    return _moe_inputs(s, dtype, s.decode_batch)


ALIASES = {"paged_attention_decode": "paged_attention",
           "mla_attention_decode": "mla_attention",
           "grouped_moe_decode": "grouped_moe"}  # extra cases of one family kernel


def kernel_name(case_name: str) -> str:
    """The ``ops.FAMILIES`` attribute a case compiles."""
    return ALIASES.get(case_name, case_name)
