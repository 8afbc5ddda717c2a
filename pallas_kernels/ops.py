"""The ops the model calls: each dispatches on ``impl`` in {"pallas", "reference"}.

"pallas" runs a Pallas kernel of one of two families with the same signatures:

* ``tpu``: Mosaic kernels (``pallas_kernels/tpu/*.py``: scalar prefetch, DMAs);
* ``gpu``: Pallas-Triton kernels (``pallas_kernels/gpu/*.py``).

``kernel_family()`` picks ``gpu`` on a GPU backend and ``tpu`` otherwise; ``PALLAS_FAMILY=gpu|tpu``
overrides it (e.g. to run the GPU kernels interpreted on CPU). A family runs compiled on its own
backend and interpreted elsewhere; ``PALLAS_INTERPRET=0|1`` overrides that
(``_common.interpret_default``). "reference" runs the plain-jnp forms of
``pallas_kernels/reference/``.

``fixed_order`` (static; ``model.deterministic``): the references sum their row reductions
(l2norm, softmax) in the fixed tree of ``fixed_order.py``; the Pallas kernels that need it
(``FIXED_ORDER_KERNELS``) carry a chunk's end state by the formula of its snapshots, and every
decode op runs its family's extend kernel on one-token rows, so that a token past a prompt
rounds the same in a decode step, a mixed step or a recomputation (the prefill side of the
mode, chunks on a grid of absolute positions, is the scheduler's: ``DETERMINISTIC_GRID``).
Shapes, padding conventions and the math are in
``docs/kernels.md`` and in each kernel module. All pools are returned updated (donate them in
the caller's jit).

Tensor parallel: given a ``mesh`` (a ``jax.sharding.Mesh`` with a ``"tp"`` axis; None = one
device), each op runs its kernel or reference inside ``jax.shard_map`` over ``"tp"``, head- or
channel-parallel with no collective inside: every device runs the op on its own heads / channels
of the inputs and of the pools (the specs of ``mambacache.parallel.pool_specs``), and index
arrays are replicated. A ``pallas_call`` is opaque to GSPMD, which would otherwise gather the
head-sharded pools onto every device around it.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels._common import dot_precision, interpret_default  # noqa: F401 (the models')
from pallas_kernels.gpu import causal_conv1d as _gpu_conv
from pallas_kernels.gpu import gated_delta_rule as _gpu_gdr
from pallas_kernels.gpu import grouped_matmul as _gpu_gmm
from pallas_kernels.gpu import kda as _gpu_kda
from pallas_kernels.gpu import mla_attention as _gpu_mla
from pallas_kernels.gpu import paged_attention as _gpu_attn
from pallas_kernels.gpu import ssd as _gpu_ssd
from pallas_kernels.gpu.gated_delta_rule_decode import gated_delta_rule_decode as _gpu_gdr_decode
from pallas_kernels.gpu.kda_decode import kda_decode as _gpu_kda_decode
from pallas_kernels.reference import causal_conv1d as _conv_ref
from pallas_kernels.reference import gated_delta_rule as _gdr_ref
from pallas_kernels.reference import grouped_matmul as _gmm_ref
from pallas_kernels.reference import kda as _kda_ref
from pallas_kernels.reference import mla_attention as _mla_ref
from pallas_kernels.reference import paged_attention as _attn_ref
from pallas_kernels.reference import ssd as _ssd_ref
from pallas_kernels.tpu import causal_conv1d as _conv
from pallas_kernels.tpu import gated_delta_rule as _gdr
from pallas_kernels.tpu import grouped_matmul as _tpu_gmm
from pallas_kernels.tpu import kda as _tpu_kda
from pallas_kernels.tpu import paged_attention as _attn
from pallas_kernels.tpu import ssd as _tpu_ssd
from pallas_kernels.tpu.gated_delta_rule_decode import gated_delta_rule_decode as _gdr_decode

IMPLS = ("pallas", "reference")
#: [deterministic] the chunk grid: a multiple of every family kernel's chunk size under
#: ``fixed_order`` (64, GPU KDA 32; GPU SSD 64 then, 128 for bf16 otherwise), so that a prefill
#: cut or resumed at a multiple of it runs the chunks one from scratch runs
DETERMINISTIC_GRID = 64
#: [deterministic] kernels taking ``fixed_order``: their chunk-to-chunk carry is otherwise not
#: the formula of their chunk-end snapshots (gated delta rule, KDA), a sequence's first rows
#: sum their taps in another order (TPU conv), or their layout and KV splits follow the batch
#: (attention, MLA: the query chunk's shape, GPU KV splits), or their chunk (128 for bf16 in
#: GPU SSD) is not a divisor of the grid; the others' already keep the property
FIXED_ORDER_KERNELS = {"tpu": frozenset({"gdr_extend", "conv_extend", "paged_attention",
                                         "mla_attention"}),
                       "gpu": frozenset({"kda_extend", "paged_attention", "mla_attention",
                                         "ssd_extend"})}
FAMILIES = {
    "tpu": SimpleNamespace(gdr_extend=_gdr.gated_delta_rule_extend, gdr_decode=_gdr_decode,
                           conv_extend=_conv.causal_conv1d_extend,
                           conv_decode=_conv.causal_conv1d_decode,
                           paged_attention=_attn.paged_attention,
                           mla_attention=_mla_ref.latent_as_kv(_attn.paged_attention),
                           kda_extend=_tpu_kda.kda_extend, kda_decode=_tpu_kda.kda_decode,
                           ssd_extend=_tpu_ssd.ssd_extend, ssd_decode=_tpu_ssd.ssd_decode,
                           grouped_moe=_tpu_gmm.grouped_moe),
    "gpu": SimpleNamespace(gdr_extend=_gpu_gdr.gated_delta_rule_extend,
                           gdr_decode=_gpu_gdr_decode,
                           conv_extend=_gpu_conv.causal_conv1d_extend,
                           conv_decode=_gpu_conv.causal_conv1d_decode,
                           paged_attention=_gpu_attn.paged_attention,
                           mla_attention=_gpu_mla.mla_attention,
                           kda_extend=_gpu_kda.kda_extend, kda_decode=_gpu_kda_decode,
                           ssd_extend=_gpu_ssd.ssd_extend, ssd_decode=_gpu_ssd.ssd_decode,
                           grouped_moe=_gpu_gmm.grouped_moe),
}


def resolve_impl(kernels: str) -> str:
    """Map ``"auto"`` to "pallas" on gpu/tpu backends and "reference" on cpu, in
    ``model.deterministic`` too: with "pallas" the mode holds when the scheduler cuts prefills
    on ``DETERMINISTIC_GRID`` (``docs/engine.md``, Deterministic mode)."""
    if kernels not in IMPLS + ("auto",):
        raise ValueError(f"kernels must be 'auto', 'pallas' or 'reference', got {kernels!r}")
    if kernels == "auto":
        return "reference" if jax.default_backend() == "cpu" else "pallas"
    return kernels


def kernel_family() -> str:
    """"gpu" on a GPU backend, else "tpu"; ``PALLAS_FAMILY=gpu|tpu`` overrides."""
    env = os.environ.get("PALLAS_FAMILY")
    if env is not None:
        if env not in FAMILIES:
            raise ValueError(f"PALLAS_FAMILY must be one of {sorted(FAMILIES)}, got {env!r}")
        return env
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def _kernel(impl: str, name: str, fixed_order: bool = False):
    """The family's kernel ``name`` with ``interpret`` bound (and ``fixed_order`` when it is
    one of ``FIXED_ORDER_KERNELS``), or None for "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return None
    family = kernel_family()
    fn = getattr(FAMILIES[family], name)
    static = {"interpret": interpret_default(family)}
    if fixed_order and name in FIXED_ORDER_KERNELS[family]:
        static["fixed_order"] = True
    return lambda *args, **kw: fn(*args, **static, **kw)


