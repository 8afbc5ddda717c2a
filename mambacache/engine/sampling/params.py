"""``SamplingParams``: how one request samples (host side, validated once; no JAX).

The bounds here are the only ones: the engine checks every field at construction, the HTTP
protocol (``serve/protocol.py``) declares its fields with the same limits, and the packer
(``engine/sampling/sampler.py``) can therefore put every field into an int32 / float32 row. Integers
may be Python or numpy ints (stored as ``int``); ``bool`` is never an int here. A bad field is a
``ValueError`` naming the field, the value and the limit, never a dump of the whole object.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

MAX_NEW_TOKENS_LIMIT = 1 << 20
TEMPERATURE_LIMIT = 100.0
#: top_k above any vocabulary this project serves; a top_k >= the vocabulary is no limit.
TOP_K_LIMIT = 1 << 20
SEED_LIMIT = 1 << 31
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID_MAX = (1 << 31) - 1  # stop token ids fit int32 (the vocabulary check is the engine's)
#: presence / frequency penalties in [-2, 2] (OpenAI's range); repetition in (0, 2] (SGLang's)
PENALTY_LIMIT = 2.0
REPETITION_PENALTY_LIMIT = 2.0


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an ``int`` in ``[lo, hi]``; numpy ints accepted, bools and floats refused."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {_show(value)} ({type(value).__name__})")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def as_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a finite ``float`` in ``[lo, hi]`` (``(lo, hi]`` if ``lo_open``)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_show(value)} ({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi):
        interval = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def as_token_ids(name: str, value: Any, max_count: int) -> tuple[int, ...]:
    """A sequence of at most ``max_count`` token ids (ints >= 0 that fit int32) as a tuple."""
    if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
        raise ValueError(f"{name} must be a sequence of ints, got {_show(value)}")
    if len(value) > max_count:
        raise ValueError(f"{name}: {len(value)} ids, the limit is {max_count}")
    return tuple(as_int(f"{name}[{i}]", t, 0, TOKEN_ID_MAX) for i, t in enumerate(value))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy; ``top_k == 0`` means no limit.

    Limits: ``max_new_tokens`` in [1, 2^20], ``temperature`` in [0, 100], ``top_k`` in
    [0, 2^20], ``top_p`` in (0, 1], ``seed`` in [0, 2^31), at most 1024 ``stop_token_ids``,
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` in (0, 2].

    Penalties (``engine/sampling/logit_controls.py``, on the device, before temperature): a token
    seen in the prompt or the output has its logit divided by ``repetition_penalty`` if positive,
    multiplied by it otherwise; a token seen ``c`` times in the output loses
    ``frequency_penalty * c + presence_penalty * (c > 0)``. ``constraint``: a
    ``logit_controls.TokenConstraint`` (a grammar: only the tokens it allows are sampled; the
    request stops when it is complete). Logprobs stay the model's (before penalties and masks).
    ``host_stops``: the caller ends the request on conditions the engine cannot see (the
    server's stop strings): it decodes one token per step (no multi-step decode), so no token
    past such a stop is sampled.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: Any = dataclasses.field(default=None, compare=False)
    host_stops: bool = False
    #: sampling reads the tokens so far on the host (penalties, a constraint): no row of this
    #: request is dispatched while a sampled token is still on the device [overlap], and it
    #: takes no speculative verify rows (set from the fields; read per row of every step)
    needs_history: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        fields = {
            "max_new_tokens": as_int("max_new_tokens", self.max_new_tokens, 1,
                                     MAX_NEW_TOKENS_LIMIT),
            "temperature": as_float("temperature", self.temperature, 0.0, TEMPERATURE_LIMIT),
            "top_k": as_int("top_k", self.top_k, 0, TOP_K_LIMIT),
            "top_p": as_float("top_p", self.top_p, 0.0, 1.0, lo_open=True),
            "seed": as_int("seed", self.seed, 0, SEED_LIMIT - 1),
            "stop_token_ids": as_token_ids("stop_token_ids", self.stop_token_ids,
                                           MAX_STOP_TOKEN_IDS),
            "presence_penalty": as_float("presence_penalty", self.presence_penalty,
                                         -PENALTY_LIMIT, PENALTY_LIMIT),
            "frequency_penalty": as_float("frequency_penalty", self.frequency_penalty,
                                          -PENALTY_LIMIT, PENALTY_LIMIT),
            "repetition_penalty": as_float("repetition_penalty", self.repetition_penalty,
                                           0.0, REPETITION_PENALTY_LIMIT, lo_open=True),
        }
        if self.constraint is not None and not callable(
                getattr(self.constraint, "matcher", None)):
            raise ValueError(f"constraint must have a matcher() method (a TokenConstraint), got "
                             f"{type(self.constraint).__name__}")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise ValueError(f"ignore_eos must be a bool, got {_show(self.ignore_eos)}")
        fields["ignore_eos"] = bool(self.ignore_eos)
        if not isinstance(self.host_stops, bool | np.bool_):
            raise ValueError(f"host_stops must be a bool, got {_show(self.host_stops)}")
        fields["host_stops"] = bool(self.host_stops)
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "needs_history", self.constraint is not None or self.penalized)

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

