"""Reading a step: its sampled tokens appended to their requests, the stop rules, the finishes.

The step loop (``step_loop.py``) waits for a step's tokens (a failed read fails everything in
flight there); ``StepReader`` accounts them, row by row: a request finished (stop, abort, error)
while its row ran drops the row's tokens; a plain row appends its one token; [multi-step decode]
a row appends its ``[iteration]`` tokens up to its first stop and rewinds its lease to them;
[speculative] a verify row emits its accepted drafts plus the target's next token (a draft
tree's row: the branch the target followed), and at depth 1 resolves its chained row in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mambacache.engine.request import FINISHED, RUNNING, Request, RequestOutput
from mambacache.engine.runner_protocol import InFlight
from mambacache.engine.step.plan import ScheduledSeq

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine


class StepReader:
    """A read step's tokens to their requests (module docstring); ``depth`` 0 or 1 (the loop's)."""

    def __init__(self, engine: Engine, depth: int):
        self.engine = engine
        self.depth = depth
        self.spec = engine.scheduler.speculative  # [speculative] verify rows, acceptance
        self.scheduler = engine.scheduler
        self.eos_token_id = getattr(engine.model_cfg, "eos_token_id", None)  # not ModelConfig's

    def read(self, fl: InFlight, tokens: np.ndarray, logprobs: np.ndarray,
             drafts: np.ndarray | None, now: float, outs: list[RequestOutput]) -> None:
        """Append ``fl``'s read ``tokens`` / ``logprobs`` (and [mtp] ``drafts``) to the requests
        still waiting for them, at ``now``; the finished ones' outputs to ``outs``."""
        # Python ints and floats once (the values int() / float() of each element give)
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        if fl.iterations > 1:
            self._read_multi(fl, token_list, logprob_list, now, outs)
            return
        if self.spec is None:  # no verify row: one token per row (per row of every step)
            self._read_tokens(fl, token_list, logprob_list, now, outs)
            return
        row_of: dict[int, int] | None = None  # [speculative tree] id(row) -> first logits row
        for i, row in fl.rows:
            s = fl.scheduled[i]
            req = s.req
            if s.branch:
                continue  # [speculative tree] a branch row: read with its tree's first row
            if req.status is FINISHED:
                continue  # finished (stop, abort, error) while this row ran: its token is dropped
            if self.depth:
                self.scheduler.token_read(req)
            if s.verifies and req.status is not RUNNING:
                continue  # [overlap] preempted with its verify in flight: recomputed later
            accepted = 0
            if s.verifies:
                if s.branches:  # [speculative tree] the branch the target followed
                    if row_of is None:
                        row_of = {id(fl.scheduled[j]): r for j, r in fl.rows}
                    s, row = self._choose_branch(s, row_of, tokens)
                n = len(s.drafts) + 1
                out = self._accept_verify(s, tokens[row:row + n], logprobs[row:row + n], now)
                accepted = self.spec.last_accepted
            else:
                out = self._append(req, token_list[row], logprob_list[row], now)
            if out is not None:
                outs.append(out)
            elif self.depth and self.spec is not None:  # its chained row in flight
                self.spec.resolve(req, accepted, int(tokens[row + accepted]),
                                  drafts[i] if drafts is not None else None)

    def _read_tokens(self, fl: InFlight, token_list: list[int], logprob_list: list[float],
                     now: float, outs: list[RequestOutput]) -> None:
        """``read``'s row loop without speculative decoding: each sampling row appends its one
        token (a request finished while its row ran drops it)."""
        scheduled, append = fl.scheduled, self._append
        token_read = self.scheduler.token_read if self.depth else None
        for i, row in fl.rows:
            req = scheduled[i].req
            if req.status is FINISHED:
                continue  # finished (stop, abort, error) while this row ran: its token is dropped
            if token_read is not None:
                token_read(req)
            out = append(req, token_list[row], logprob_list[row], now)
            if out is not None:
                outs.append(out)

    def _read_multi(self, fl: InFlight, token_list: list[list[int]],
                    logprob_list: list[list[float]], now: float,
                    outs: list[RequestOutput]) -> None:
        """[multi-step decode] Each row appends its tokens ``[iteration][row]`` up to its stop
        (the device froze the row there: the same stop rule, ``finish_reason``); a row that
        stopped before its last planned token first rewinds its lease to the tokens computed
        (``Scheduler.rewind``), so the finish inserts exactly those with their state."""
        scheduled = fl.scheduled
        token_read = self.scheduler.token_read if self.depth else None
        by_row = list(zip(*token_list, strict=True))  # [row][iteration]: one transpose
        lp_by_row = list(zip(*logprob_list, strict=True))
        for i, row in fl.rows:
            s = scheduled[i]
            req = s.req
            if req.status is FINISHED:
                continue  # finished (abort, error) while this row ran: its tokens are dropped
            n, base, reason = s.steps, len(req.output_ids), None
            toks = by_row[row][:n]
            for j, t in enumerate(toks):  # the first token that ends it: finish_reason's rule
                reason = self.finish_reason(req, t, base + j + 1)
                if reason is not None:
                    n = j + 1
                    break
            if token_read is not None:
                token_read(req, s.steps)  # those past a stop are read (and dropped) too
            req.output_ids.extend(toks[:n])
            req.output_logprobs.extend(lp_by_row[row][:n])
            req.token_times_s.extend([now] * n)
            if req.first_token_s is None:
                req.first_token_s = now
            if reason is not None:
                self.scheduler.rewind(s, n - 1)
                outs.append(self._finish(req, reason))

    # ---- per row -----------------------------------------------------------------------------
    def _accept_verify(self, s: ScheduledSeq, tokens: np.ndarray, logprobs: np.ndarray,
                       now: float) -> RequestOutput | None:
        """[speculative] Emit the verified prefix of a verify row plus the target's next token
        (``engine/speculative/verify.py``); the request's state becomes the one after them."""
        req, n_out = s.req, len(s.req.output_ids)
        emitted = self.engine.scheduler.accept_verify(
            s, tokens, lambda j: self.finish_reason(req, int(tokens[j]), n_out + j + 1) is not None)
        out = None
        for j in range(emitted):
            out = self._append(req, int(tokens[j]), float(logprobs[j]), now)
        return out

    def _choose_branch(self, s: ScheduledSeq, row_of: dict[int, int],
                       tokens: np.ndarray) -> tuple[ScheduledSeq, int]:
        """[speculative tree] The row of ``s``'s tree the target followed and its first logits
        row (``SpecDecoder.choose_branch``)."""
        rows = (s, *s.branches)
        firsts = [row_of[id(r)] for r in rows]
        toks = [tokens[f:f + len(r.drafts) + 1] for r, f in zip(rows, firsts, strict=True)]
        win = self.spec.choose_branch(s, toks)
        return win, firsts[win.branch]

    def _append(self, req: Request, token: int, logprob: float,
                now: float) -> RequestOutput | None:
        """Record a sampled token; finish the request if it is done."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.token_times_s.append(now)
        if req.first_token_s is None:
            req.first_token_s = now
        reason = self.finish_reason(req, token, len(req.output_ids))
        if req.matcher is not None:
            reason = self.constraint_reason(req, token) or reason
        if reason is None:
            return None
        return self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        """``req`` is done (``reason``): release it, count it, its output."""
        e = self.engine
        e.scheduler.finish(req, reason)
        e.stats.on_finish(req)
        e.requests.pop(req.request_id, None)
        return req.to_output()

    def finish_reason(self, req: Request, token: int, num_out: int) -> str | None:
        """Why ``req`` ends with ``token`` as its ``num_out``-th output token (None: it goes on)."""
        p, eos = req.params, self.eos_token_id
        if token in p.stop_token_ids or (not p.ignore_eos and eos is not None and token == eos):
            return "stop"
        if num_out >= p.max_new_tokens:
            return "length"
        return None

    @staticmethod
    def constraint_reason(req: Request, token: int) -> str | None:
        """Advance ``req``'s grammar by ``token``: "stop" once it is complete, "error" if it
        refuses the token (the mask allowed only tokens it accepts)."""
        if not req.matcher.accept(token):
            req.error = f"the constraint refused token {token}"
            return "error"
        return "stop" if req.matcher.done else None
