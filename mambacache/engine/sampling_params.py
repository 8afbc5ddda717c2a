"""``SamplingParams``: how one request samples (host side, validated; no JAX)."""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_NEW_TOKENS_LIMIT = 1 << 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy; ``top_k == 0`` means no limit."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (isinstance(self.max_new_tokens, int) and 1 <= self.max_new_tokens
             <= MAX_NEW_TOKENS_LIMIT, f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}]"),
            (np.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
             "temperature must be in [0, 100]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an int >= 0"),
            (np.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.seed, int) and 0 <= self.seed < 2**31, "seed must be in [0, 2**31)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{msg}, got {self!r}")