def _op(impl: str, name: str, reference, fixed_order: bool):
    """The family's kernel ``name`` (``_kernel``), or ``reference`` with ``fixed_order`` bound
    (its row sums in a fixed tree: ``fixed_order.py``, ``model.deterministic``)."""
    return _kernel(impl, name, fixed_order) or functools.partial(reference,
                                                                 fixed_order=fixed_order)


def _one_token_rows(extend, *args, read_slot, write_slot, **kw):
    """[deterministic] A decode op as ``extend`` (an extend op of this module, ``args`` up to
    its pool) over B one-token sequences without snapshots: the bits of a one-token row of
    any extend step (the decode kernels round differently)."""
    b = jnp.asarray(read_slot).shape[0]
    none = jnp.zeros(1, jnp.int32)
    return extend(*args, jnp.arange(b + 1, dtype=jnp.int32), read_slot, write_slot, none,
                  none, none, **kw)


TP_AXIS = "tp"  # the mesh axis heads and channels are split over (``mambacache.parallel`` too)
_REP = P()
_HEADS = P(None, TP_AXIS)            # [T, H, ...] / [T, C]: axis 1
_POOL_HEADS = P(None, TP_AXIS)       # ssm_pool [N, Hv, Dk, Dv]
_CONV_POOL = P(None, None, TP_AXIS)  # conv_pool [N, K-1, C]
_PAGES = P(None, None, TP_AXIS)      # k_pages / v_pages [N, page_size, Hkv, D]


