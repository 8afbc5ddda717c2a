"""Host-side request state: tokens, sampling params, status, outputs, timing, and its lease.

A request's cache state (matched node, slots, pages, planned snapshots, scratch lane, computed
tokens) is its ``lease`` (``engine/leases/lease.py``), changed only by the lease's transitions.

Invariants:
  * ``token_ids`` are the known tokens (prompt + outputs read); ``lease.num_computed`` of them
    went through the model;
  * overlap (``scheduler.overlap``): ``num_pending`` tokens were sampled by dispatched rows and
    not read yet (the ``pending_row`` of the step in flight samples the newest); ``num_tokens``
    counts them too. At scheduling time ``num_pending <= 1``, or up to ``scheduler.decode_steps``
    after a multi-step decode dispatch: a decoding request's row feeds its newest pending token
    from the device, and a request with a pending token is never admitted (it
    waits for the token to be read); written only by ``mark_pending`` / ``pending_read``;
  * with speculative decoding ``token_ids`` holds verified tokens only.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from mambacache.engine.leases.lease import Lease


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


#: the members as module constants, for the per-row reads of every step: on Python 3.11 a
#: ``Status.RUNNING`` read goes through ``EnumType.__getattr__`` (~0.2 us, ten times a global)
WAITING, RUNNING, FINISHED = Status.WAITING, Status.RUNNING, Status.FINISHED


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
    lease: Lease = dataclasses.field(kw_only=True)  # its cache state (CacheManager.lease())
    num_pending: int = 0  # [overlap] tokens sampled by dispatched rows, not read yet
    pending_row: int = -1  # [overlap] the row of the step in flight that samples the newest
    cached_tokens: int = 0  # prompt tokens served from the cache (first admission)
    finish_reason: str | None = None
    error: str | None = None
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    #: ``params.constraint``'s grammar state (``logit_controls.ConstraintMatcher``), or None
    matcher: Any = None
    #: the prompt's int32 bytes (prefix comparisons by slicing, without numpy calls)
    prompt_bytes = _PromptBytes()

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)  # read per row of every step: an attribute
        if self.matcher is None and self.params.constraint is not None:
            self.matcher = self.params.constraint.matcher()

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
    def num_computed(self) -> int:
        """Tokens fed through the model (cached ones included): the lease's count."""
        return self.lease.num_computed

    def mark_pending(self, row: int, count: int = 1) -> None:
        """[overlap] Row ``row`` of the step just dispatched samples this request's next
        ``count`` tokens (more than one: a multi-step decode row)."""
        self.num_pending += count
        self.pending_row = row

    def pending_read(self, count: int = 1) -> None:
        """[overlap] The oldest ``count`` pending tokens were read (and are appended next)."""
        self.num_pending -= count

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
