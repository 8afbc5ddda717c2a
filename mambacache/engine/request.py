"""Host-side request state: what a request holds while it waits, runs and finishes.

Invariants (checked by ``Engine.check_integrity``):
  * a RUNNING request owns exactly one running state slot (``running_slot``) and the KV pages in
    ``own_page_ids``; ``page_ids = cached_page_ids + own_page_ids`` cover ``kv_len`` tokens;
  * ``pending_snapshots`` map positions (tokens) to slots planned for this request; those slots
    belong to the cache from the moment they are planned and are handed to it on insert;
  * ``num_computed`` tokens of ``token_ids`` have been fed through the model; the state in
    ``state_slot`` (the running slot, or a page-boundary decode snapshot it planned) is the state
    after exactly ``num_computed`` tokens once the first step ran (``state_valid``);
  * a request goes through the decode path only when ``prefilled`` (its prefill's last chunk
    ran); until then its snapshots are published as soon as they are written;
  * overlap (``scheduler.overlap``): ``num_pending`` tokens were sampled by dispatched rows and
    not read yet (the ``pending_row`` of the step in flight samples the newest). ``token_ids``
    are the known tokens only; ``num_tokens`` counts the pending ones too. At scheduling time
    ``num_pending <= 1``: a decoding request's row feeds its pending token from the device, and
    a request with a pending token is never admitted (it waits for the token to be read);
  * every slot a request reads is its own or the state of ``match_node``, which it keeps locked;
  * with speculative decoding, ``state_slot`` may be one of ``scratch_slots`` (its lane, outside
    the cache's slots; ``engine/speculative.py``); ``token_ids`` holds verified tokens only.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

import numpy as np

from mambacache.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class _TokenList:
    """A ``list[int]`` dataclass field kept as given and made a list on first read: the engine
    hands over its ``int32`` prompt array, and ``tolist()`` (~5 us for 576 tokens on the 2-core
    development box) is paid only by a caller that reads the field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> list[int]:
        if obj is None:  # no class-level default: the dataclass field stays required
            raise AttributeError(self.attr)
        value = obj.__dict__[self.attr]
        if type(value) is not list:
            value = obj.__dict__[self.attr] = np.asarray(value).tolist()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.attr] = value


@dataclasses.dataclass
class RequestOutput:
    """What ``Engine.generate`` returns per request."""

    request_id: int
    prompt_token_ids: list[int] = _TokenList()  # type: ignore[assignment]
    output_token_ids: list[int]
    output_logprobs: list[float]
    cached_tokens: int
    finish_reason: str  # "length", "stop", "abort" or "error"
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)


class _PromptBytes:
    """``Request.prompt_bytes``: computed on first read, then a plain instance attribute (like
    ``functools.cached_property``, without its lock: ~0.7 us less per request on Python 3.11)."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__["prompt_bytes"] = obj.prompt.tobytes()
        return value


@dataclasses.dataclass(eq=False)
class Request:
    request_id: int
    prompt: np.ndarray  # int32 [prompt_len]
    params: SamplingParams
    extra_key: str | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # cache bookkeeping while running
    match_node: Any = None
    read_slot: int | None = None  # slot of the cached state (None: zero state); first step only
    running_slot: int | None = None
    cached_page_ids: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int32))
    own_page_ids: np.ndarray = dataclasses.field(  # int32, pages this request allocated
        default_factory=lambda: np.zeros(0, np.int32))
    pending_snapshots: dict[int, int] = dataclasses.field(default_factory=dict)
    scratch_slots: tuple[int, ...] = ()  # speculative lane: k + 1 slots outside the cache's
    snapshots_in_flight: set[int] = dataclasses.field(default_factory=set)  # scheduled positions
    num_computed: int = 0  # tokens fed through the model (cached ones included)
    num_pending: int = 0  # [overlap] tokens sampled by dispatched rows, not read yet
    pending_row: int = -1  # [overlap] the row of the step in flight that samples the newest
    cached_tokens: int = 0  # prompt tokens served from the cache (first admission)
    prefilled: bool = False  # the chunk reaching the last token ran: decode from here on
    state_valid: bool = False  # state_slot holds the state after num_computed tokens
    state_slot: int | None = None  # running_slot, or a page-boundary snapshot just written
    finish_reason: str | None = None
    error: str | None = None
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    # (cached_page_ids, own_page_ids, their concatenation): ``page_ids`` of the last call; the
    # page arrays are never written in place, only reassigned, so identity says it is current
    _page_ids_memo: tuple | None = dataclasses.field(default=None, init=False, repr=False)

    #: the prompt's int32 bytes (prefix comparisons by slicing, without numpy calls)
    prompt_bytes = _PromptBytes()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def token_ids(self) -> np.ndarray:
        """Prompt plus the generated tokens so far, int32."""
        if not self.output_ids:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output_ids, np.int32)])

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """``token_ids[start:end]`` (int32) without building ``token_ids``: O(end - start), so a
        decode row costs O(1) however long the request is."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        out = np.asarray(self.output_ids[max(start - n, 0):end - n], np.int32)
        return out if start >= n else np.concatenate([self.prompt[start:], out])

    @property
    def num_tokens(self) -> int:
        """Prompt, known outputs and pending outputs (``num_pending``)."""
        return self.prompt_len + len(self.output_ids) + self.num_pending

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, read or pending: the index of the next one."""
        return len(self.output_ids) + self.num_pending

    @property
    def num_remaining(self) -> int:
        """Tokens to feed through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def page_ids(self) -> np.ndarray:
        """``cached_page_ids + own_page_ids`` (int32; read only: it may be either part itself or
        the concatenation kept from the last call while neither part was reassigned)."""
        cached, own = self.cached_page_ids, self.own_page_ids
        if not len(cached):
            return own
        if not len(own):
            return cached
        memo = self._page_ids_memo
        if memo is not None and memo[0] is cached and memo[1] is own:
            return memo[2]
        joined = np.concatenate([cached, own])
        self._page_ids_memo = (cached, own, joined)
        return joined

    def to_output(self) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt,  # a list when read
            output_token_ids=list(self.output_ids), output_logprobs=list(self.output_logprobs),
            cached_tokens=self.cached_tokens, finish_reason=self.finish_reason or "abort",
            error=self.error,
            ttft_s=None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            latency_s=now - self.arrival_s,
            token_times_s=[t - self.arrival_s for t in self.token_times_s])
