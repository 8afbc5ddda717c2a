"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5: the ``mtp`` drafter's model.

One extra decoder layer that predicts the token after next. For a position ``p`` with the
target's final-normed hidden state ``h_p`` and the token ``x_{p+1}`` that follows it::

    u = fc([embed_norm(embed(x_{p+1})) | hidden_norm(h_p)])          fc: [2H, H]
    u = u + attn(input_norm(u));  u = u + mlp(post_norm(u));  g_p = final_norm(u)
    logits(x_{p+2}) = g_p @ lm_head                                   (embed, lm_head shared)

The layer's attention keeps its own K/V (entry ``p`` from ``(h_p, x_{p+1})``) in one more KV
layer of the pools, ``k_pages[-1]`` / ``v_pages[-1]``, on the same page tables as the target.
Chaining (draft ``i + 1`` from draft ``i``) feeds ``g`` back as the hidden state.

``mtp_draft`` runs inside the step after the target: the MTP over every packed token (its
entries for this step's positions), the accepted-draft count per sequence (the same rule as the
host), then ``k - 1`` chained one-token steps from the last accepted position. Drafts are
guesses only: a wrong MTP entry costs acceptance, never exactness (the verify step decides).
This module does not import ``mambacache``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import rms_norm
from models.mixers import full_attention
from models.moe import mlp_block
from models.precision import exact_matmuls