def _arrays(args: tuple) -> tuple:
    return jax.tree.map(jnp.asarray, args)


def _on_mesh(fn, mesh: Mesh | None, in_specs: tuple, out_specs):
    """``fn`` as is without a mesh; else per device over ``mesh``'s ``"tp"`` axis (no collective
    inside: ``check_vma`` off, since a ``pallas_call`` does not declare how it varies)."""
    if mesh is None:
        return fn
    if TP_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} must include {TP_AXIS!r}")
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def gated_delta_rule_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                            snap_seq, snap_offset, snap_slot, *, impl: str,
                            mesh: Mesh | None = None, fixed_order: bool = False):
    """q, k ``[T, Hk, Dk]`` raw; v ``[T, Hv, Dv]``; g, beta ``[T, Hv]`` f32; ssm_pool ``[N, Hv,
    Dk, Dv]`` f32. Returns ``(o [T, Hv, Dv] in v.dtype, ssm_pool)``. With ``mesh``: heads of
    q, k, v, g, beta, o and the pool split over "tp" (tp divides Hk and Hv, so each device's
    key heads are the GQA groups of its value heads)."""
    args = _arrays((q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
                    snap_offset, snap_slot))
    fn = _op(impl, "gdr_extend", _gdr_ref.gated_delta_rule_extend_reference, fixed_order)
    specs = (_HEADS,) * 5 + (_POOL_HEADS,) + (_REP,) * 6
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def gated_delta_rule_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, impl: str,
                            mesh: Mesh | None = None, fixed_order: bool = False):
    """q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``. Returns ``(o, ssm_pool)``.
    With ``mesh``: split as in ``gated_delta_rule_extend``."""
    if impl == "pallas" and fixed_order:
        return _one_token_rows(gated_delta_rule_extend, q, k, v, g, beta, ssm_pool,
                               read_slot=read_slot, write_slot=write_slot, impl=impl, mesh=mesh,
                               fixed_order=True)
    args = _arrays((q, k, v, g, beta, ssm_pool, read_slot, write_slot))
    fn = _op(impl, "gdr_decode", _gdr_ref.gated_delta_rule_decode_reference, fixed_order)
    specs = (_HEADS,) * 5 + (_POOL_HEADS,) + (_REP,) * 2
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, impl: str,
                         mesh: Mesh | None = None, fixed_order: bool = False):
    """x ``[T, C]``; weight ``[K, C]``; bias ``[C]`` or None; conv_pool ``[N, K-1, C]``.
    Returns ``(y [T, C] in x.dtype, conv_pool)``. With ``mesh``: channels of x, weight, bias, y
    and the pool split over "tp" (a depthwise conv: any contiguous channel split is exact)."""
    args = _arrays((x, weight, conv_pool, cu_seqlens, read_slot, write_slot, snap_seq,
                    snap_offset, snap_slot))
    fn = _kernel(impl, "conv_extend", fixed_order) or _conv_ref.causal_conv1d_extend_reference
    specs = (_HEADS, _HEADS, _CONV_POOL) + (_REP,) * 6
    return _with_bias(fn, bias, mesh, specs, (_HEADS, _CONV_POOL))(*args)


