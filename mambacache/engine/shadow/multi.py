"""The shadow runner's multi-step decode (``scheduler.decode_steps``,
``engine/runners/multi_step.py``): ``run_multi`` runs a dispatch's K decode iterations per row on
the host, as the device does.

``ShadowMulti`` is a mixin of ``ShadowRunner`` (its per-position and per-slot prefix keys, the
row checks, ``_begin``, ``_token_after``). Per row: the pending tokens its placeholder stands for
(the previous dispatch's, ``_pending_tokens``), the first iteration's reads checked like any
row's, then each iteration writes its input's KV and state (to the running slot, or the
page-boundary iteration's to ``snap_slot``), checks the state the next iteration reads, and
samples; a stop token freezes the row (it writes nothing more), and the next dispatch's row of a
stopped one is frozen throughout, as the device's ``-1 - token`` future entry makes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mambacache.engine.shadow.pools import DataflowError
from mambacache.engine.step.plan import ScheduledSeq, SeqSpec, device_stop_ids


class ShadowMulti:
    """Multi-step dispatches for ``ShadowRunner`` (module docstring)."""

    # set by ShadowRunner.__init__
    _prev_multi: list[tuple[list[int], bool]] | None
    _future: np.ndarray
    _coef: np.ndarray
    _outputs: Any
    model_cfg: Any
    markov: int
    run_s: float
    slot_len: np.ndarray
    slot_key: np.ndarray
    kv_len: np.ndarray
    kv_key: np.ndarray

    def _pending_tokens(self, s: ScheduledSeq) -> tuple[list[int], bool]:
        """[overlap] The tokens a multi-step row's placeholder stands for (its request's
        pending ones, the newest last) and whether the row that sampled them stopped on the
        device (this row is then frozen: it reads and writes nothing)."""
        prev = s.spec.prev_index
        if prev < 0:
            return [], False
        if self._prev_multi is None:
            return [self._pending_token(s)], False
        known = s.req.prompt_len + len(s.req.output_ids)
        toks, done = self._prev_multi[prev] if prev < len(self._prev_multi) else ([], False)
        if not done and (s.req.num_pending != len(toks) or s.spec.end != known + len(toks)):
            raise DataflowError(f"request {s.req.request_id}: a placeholder at position "
                                f"{s.spec.end - 1} with {known} tokens known, "
                                f"{s.req.num_pending} pending, {len(toks)} sampled by row {prev}")
        return toks, done

    def _extend_keys(self, keys: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """``keys`` (of some tokens) followed by the keys of ``tokens`` appended to them."""
        if not len(tokens):
            return keys
        n = len(keys)
        self.prefix_keys(np.zeros(n + len(tokens), np.int64))  # enough coefficients
        with np.errstate(over="ignore"):
            more = np.cumsum((np.asarray(tokens, np.uint64) + np.uint64(1))
                             * self._coef[n:n + len(tokens)], dtype=np.uint64)
            more += keys[-1] if n else np.uint64(0)
        return np.concatenate([keys, more])

    def _run_multi(self, scheduled: Sequence[ScheduledSeq],
                   k: int) -> tuple[np.ndarray, np.ndarray]:
        """``ShadowRunner.run_multi``'s dispatch of ``k`` iterations (module docstring)."""
        # the hazards of every iteration's writes: each row as one extend over its window
        spans = [SeqSpec(np.zeros(s.steps, np.int32), s.start, s.spec.page_ids,
                         s.spec.read_slot, s.spec.write_slot,
                         [(s.snap_iter + 1, s.snap_slot)] if s.snap_iter is not None else [])
                 for s in scheduled]
        self._begin(scheduled, spans, ("multi", k), True)
        n = len(scheduled)
        tokens, logprobs = np.zeros((k, n), np.int32), np.zeros((k, n), np.float32)
        rows = []  # (row's tokens, their keys) or None: frozen by its previous row's stop
        for s in scheduled:
            self._check_rows(s)
            toks, done = self._pending_tokens(s)
            if done:
                rows.append(None)
                continue
            row = np.concatenate([s.req.token_ids, np.asarray(toks, np.int32)])
            keys = self._extend_keys(self._req_keys(s.req), toks)
            self._check_reads(s, keys, row_tokens=row, end=s.spec.end)
            rows.append((row, keys))
        prev: list[tuple[list[int], bool]] = []
        for i, (s, r) in enumerate(zip(scheduled, rows, strict=True)):
            prev.append(([], True) if r is None
                        else self._iterate(s, *r, tokens[:, i], logprobs[:, i]))
        self._future, self._prev_multi = np.zeros(0, np.int32), prev
        return tokens, logprobs

    def _iterate(self, s: ScheduledSeq, row: np.ndarray, keys: np.ndarray,
                 tokens: np.ndarray, logprobs: np.ndarray) -> tuple[list[int], bool]:
        """Row ``s``'s iterations (``row``: its tokens through its first input, ``keys``
        theirs): write each input's KV and state, check the state each later iteration reads,
        sample into ``tokens`` / ``logprobs``; the tokens sampled and whether it stopped."""
        spec, req = s.spec, s.req
        stops = device_stop_ids(req.params, self.model_cfg.eos_token_id)
        start, running = spec.prefix_len, spec.write_slot
        sampled: list[int] = []
        for j in range(s.steps):
            pos = start + j  # the input token's position
            if j:
                rs = s.snap_slot if s.snap_iter == j - 1 else running
                if (self.slot_len[rs], self.slot_key[rs]) != (pos, keys[pos - 1]):
                    raise DataflowError(f"request {req.request_id}: iteration {j} reads slot "
                                        f"{rs} holding the state after {self.slot_len[rs]} "
                                        f"tokens, not {pos}")
            loc = self._locs(spec, pos, pos + 1)
            self.kv_len[loc], self.kv_key[loc] = pos + 1, keys[pos]
            ws = s.snap_slot if s.snap_iter == j else running
            if ws:
                self.slot_len[ws], self.slot_key[ws] = pos + 1, keys[pos]
            given = self._outputs(req.request_id, req.num_outputs + j) if self._outputs else None
            tok = given if given is not None else self._token_after(
                row if self.markov else None, keys, pos + 1)
            tokens[j], logprobs[j] = tok, -((int(keys[pos]) >> 7) % 1000) / 1000.0
            sampled.append(int(tok))
            if tok in stops:
                return sampled, True
            row = np.append(row, np.int32(tok))
            keys = self._extend_keys(keys, [tok])
        return sampled, False