def mtp_layer(cfg: ModelConfig, mtp: dict[str, Any], embed: jax.Array, ids: jax.Array,
              hidden: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: Any, impl: str,
              mesh: Mesh | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MTP layer over packed rows: ``ids`` int32 ``[T]`` (the token after each row's
    position), ``hidden`` ``[T, H]`` (the target's final-normed hidden state there, or the
    MTP's own output when chaining). K/V are written at ``batch.out_cache_loc``. Returns
    (``g [T, H]`` final-normed, k_pages, v_pages)."""
    layer = mtp["layer"]

    def norm(x: jax.Array, w: jax.Array) -> jax.Array:  # [deterministic] fixed order if asked
        return rms_norm(x, w, cfg.rms_norm_eps, fixed_order=cfg.deterministic)

    e = norm(jnp.take(embed, ids, axis=0), mtp["embed_norm"])
    u = jnp.concatenate([e, norm(hidden, mtp["hidden_norm"])], axis=-1) @ mtp["fc"]
    a, k_pages, v_pages = full_attention(cfg, layer["attn"], norm(u, layer["input_norm"]),
                                         k_pages, v_pages, batch, impl, mesh)
    u = u + a
    u = u + mlp_block(cfg, layer, norm(u, layer["post_norm"]), impl, mesh)
    return norm(u, mtp["final_norm"]), k_pages, v_pages


def accepted_counts(draft_ids: jax.Array, next_ids: jax.Array, first: jax.Array,
                    max_drafts: int) -> jax.Array:
    """Per sequence, drafts the target agreed with: the run of positions from ``first`` on
    where the row's draft (``draft_ids``, -1: none) equals the target's token (``next_ids``).
    int32 ``[B]`` (the host's ``speculative.verify.accepted_drafts``, on the device); 0 where
    ``first`` is -1."""
    t = draft_ids.shape[0]
    idx = jnp.clip(first[:, None] + jnp.arange(max_drafts)[None, :], 0, t - 1)
    match = (draft_ids[idx] >= 0) & (draft_ids[idx] == next_ids[idx]) & (first[:, None] >= 0)
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)


def _chain_batch(batch: Any, positions: jax.Array, live: jax.Array, ids: jax.Array,
                 page_size: int) -> Any:
    """One token per sequence at ``positions`` ``[B]``, on the step's page tables: K/V go to the
    sequence's page for that position, or to the dump page 0 when it has none (or is not live)."""
    b, num_pages = batch.page_table.shape
    col = positions // page_size
    page = jnp.where(col < num_pages,
                     batch.page_table[jnp.arange(b), jnp.minimum(col, num_pages - 1)], 0)
    live = live & (page > 0)
    loc = jnp.where(live, page * page_size + positions % page_size, 0)
    return dataclasses.replace(
        batch, input_ids=ids, positions=jnp.where(live, positions, 0), out_cache_loc=loc,
        cu_seqlens=jnp.arange(b + 1, dtype=jnp.int32),
        seq_lens=jnp.where(live, positions + 1, 1).astype(jnp.int32),
        logits_indices=jnp.arange(b, dtype=jnp.int32))


def _greedy(g: jax.Array, lm_head: jax.Array) -> jax.Array:
    return jnp.argmax((g @ lm_head).astype(jnp.float32), axis=-1).astype(jnp.int32)


def mtp_draft(params: dict[str, Any], pools: Any, batch: Any, hidden: jax.Array,
              sampled: jax.Array, inputs: dict[str, jax.Array], *, cfg: ModelConfig,
              num_drafts: int, impl: str, mesh: Mesh | None = None,
              num_alts: int = 0) -> tuple[Any, jax.Array]:
    """``num_drafts`` greedy MTP drafts per sequence for its next step, then ``num_alts``
    alternatives to the first draft (the head's next most likely tokens there, best first;
    a draft tree's other branches).

    ``hidden`` ``[T, H]``: the target's final-normed hidden states (``forward(...,
    return_hidden=True)``); ``sampled`` int32 ``[L]``: this step's tokens per logits row.
    ``inputs`` (int32): ``next_ids [T]``, the token after each position when the host knows it;
    ``next_row [T]``, the logits row whose sampled token follows the position instead (-1: use
    ``next_ids``); ``draft_ids [T]``, in a verify row the draft after the position (-1: none);
    ``first [B]``, the packed index drafting starts from when no draft is accepted (-1: the row
    samples nothing; its drafts are junk and its chain writes go to the dump page).
    Returns (pools with the MTP layer's K/V written, drafts int32
    ``[B, num_drafts + num_alts]``).
    """
    with exact_matmuls(params["embed"].dtype):  # float32 means float32 (models/precision.py)
        return _mtp_draft(params, pools, batch, hidden, sampled, inputs, cfg=cfg,
                          num_drafts=num_drafts, impl=impl, mesh=mesh, num_alts=num_alts)


def _mtp_draft(params: dict[str, Any], pools: Any, batch: Any, hidden: jax.Array,
               sampled: jax.Array, inputs: dict[str, jax.Array], *, cfg: ModelConfig,
               num_drafts: int, impl: str, mesh: Mesh | None,
               num_alts: int) -> tuple[Any, jax.Array]:
    mtp, embed, lm_head = params["mtp"], params["embed"], params["lm_head"]
    row = inputs["next_row"]
    nxt = jnp.where(row >= 0, sampled[jnp.maximum(row, 0)], inputs["next_ids"])
    kp, vp = pools.k_pages[-1], pools.v_pages[-1]
    g, kp, vp = mtp_layer(cfg, mtp, embed, nxt, hidden, kp, vp, batch, impl, mesh)
    first = inputs["first"]
    src = jnp.maximum(first, 0) + accepted_counts(inputs["draft_ids"], nxt, first, num_drafts)
    h = jnp.take(g, src, axis=0)
    d = _greedy(h, lm_head)
    alts = _alternatives(h, lm_head, d, num_alts)
    base, live, page_size = batch.positions[src], first >= 0, kp.shape[1]

    def chain(carry, i):
        kp, vp, h, d = carry
        step = _chain_batch(batch, base + i, live, d, page_size)
        h, kp, vp = mtp_layer(cfg, mtp, embed, d, h, kp, vp, step, impl, mesh)
        d = _greedy(h, lm_head)
        return (kp, vp, h, d), d

    (kp, vp, _, _), rest = jax.lax.scan(chain, (kp, vp, h, d),
                                        jnp.arange(1, num_drafts, dtype=jnp.int32))
    pools = pools.replace(k_pages=(*pools.k_pages[:-1], kp), v_pages=(*pools.v_pages[:-1], vp))
    return pools, jnp.concatenate([d[:, None], rest.T, alts], axis=1)


def _alternatives(h: jax.Array, lm_head: jax.Array, first: jax.Array, n: int) -> jax.Array:
    """int32 ``[B, n]``: the ``n`` most likely tokens after ``first`` (the greedy one, masked)."""
    if not n:
        return jnp.zeros((h.shape[0], 0), jnp.int32)
    logits = (h @ lm_head).astype(jnp.float32)
    logits = logits.at[jnp.arange(h.shape[0]), first].set(-jnp.inf)
    return jax.lax.top_k(logits, n)[1].astype(jnp.int32)


def with_seeded_mtp(cfg: ModelConfig, params: dict[str, Any],
                    seed: int = 0) -> tuple[ModelConfig, dict[str, Any]]:
    """``(cfg, params)`` with a seeded MTP head added: the tiny presets' drafter (the target's
    params are untouched: ``init_params`` draws the head last).

    A random head never agrees with a random target, so the seeded one starts where a trained
    head would for a model whose next token depends mostly on the current one (the presets with
    ``model.init_branch_scale`` < 1): ``fc`` passes the normed embedding of ``x_{p+1}`` through
    (identity on that half, small random weights on the hidden half), ``embed_norm`` is the
    target's final norm and the layer's branches are scaled by 0.2, so ``g_p @ lm_head`` is close
    to the target's logits after ``x_{p+1}``: the token after next. The attention over its own
    K/V and the hidden input still move the drafts (acceptance below 1).
    """
    from models.params import init_params

    if not cfg.model_family.supports_mtp:
        raise ValueError(f"an MTP head is not supported for {cfg.family}")
    cfg = dataclasses.replace(cfg, num_mtp_layers=1)
    mtp = init_params(cfg, seed=seed, dtype=jnp.float32)["mtp"]
    h = cfg.hidden_size
    fc = jnp.concatenate([jnp.eye(h, dtype=jnp.float32), 0.05 * mtp["fc"][h:]])
    layer = {k: ({n: w * 0.2 if n in ("o_proj", "down", "shared_down") else w
                  for n, w in v.items()} if isinstance(v, dict) else v)
             for k, v in mtp["layer"].items()}
    mtp = {**mtp, "fc": fc, "embed_norm": params["final_norm"].astype(jnp.float32),
           "layer": layer, "final_norm": jnp.zeros_like(mtp["final_norm"])}
    dtype = params["embed"].dtype
    return cfg, {**params, "mtp": jax.tree_util.tree_map(lambda w: w.astype(dtype), mtp)}