def causal_conv1d_decode(x, weight, bias, conv_pool, read_slot, write_slot, *, impl: str,
                         mesh: Mesh | None = None, fixed_order: bool = False):
    """x ``[B, C]``, one token per sequence. Returns ``(y [B, C], conv_pool)``. With ``mesh``:
    split as in ``causal_conv1d_extend``. ``fixed_order`` with "pallas": the extend kernel on
    one-token rows (``_one_token_rows``)."""
    if impl == "pallas" and fixed_order:
        return _one_token_rows(causal_conv1d_extend, x, weight, bias, conv_pool,
                               read_slot=read_slot, write_slot=write_slot, impl=impl, mesh=mesh,
                               fixed_order=True)
    args = _arrays((x, weight, conv_pool, read_slot, write_slot))
    fn = _kernel(impl, "conv_decode") or _conv_ref.causal_conv1d_decode_reference
    specs = (_HEADS, _HEADS, _CONV_POOL, _REP, _REP)
    return _with_bias(fn, bias, mesh, specs, (_HEADS, _CONV_POOL))(*args)


def _with_bias(fn, bias, mesh: Mesh | None, specs: tuple, out_specs):
    """A conv op taking ``(x, weight, conv_pool, *rest)``: ``bias`` (``[C]`` or None) goes in
    third place, split over "tp" on its only axis when there is a mesh."""
    if bias is None:
        return _on_mesh(lambda x, w, pool, *rest: fn(x, w, None, pool, *rest), mesh, specs,
                        out_specs)
    inner = _on_mesh(fn, mesh, specs[:2] + (P(TP_AXIS),) + specs[2:], out_specs)
    return lambda x, w, pool, *rest: inner(x, w, jnp.asarray(bias), pool, *rest)


def write_kv(k_pages, v_pages, k, v, out_cache_loc):
    """k_pages, v_pages ``[N, page_size, Hkv, D]``; k, v ``[T, Hkv, D]``; token i goes to page
    ``out_cache_loc[i] // page_size``, row ``out_cache_loc[i] % page_size``."""
    return _attn_ref.write_kv(k_pages, v_pages, k, v, out_cache_loc)


def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    impl: str, mesh: Mesh | None = None, fixed_order: bool = False):
    """q ``[T, Hq, D]``; pages hold this step's K/V already. Returns ``[T, Hq, D]`` in q.dtype.
    With ``mesh``: query heads of q and the output, KV heads of the pages split over "tp"
    (tp divides Hkv, so each device's query heads are the GQA groups of its KV heads)."""
    args = _arrays((q, k_pages, v_pages, cu_seqlens, seq_lens, page_table))
    kernel = _op(impl, "paged_attention", _attn_ref.paged_attention_reference, fixed_order)

    def fn(*a):
        return kernel(*a, scale=scale)

    specs = (_HEADS, _PAGES, _PAGES, _REP, _REP, _REP)
    return _on_mesh(fn, mesh, specs, _HEADS)(*args)


