"""``ShadowRunner``: a runner that computes nothing but checks every read (a data-flow oracle).

It stands where the model runner stands (``Engine(cfg, runner=ShadowRunner(...))``) and executes
each step on the host: for every KV position and every state slot it records *which token
prefix* it holds (a 64-bit key of the prefix plus its length). Each row's reads are checked
against what the row needs before any write of the step lands:
  * the state at ``read_slot`` must be the state after exactly ``tokens[:prefix_len]``
    (``read_slot`` 0, the zero state, only with ``prefix_len == 0``);
  * every KV position ``< prefix_len`` in the row's pages must hold that position's prefix;
  * the extend tokens must be the request's tokens at ``[prefix_len, end)``;
  * no slot or page is written by one row and read or written by another (``step_hazards``).
A wrong read raises ``DataflowError`` naming the request, the slot or page and both prefixes.

The sampled token is a function of the prefix only (or, for trace replay, the trace's next
output token), so cache on and cache off must produce identical outputs: any difference is a
scheduling bug. It is the simulator's runner (``mambacache.simulate``) and the engine fuzzer's.

Speculative verify rows (``engine/speculative/verify.py``) are checked the same way: their extend is
``[last token, drafts]``, keyed as that token sequence, so a scratch slot written at a rejected
offset holds a draft prefix and any later read of it fails; a token is sampled at every
position. ``markov = m > 0`` makes the token a function of the last ``m`` tokens only (outputs
fall into cycles, so prompt-lookup drafts hit); the logprob stays a function of the whole
prefix. ``check_tree`` (``shadow/pools.py``) asserts every state and KV entry the radix tree
holds is that of the tree's own token path: a draft token in the tree fails it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.engine.shadow.multi import ShadowMulti
from mambacache.engine.shadow.pools import DataflowError, ShadowPools
from mambacache.engine.shadow.tier import ShadowTier
from mambacache.engine.step.plan import ScheduledSeq, SeqSpec, is_decode_step, step_hazards

if TYPE_CHECKING:
    from mambacache.config import EngineConfig
    from mambacache.engine.request import Request


class _Unreadable:
    """Sampled tokens whose read raises (``ShadowRunner(fail_read=...)``)."""

    def __init__(self, step: int):
        self.step = step

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise RuntimeError(f"injected failure reading step {self.step}")


class ShadowModelConfig:
    """The few model facts the engine needs without a model (request validation, stop)."""

    def __init__(self, vocab_size: int, max_position_embeddings: int, eos_token_id: int | None):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.eos_token_id = eos_token_id


class ShadowRunner(ShadowTier, ShadowMulti, ShadowPools):
    """The host oracle runner. ``outputs(request_id, step) -> token | None`` overrides sampling
    (trace replay); ``fail_step(step_index) -> bool`` injects a failing step (raised before
    anything is written, or with the pools lost when ``lose_pools_on_failure``);
    ``fail_read(step_index) -> bool`` a step whose sampled tokens cannot be read (reading them
    raises). [overlap] A row's placeholder token (``SeqSpec.prev_index``) is resolved from this
    runner's own previous step, as the device does from its ``future`` buffer."""

    def __init__(self, model_cfg: ShadowModelConfig, *, num_pages: int, page_size: int,
                 num_slots: int, seed: int = 0,
                 outputs: Callable[[int, int], int | None] | None = None,
                 fail_step: Callable[[int], bool] | None = None,
                 lose_pools_on_failure: bool = False, markov: int = 0,
                 fail_read: Callable[[int], bool] | None = None,
                 load_latency: Callable[[int], int] | None = None):
        self.model_cfg = model_cfg
        self.page_size = page_size
        self._rng = np.random.default_rng(seed)
        self._coef = self._rng.integers(1, 2**63, size=1024, dtype=np.uint64)
        self.kv_len = np.zeros((num_pages + 1) * page_size, np.int64)
        self.kv_key = np.zeros((num_pages + 1) * page_size, np.uint64)
        self.slot_len = np.zeros(num_slots + 1, np.int64)
        self.slot_key = np.zeros(num_slots + 1, np.uint64)
        self._outputs = outputs
        self._fail_step = fail_step
        self._lose_pools = lose_pools_on_failure
        self._fail_read = fail_read
        self._future = np.zeros(0, np.int32)  # [overlap] the last step's sampled tokens
        # [multi-step decode, overlap] the last step's rows, if it was a multi-step one: the
        # tokens each sampled before it stopped, and whether it stopped (its next row freezes)
        self._prev_multi: list[tuple[list[int], bool]] | None = None
        self._lost = False
        self.host_kv: dict = {}  # [host tier] host page -> (lengths, keys) of its positions
        self.host_slot: dict = {}  # [host tier] host slot -> (length, key) of its state
        self._loads: dict = {}  # [host tier] device slot -> a load in flight (shadow/tier.py)
        self.load_latency = load_latency  # [host tier] steps a load takes to land
        self.markov = markov
        self.num_steps = 0
        self.decode_steps = 0
        self.run_s = 0.0  # host seconds spent in ``run`` (the oracle's own cost)
        self.last_drafts = None  # drafts made by the step itself: none here (``Runner``)
        self.last_request_ids: list[int] = []
        self.program_keys: set[tuple] = set()
        self._widths: dict[int, int] = {}
        self._keys: dict[int, np.ndarray] = {}

    @property
    def programs_compiled(self) -> int:
        return len(self.program_keys)

    def programs_per_width(self) -> dict[int, int]:
        """Steps run per row count (no programs here: the shadow runner compiles nothing)."""
        return dict(sorted(self._widths.items()))

    # ---- prefix keys -----------------------------------------------------------------------
    def prefix_keys(self, tokens: np.ndarray) -> np.ndarray:
        """``uint64[n]``: entry p is the key of ``tokens[:p + 1]``."""
        n = len(tokens)
        while len(self._coef) < n:
            more = self._rng.integers(1, 2**63, size=len(self._coef), dtype=np.uint64)
            self._coef = np.concatenate([self._coef, more])
        with np.errstate(over="ignore"):
            return np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * self._coef[:n],
                             dtype=np.uint64)

    def _req_keys(self, req: Request) -> np.ndarray:
        """Keys of the request's known tokens (``token_ids``)."""
        keys = self._keys.get(req.request_id)
        if keys is None or len(keys) != req.prompt_len + len(req.output_ids):
            keys = self._keys[req.request_id] = self.prefix_keys(req.token_ids)
        return keys

    def _pending_token(self, s: ScheduledSeq) -> int | None:
        """[overlap] The token a row's placeholder stands for, from the previous step (a plain
        row: one pending token, sampled by a plain step)."""
        prev = s.spec.prev_index
        if prev < 0:
            return None
        known = s.req.prompt_len + len(s.req.output_ids)
        if s.req.num_pending != 1 or s.spec.end != known + 1 or prev >= len(self._future) \
                or self._prev_multi is not None:
            raise DataflowError(f"request {s.req.request_id}: a placeholder at position "
                                f"{s.spec.end - 1} with {known} tokens known, "
                                f"{s.req.num_pending} pending, row {prev}"
                                + (" of a multi-step step" if self._prev_multi else ""))
        return int(self._future[prev])

    def _row_tokens(self, s: ScheduledSeq) -> np.ndarray:
        """The row's token sequence: the request's tokens (and the token its placeholder stands
        for), or up to a verify row's drafts."""
        if s.drafts:
            return np.concatenate([s.req.token_ids[:s.spec.prefix_len], s.spec.tokens])
        tok = self._pending_token(s)
        return s.req.token_ids if tok is None else np.append(s.req.token_ids, np.int32(tok))

    def _row_keys(self, s: ScheduledSeq) -> np.ndarray:
        if s.drafts:
            return self.prefix_keys(self._row_tokens(s))
        keys, tok = self._req_keys(s.req), self._pending_token(s)
        if tok is None:
            return keys
        self.prefix_keys(np.zeros(len(keys) + 1, np.int64))  # enough coefficients
        with np.errstate(over="ignore"):
            last = (keys[-1] if len(keys) else np.uint64(0)) \
                + (np.uint64(tok) + np.uint64(1)) * self._coef[len(keys)]
        return np.append(keys, last)

    # ---- one step --------------------------------------------------------------------------
    def run(self, scheduled: Sequence[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        try:
            return self._run(scheduled)
        finally:
            self.run_s += time.perf_counter() - t0

    def _begin(self, scheduled: Sequence[ScheduledSeq], specs: list[SeqSpec], key: tuple,
               decode: bool) -> int:
        """A step's bookkeeping, its injected failure and its cross-row hazards; its index."""
        self.last_request_ids = [s.req.request_id for s in scheduled]
        self.program_keys.add(key)
        self._widths[len(specs)] = self._widths.get(len(specs), 0) + 1
        step, self.num_steps = self.num_steps, self.num_steps + 1
        self.decode_steps += decode
        if self._fail_step is not None and self._fail_step(step):
            self._lost = self._lose_pools
            raise RuntimeError(f"injected failure of step {step}")
        hazards = step_hazards(specs, self.page_size)
        if hazards:
            raise DataflowError(f"step {step}: " + "; ".join(hazards))
        return step

    def _run(self, scheduled: Sequence[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
        specs = [s.spec for s in scheduled]
        decode = is_decode_step(specs)
        step = self._begin(scheduled, specs, (decode,), decode)
        keys = [self._row_keys(s) for s in scheduled]
        for s in scheduled:
            self._check_rows(s)
        for s, k in zip(scheduled, keys, strict=True):
            self._check_reads(s, k)
        for s, k in zip(scheduled, keys, strict=True):
            self._write(s.spec, k)
        tokens, logprobs = self._sample(scheduled, keys)
        self._future, self._prev_multi = tokens, None
        if self._fail_read is not None and self._fail_read(step):
            return _Unreadable(step), _Unreadable(step)
        return tokens, logprobs

    def run_multi(self, scheduled: Sequence[ScheduledSeq],
                  iterations: int) -> tuple[np.ndarray, np.ndarray]:
        """``ModelRunner.run_multi`` on the host (``ShadowMulti``, ``engine/shadow/multi.py``):
        row i runs ``scheduled[i].steps`` decode iterations, frozen after a stop token; every
        state an iteration reads is checked. Tokens and logprobs ``[iterations, rows]``."""
        t0 = time.perf_counter()
        try:
            out = self._run_multi(scheduled, iterations)
            step = self.num_steps - 1
            if self._fail_read is not None and self._fail_read(step):
                return _Unreadable(step), _Unreadable(step)
            return out
        finally:
            self.run_s += time.perf_counter() - t0

    def _locs(self, spec: SeqSpec, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        pages = np.asarray(spec.page_ids, np.int64)[pos // self.page_size]
        return pages * self.page_size + pos % self.page_size

    def _check_rows(self, s: ScheduledSeq) -> None:
        """Every page and slot of the row exists in the pools (a moved split drops rows)."""
        spec = s.spec
        pages, slots = len(self.kv_len) // self.page_size, len(self.slot_len)
        slot_ids = [spec.read_slot, spec.write_slot] + [sl for _, sl in spec.snapshots]
        if (len(spec.page_ids) and max(spec.page_ids) >= pages) or max(slot_ids) >= slots:
            raise DataflowError(f"request {s.req.request_id} uses a page or slot past the pools' "
                                f"rows ({pages} pages, {slots} slots): pages "
                                f"{np.asarray(spec.page_ids)[-4:].tolist()}, slots {slot_ids}")

    def _check_reads(self, s: ScheduledSeq, keys: np.ndarray, *,
                     row_tokens: np.ndarray | None = None, end: int | None = None) -> None:
        """``row_tokens`` [multi-step decode]: the row's tokens, its pending ones resolved;
        ``end``: the first iteration's (default ``s.end``)."""
        spec, rid = s.spec, s.req.request_id
        n0, end = spec.prefix_len, s.end if end is None else end
        if row_tokens is None:
            row_tokens = self._row_tokens(s) if spec.prev_index >= 0 else s.req.token_ids
        verified = row_tokens[n0:end]
        extend = np.asarray(spec.tokens)
        if spec.prev_index >= 0:  # [overlap] the placeholder, resolved
            extend = np.append(extend[:-1], np.int32(row_tokens[spec.end - 1]))
        if (len(extend) != len(verified) + len(s.drafts)
                or not np.array_equal(extend[:len(verified)], verified)):
            raise DataflowError(f"request {rid}: extend tokens are not tokens[{n0}:{s.end}] "
                                f"+ {len(s.drafts)} drafts")
        if n0 == 0:
            if spec.read_slot != 0:
                raise DataflowError(f"request {rid} reads slot {spec.read_slot} at position 0")
        elif (self.slot_len[spec.read_slot], self.slot_key[spec.read_slot]) != (n0, keys[n0 - 1]):
            raise DataflowError(
                f"request {rid} reads slot {spec.read_slot} for the state after {n0} tokens; it "
                f"holds the state after {self.slot_len[spec.read_slot]} tokens "
                f"{'of this prompt' if self._holds_own(spec.read_slot, keys) else 'of another'}")
        locs = self._locs(spec, 0, n0)
        bad = np.flatnonzero((self.kv_len[locs] != np.arange(1, n0 + 1))
                             | (self.kv_key[locs] != keys[:n0]))
        if bad.size:
            p = int(bad[0])
            raise DataflowError(f"request {rid}: KV of position {p} (page "
                                f"{spec.page_ids[p // self.page_size]}) holds another prefix")

    def _holds_own(self, slot: int, keys: np.ndarray) -> bool:
        n = int(self.slot_len[slot])
        return 0 < n <= len(keys) and keys[n - 1] == self.slot_key[slot]

    def _write(self, spec: SeqSpec, keys: np.ndarray) -> None:
        n0, end = spec.prefix_len, spec.end
        locs = self._locs(spec, n0, end)
        self.kv_len[locs] = np.arange(n0 + 1, end + 1)
        self.kv_key[locs] = keys[n0:end]
        for n, slot in [(end, spec.write_slot)] + [(n0 + o, sl) for o, sl in spec.snapshots]:
            if slot:
                self.slot_len[slot], self.slot_key[slot] = n, keys[n - 1]

    def _sample(self, scheduled: Sequence[ScheduledSeq],
                keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        tokens: list[int] = []
        logprobs: list[float] = []
        for s, k in zip(scheduled, keys, strict=True):
            spec = s.spec
            ends = range(spec.prefix_len + 1, spec.end + 1) if spec.logits == "all" \
                else [spec.end]
            row = self._row_tokens(s) if self.markov else None
            for j, n in enumerate(ends):
                given = self._outputs(s.req.request_id, s.req.num_outputs + j) \
                    if self._outputs else None
                tokens.append(given if given is not None else self._token_after(row, k, n))
                logprobs.append(-((int(k[n - 1]) >> 7) % 1000) / 1000.0)
        return np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32)

    def _token_after(self, tokens: np.ndarray | None, keys: np.ndarray, n: int) -> int:
        """The oracle's next token after the first ``n`` tokens (``keys``: their prefix keys)."""
        if not self.markov:
            return (int(keys[n - 1]) >> 17) % self.model_cfg.vocab_size
        window = np.asarray(tokens[max(n - self.markov, 0):n], np.uint64)
        with np.errstate(over="ignore"):
            h = int(((window + np.uint64(1)) * self._coef[:len(window)]).sum(dtype=np.uint64))
        return (h >> 17) % self.model_cfg.vocab_size

    def forget(self, request_id: int) -> None:
        self._keys.pop(request_id, None)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def for_config(cls, cfg: EngineConfig, *, vocab_size: int = 1000, context_len: int = 1 << 20,
                   eos_token_id: int | None = None, **kwargs: Any) -> ShadowRunner:
        """A shadow runner sized for ``cfg``'s pools (an ``EngineConfig``)."""
        from mambacache.engine.speculative.verify import num_state_slots

        return cls(ShadowModelConfig(vocab_size, context_len, eos_token_id),
                   num_pages=cfg.cache.num_pages, page_size=cfg.cache.page_size,
                   num_slots=num_state_slots(cfg), **kwargs)

    def expected_output(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """The tokens a request for ``prompt`` must produce (greedy, no stop): what this runner
        samples when every read is right."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            arr = np.asarray(tokens, np.int64)
            tokens.append(self._token_after(arr, self.prefix_keys(arr), len(arr)))
        return tokens[len(prompt):]
