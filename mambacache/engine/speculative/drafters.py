"""Drafters: where speculative draft tokens come from (host side, a registry by method name).

A drafter proposes up to ``k`` tokens to follow a request's verified tokens; the verify step
(``engine/speculative/verify.py``) decides which of them the target model agrees with. Drafts are
deterministic guesses (a one-hot draft distribution), so sampling the target at each position
and accepting while it equals the draft is exact rejection sampling. A drafter never sees an
unverified token: it is handed ``Request.token_ids`` (prompt + accepted outputs) only.

``ngram`` (prompt lookup): take the last ``n`` tokens, ``n`` from ``ngram_max`` down to
``ngram_min``; find their most recent earlier occurrence in the request's own prompt + output;
propose what followed it. No model, no device.

``mtp`` (the model's multi-token-prediction head, ``models/mtp.py``): the step itself drafts on
the device, after sampling, for every row that samples; the runner returns the drafts with the
tokens (``ModelRunner.last_drafts``) and ``observe`` keeps them per request until its next step.
``mtp_inputs`` tells the device, per packed position, which token follows it (known on the host,
or this step's sample) and where each row's drafting starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mambacache.config import SpeculativeConfig

if TYPE_CHECKING:
    from mambacache.engine.request import Request
    from mambacache.engine.step.plan import ScheduledSeq


class Drafter:
    """The interface ``SpecDecoder`` uses: ``propose_for(req, k)`` (up to ``k`` drafts to follow
    ``req.token_ids``) and ``forget(request_id)`` (the request released). A drafter that only
    looks at tokens implements ``propose(tokens, k)``. ``on_device``: the drafts are made by
    the step on the device (a request's next row may be planned before its tokens are read);
    otherwise they are proposed here from the tokens read."""

    on_device = False

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        raise NotImplementedError

    def propose_for(self, req: Request, k: int) -> list[int]:
        return self.propose(req.token_ids, k)

    def propose_tree_for(self, req: Request, k: int, topk: int) -> list[list[int]]:
        """[tree] Up to ``topk`` draft chains of at most ``k`` tokens with distinct first
        tokens, best first (``engine/speculative/tree.py``); by default the chain alone."""
        drafts = self.propose_for(req, k)
        return [drafts] if drafts else []

    def forget(self, request_id: int) -> None:
        """Nothing kept per request by default."""

    def chose(self, request_id: int, branch: int) -> None:
        """[tree] The request's tree was read and followed ``branch``: nothing kept here."""


class NgramDrafter(Drafter):
    """Prompt lookup over the request's own tokens (``ngram_min..ngram_max``-token suffixes)."""

    def __init__(self, cfg: SpeculativeConfig):
        self.ngram_min, self.ngram_max = cfg.ngram_min, cfg.ngram_max

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (``int32[n]``); ``[]`` if no match.

        For the longest suffix length ``n`` with an earlier occurrence, the latest occurrence
        wins (recent text predicts repetition best); its continuation is copied, periodically
        when it runs into the end.
        """
        total = len(tokens)
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            # windows starting at 0..total-n-1: each leaves at least one token after it
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                return _continue(tokens.tolist(), int(hits[-1]) + n, k)
        return []

    def propose_tree_for(self, req: Request, k: int, topk: int) -> list[list[int]]:
        """[tree] The distinct continuations (``k`` tokens each) after earlier occurrences of
        the suffix: the longest suffix's occurrences first, latest first, then shorter
        suffixes'. Branch 0 is ``propose``'s chain; branches share a prefix up to where the
        occurrences' continuations part."""
        tokens = req.token_ids
        total, listed = len(tokens), tokens.tolist()
        if k <= 0:
            return []
        cands: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            for h in hits[::-1].tolist():
                cont = _continue(listed, h + n, k)
                if tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    cands.append(cont)
                    if len(cands) == topk:
                        return cands
        return cands


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; a copy running into the end continues from its own
    drafts (the text repeats with period ``len(tokens) - start``)."""
    out = tokens[start:start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period] if len(out) >= period else tokens[start + len(out)])
    return out


class MtpDrafter(Drafter):
    """Drafts the MTP head made on the device in the request's previous step (greedy, chained).

    Invariant: ``_drafts`` holds only running requests (``forget`` at release); the drafts
    assume the previous step's accepted count, which the host's equals unless the request
    stopped (and then it has no next step).
    """

    on_device = True

    def __init__(self, cfg: SpeculativeConfig):
        self.k = cfg.num_draft_tokens  # the step's drafts per row, then topk - 1 alternatives
        self._drafts: dict[int, list[int]] = {}
        self._branches: dict[int, dict[int, list[int]]] = {}  # [tree] by request, by branch

    def propose_for(self, req: Request, k: int) -> list[int]:
        return self._drafts.get(req.request_id, [])[:min(max(k, 0), self.k)]

    def propose_tree_for(self, req: Request, k: int, topk: int) -> list[list[int]]:
        """[tree] The head's greedy chain, then one branch per alternative first draft (the
        head's top-2..top-``topk`` tokens at the first position; depth 1)."""
        got = self._drafts.get(req.request_id, [])
        if k <= 0 or not got:
            return []
        return [got[:min(k, self.k)], *([a] for a in got[self.k:self.k + topk - 1])]

    def observe(self, scheduled: Sequence[ScheduledSeq], drafts: np.ndarray) -> None:
        """Keep row ``b``'s drafts (``drafts[b]``, int32 ``[k]``) for its request if it sampled
        and still runs ([overlap] a row read after its request finished is dropped)."""
        for b, s in enumerate(scheduled):
            if (s.verifies or s.samples) and s.req.lease.held:
                if s.branch:  # [tree] kept aside until the tree is read (``chose``)
                    self._branches.setdefault(s.req.request_id, {})[s.branch] = drafts[b].tolist()
                else:
                    self._drafts[s.req.request_id] = drafts[b].tolist()

    def chose(self, request_id: int, branch: int) -> None:
        """[tree] The drafts of the branch row the target followed are the request's."""
        rows = self._branches.pop(request_id, {})
        if branch:
            self._drafts[request_id] = rows[branch]

    def forget(self, request_id: int) -> None:
        self._drafts.pop(request_id, None)
        self._branches.pop(request_id, None)


def mtp_inputs(scheduled: Sequence[ScheduledSeq], num_tokens: int,
               num_seqs: int) -> dict[str, np.ndarray]:
    """The host's part of ``models.mtp.mtp_draft``'s ``inputs`` for one step (packed like
    ``build_forward_batch``): per position the next token if known here (``next_ids``), else
    the logits row that samples it (``next_row``); the drafts of verify rows (``draft_ids``);
    per row the position drafting starts from (``first``, -1 for rows that sample nothing)."""
    next_ids = np.zeros(num_tokens, np.int32)
    next_row = np.full(num_tokens, -1, np.int32)
    draft_ids = np.full(num_tokens, -1, np.int32)
    first = np.full(num_seqs, -1, np.int32)
    pos = row = 0
    for b, s in enumerate(scheduled):
        toks = np.asarray(s.spec.tokens, np.int32)
        n = len(toks)
        if n == 0:
            continue
        next_ids[pos:pos + n - 1] = toks[1:]
        if s.spec.logits == "all":  # verify: every position samples; drafts after all but last
            next_row[pos:pos + n] = np.arange(row, row + n)
            draft_ids[pos:pos + n - 1] = toks[1:]
            first[b], row = pos, row + n
        elif s.spec.logits == "last":
            if s.samples:
                next_row[pos + n - 1], first[b] = row, pos + n - 1
            elif s.end < s.req.num_tokens:  # a prefill chunk: the next prompt token is known
                next_ids[pos + n - 1] = s.req.token_ids[s.end]
            row += 1
        pos += n
    return {"next_ids": next_ids, "next_row": next_row, "draft_ids": draft_ids, "first": first}


#: method name -> drafter factory
DRAFTERS: dict[str, Callable[[SpeculativeConfig], Drafter]] = {"ngram": NgramDrafter,
                                                              "mtp": MtpDrafter}


def make_drafter(cfg: SpeculativeConfig) -> Drafter:
    """The drafter for ``cfg.method``; ``ValueError`` for a method without one."""
    if cfg.method not in DRAFTERS:
        raise ValueError(f"speculative.method {cfg.method!r} has no drafter; available: "
                         f"{sorted(DRAFTERS)}")
    return DRAFTERS[cfg.method](cfg)