def kda_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, impl: str, mesh: Mesh | None = None,
               fixed_order: bool = False):
    """Kimi Delta Attention prefill: the gated delta rule with a per-key-channel decay.
    q, k ``[T, H, Dk]`` raw; v ``[T, H, Dv]``; g ``[T, H, Dk]`` f32 (log decay); beta ``[T, H]``
    f32; ssm_pool ``[N, H, Dk, Dv]`` f32. Returns ``(o [T, H, Dv] in v.dtype, ssm_pool)``, finals
    and snapshots as ``gated_delta_rule_extend``. With ``mesh``: heads split over "tp"."""
    args = _arrays((q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
                    snap_offset, snap_slot))
    fn = _op(impl, "kda_extend", _kda_ref.kda_extend_reference, fixed_order)
    specs = (_HEADS,) * 5 + (_POOL_HEADS,) + (_REP,) * 6
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def kda_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, impl: str,
               mesh: Mesh | None = None, fixed_order: bool = False):
    """KDA, one token per sequence: shapes as ``kda_extend`` with ``T = B``. Returns
    ``(o, ssm_pool)``. With ``mesh``: heads split over "tp"."""
    if impl == "pallas" and fixed_order:
        return _one_token_rows(kda_extend, q, k, v, g, beta, ssm_pool, read_slot=read_slot,
                               write_slot=write_slot, impl=impl, mesh=mesh, fixed_order=True)
    args = _arrays((q, k, v, g, beta, ssm_pool, read_slot, write_slot))
    fn = _op(impl, "kda_decode", _kda_ref.kda_decode_reference, fixed_order)
    specs = (_HEADS,) * 5 + (_POOL_HEADS,) + (_REP,) * 2
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def write_latent(latent_pages, latent, out_cache_loc):
    """MLA's paged latent cache: latent_pages ``[N, page_size, 1, R + dr]``; latent ``[T, R + dr]``
    (``kv_lora_rank`` normalised latent | the shared key part) goes to page
    ``out_cache_loc[i] // page_size``, row ``out_cache_loc[i] % page_size``."""
    n, page_size = latent_pages.shape[:2]
    page, row = out_cache_loc // page_size, out_cache_loc % page_size
    return latent_pages.at[page, row, 0].set(latent.astype(latent_pages.dtype))


def mla_attention(q, latent_pages, cu_seqlens, seq_lens, page_table, *, kv_lora_rank: int,
                  scale: float, impl: str, mesh: Mesh | None = None,
                  fixed_order: bool = False):
    """Weight-absorbed MLA over the paged latent cache: one shared "KV head" whose key is the
    whole latent row and whose value is its first ``kv_lora_rank`` values.

    q ``[T, Hq, R + dr]`` (per head: the nope query absorbed into the latent space, ``W_uk^T
    q_nope``, then the query's rope part); latent_pages ``[N, page_size, 1, R + dr]`` holding this
    step's rows already. Returns ``[T, Hq, R]`` in q.dtype: ``softmax(scale q . row) @ latent``
    (the caller applies ``W_uv``). Kernels: ``gpu/mla_attention.py`` (heads tiled, the latent
    row split into column blocks); the TPU family runs its paged attention kernel with the
    latent pages as both K and V (GQA with one KV head, ``reference.mla_attention``).
    With ``mesh``: query heads split over "tp", the latent pages replicated."""
    args = _arrays((q, latent_pages, cu_seqlens, seq_lens, page_table))
    kernel = _op(impl, "mla_attention", _mla_ref.mla_attention_reference, fixed_order)

    def fn(*a):
        return kernel(*a, kv_lora_rank=kv_lora_rank, scale=scale)

    specs = (_HEADS, _REP, _REP, _REP, _REP)
    return _on_mesh(fn, mesh, specs, _HEADS)(*args)


