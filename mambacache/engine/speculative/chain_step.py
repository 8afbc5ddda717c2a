"""[speculative] The device's part of chained rows (``engine/speculative/chain.py``): the carry of a
step's outcome, and the shift of a chained row by its predecessor's outcome, inside the step.

The carry (donated, threaded like the pools): ``tokens`` the sampled tokens by logits row (the
overlap's future buffer), and per row of the step ``accepted`` (drafts the target agreed
with), ``bonus`` (the target's token after them) and ``drafts`` (the MTP head's). Its values
are the host's ``speculative.verify.accepted_drafts`` rule, computed where the tokens are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models.mtp import accepted_counts


def empty_carry(max_seqs: int, k: int, num_drafts: int) -> dict[str, jax.Array]:
    """The device carry between steps: sampled tokens by logits row (``tokens``, the overlap's
    future buffer), and per row of the step the accepted count, the bonus and the MTP drafts."""
    return {"tokens": jnp.zeros(max_seqs * (k + 1), jnp.int32),
            "accepted": jnp.zeros(max_seqs, jnp.int32), "bonus": jnp.zeros(max_seqs, jnp.int32),
            "drafts": jnp.zeros((max_seqs, max(num_drafts, 1)), jnp.int32)}


def apply(batch: Any, sb: Any, carry: dict[str, jax.Array], spec: dict[str, jax.Array], *,
          page_size: int, mtp: bool) -> tuple[Any, Any, jax.Array]:
    """Shift the chained rows of ``batch`` by the previous step's outcome (module docstring).
    Returns (batch, sampling batch, the draft following each packed position, -1: none)."""
    b_n, t_n, p_n = batch.read_slot.shape[0], batch.input_ids.shape[0], batch.page_table.shape[1]
    k = spec["cand"].shape[1] - 1
    live = spec["src"] >= 0
    src = jnp.maximum(spec["src"], 0)
    a = jnp.clip(carry["accepted"][src], 0, spec["base"])
    bonus = carry["bonus"][src]
    delta = jnp.where(live, a - spec["base"], 0)
    tok = jnp.arange(t_n)
    seq = jnp.clip(jnp.searchsorted(batch.cu_seqlens[1:], tok, side="right"), 0, b_n - 1)
    on = (tok < batch.cu_seqlens[-1]) & live[seq]
    off = tok - batch.cu_seqlens[seq]
    pos = batch.positions + jnp.where(on, delta[seq], 0)
    page = batch.page_table[seq, jnp.clip(pos // page_size, 0, p_n - 1)]
    loc = jnp.where(on, page * page_size + pos % page_size, batch.out_cache_loc)
    ids = jnp.where(on & (off == 0), bonus[seq], batch.input_ids)
    if mtp:  # the MTP head's drafts for this row, made by the step before
        drafts = carry["drafts"][src]
        col = jnp.clip(off - 1, 0, drafts.shape[1] - 1)
        ids = jnp.where(on & (off > 0), drafts[seq, col], ids)
        valid = live
    else:
        valid = (a == spec["base"]) & (bonus == spec["expect"])
    nxt_id = ids[jnp.minimum(tok + 1, t_n - 1)]
    chained_draft = jnp.where(valid[seq] & (off < spec["ndraft"][seq]), nxt_id, -1)
    draft_ids = jnp.where(on, chained_draft, spec["draft_ids"])
    rows = jnp.arange(b_n)
    read = jnp.where(live, spec["cand"][rows, a], batch.read_slot)
    ridx = spec["cand_idx"][rows, a]
    j = jnp.arange(k + 1)[None, :]
    tgt = jnp.take_along_axis(spec["pool"], j + (j >= ridx[:, None]), axis=1)  # [B, k + 1]
    write = jnp.where(live, tgt[rows, spec["ndraft"]], batch.write_slot)
    sq, so, sl = batch.snap_seq, batch.snap_offset, batch.snap_slot
    snap_slot = jnp.where(live[sq] & (sl != 0), tgt[sq, jnp.clip(so - 1, 0, k)], sl)
    batch = dataclasses.replace(
        batch, input_ids=ids, positions=pos, out_cache_loc=loc,
        seq_lens=batch.seq_lens + delta, read_slot=read, write_slot=write, snap_slot=snap_slot)
    sb = dataclasses.replace(sb, step=sb.step + delta[seq[batch.logits_indices]])
    return batch, sb, draft_ids


def outcome(carry: dict[str, jax.Array], tokens: jax.Array, spec: dict[str, jax.Array],
            draft_ids: jax.Array, drafts: jax.Array | None) -> dict[str, jax.Array]:
    """The carry after a step: its sampled tokens, and per row the accepted drafts and the
    bonus (the host's ``accepted_drafts`` rule on the device), the MTP drafts if any."""
    row = spec["next_row"]
    nxt = jnp.where(row >= 0, tokens[jnp.maximum(row, 0)], -1)
    first = spec["first"]
    k = spec["cand"].shape[1] - 1
    a = accepted_counts(draft_ids, nxt, first, k)
    bonus = nxt[jnp.clip(first + a, 0, nxt.shape[0] - 1)]
    out = dict(carry)
    n = min(tokens.shape[0], carry["tokens"].shape[0])
    out["tokens"] = carry["tokens"].at[:n].set(tokens[:n])
    b = min(a.shape[0], carry["accepted"].shape[0])
    out["accepted"] = carry["accepted"].at[:b].set(a[:b])
    out["bonus"] = carry["bonus"].at[:b].set(bonus[:b])
    if drafts is not None:
        out["drafts"] = carry["drafts"].at[:b].set(drafts[:b])
    return out