def _ssd_groups(b, c, mesh: Mesh | None):
    """B, C ``[T, G, N]`` as the "tp" split needs them: as they are when tp divides G; when G
    divides tp (e.g. Granite 4.0-H's single group) each group repeated ``tp / G`` times, so that
    device ``i`` receives the one group its heads belong to (heads ``i*H/tp ..``)."""
    b, c = jnp.asarray(b), jnp.asarray(c)
    if mesh is None:
        return b, c
    tp, groups = mesh.shape[TP_AXIS], b.shape[1]
    if groups % tp == 0:
        return b, c
    if tp % groups:
        raise ValueError(f"tensor parallel degree {tp} and the SSD groups ({groups}) must "
                         "divide one another")
    return jnp.repeat(b, tp // groups, axis=1), jnp.repeat(c, tp // groups, axis=1)


def ssd_extend(x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, impl: str, mesh: Mesh | None = None,
               fixed_order: bool = False):
    """Mamba2 (SSD) prefill (kernels ``tpu/ssd.py``, ``gpu/ssd.py``). x ``[T, H, P]``; dt
    ``[T, H]`` f32 (after softplus and clamp); a
    (``-exp(A_log)``), d ``[H]`` f32; b, c ``[T, G, N]`` (heads ``g*H/G ..`` share group g);
    ssm_pool ``[S, H, N, P]`` f32. Returns ``(y [T, H, P] in x.dtype, ssm_pool)`` with
    ``y = h^T C + D x``; finals and snapshots at any offset as ``gated_delta_rule_extend``.
    With ``mesh``: heads of x, dt, a, d, y and the pool, groups of b, c split over "tp" (when
    tp divides G each device's heads are exactly its groups' heads; when G divides tp each
    device gets its heads' one group, ``_ssd_groups``)."""
    b, c = _ssd_groups(b, c, mesh)
    args = _arrays((x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
                    snap_offset, snap_slot))
    fn = _kernel(impl, "ssd_extend", fixed_order) or _ssd_ref.ssd_extend_reference
    vec = P(TP_AXIS)
    specs = (_HEADS, _HEADS, vec, _HEADS, _HEADS, vec, _POOL_HEADS) + (_REP,) * 6
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def ssd_decode(x, dt, a, b, c, d, ssm_pool, read_slot, write_slot, *, impl: str,
               mesh: Mesh | None = None, fixed_order: bool = False):
    """Mamba2 recurrent step, one token per sequence: shapes as ``ssd_extend`` with ``T = B``.
    Returns ``(y, ssm_pool)``. With ``mesh``: split as in ``ssd_extend``. ``fixed_order``
    with "pallas": the extend kernel on one-token rows (``_one_token_rows``)."""
    if impl == "pallas" and fixed_order:
        return _one_token_rows(ssd_extend, x, dt, a, b, c, d, ssm_pool, read_slot=read_slot,
                               write_slot=write_slot, impl=impl, mesh=mesh, fixed_order=True)
    b, c = _ssd_groups(b, c, mesh)
    args = _arrays((x, dt, a, b, c, d, ssm_pool, read_slot, write_slot))
    fn = _kernel(impl, "ssd_decode") or _ssd_ref.ssd_decode_reference
    vec = P(TP_AXIS)
    specs = (_HEADS, _HEADS, vec, _HEADS, _HEADS, vec, _POOL_HEADS, _REP, _REP)
    return _on_mesh(fn, mesh, specs, (_HEADS, _POOL_HEADS))(*args)


def grouped_moe(x, top_vals, top_idx, w_in, w_out, *, activation: str = "swiglu", impl: str,
                mesh: Mesh | None = None):
    """The routed experts of a top-k MoE, ``[T, H]`` float32: ``sum_j top_vals[t, j] *
    act(x[t] @ w_in[e]) @ w_out[e]``, ``e = top_idx[t, j]``; work ``~ T * k``, never ``T * E``.

    x ``[T, H]``; top_vals ``[T, k]``, top_idx ``[T, k]`` int32; w_in ``[E, H, N_in]`` (SwiGLU:
    ``gate | up``, ``N_in = 2 I``; ``"relu2"``: ``N_in = I``), w_out ``[E, I, H]``. Kernels:
    ``gpu/grouped_matmul.py`` (rows sorted by expert and padded to blocks by ``moe_align``,
    gathered in the kernel, activation and routing weight fused), ``tpu/grouped_matmul.py``
    (megablox ``gmm``). With ``mesh``: experts of w_in / w_out split over "tp" (tp divides E),
    x and the routing replicated; each device computes its local experts' pairs and the partial
    outputs are summed with one ``psum`` (the only op here with a collective inside).
    """
    args = _arrays((x, top_vals, top_idx, w_in, w_out))
    fn = _kernel(impl, "grouped_moe") or _gmm_ref.grouped_moe_reference
    if mesh is None:
        return fn(*args, activation=activation)
    if TP_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} must include {TP_AXIS!r}")
    tp = mesh.shape[TP_AXIS]
    if args[3].shape[0] % tp:
        raise ValueError(f"tensor_parallel={tp} must divide num_experts ({args[3].shape[0]})")

    def per_device(x, top_vals, top_idx, w_in, w_out):
        offset = jax.lax.axis_index(TP_AXIS) * w_in.shape[0]
        part = fn(x, top_vals, top_idx, w_in, w_out, offset, activation=activation)
        return jax.lax.psum(part, TP_AXIS)

    experts = P(TP_AXIS, None, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(_REP,) * 3 + (experts, experts),
                         out_specs=_REP, check_vma=False)(*args)
