"""Synthetic multi-turn traces for the simulator, next to the ShareGPT chat (``sharegpt.py``).

* ``agent_trace``: tool-using agents. A few long tool / system prompts are shared by many
  sessions; a session starts with one of them + a task, then each step appends the model's tool
  call (its output) and the tool's result (the next prompt part). Steps follow each other after
  the tool's latency (``chat_trace`` with a short think time), sessions arrive as a Poisson
  process, all of them interleaved in time order.
* ``synthetic_chat_trace``: the same layout without shared prompts and with chat-like lengths
  (user 20-200 tokens, replies 50-400): a stand-in for ShareGPT where the extra is not
  installed.

Token ids are uniform in ``[1, vocab)``; every length is drawn from ``default_rng(seed)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.bench.sharegpt import chat_trace


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, int(n)).tolist()


def agent_trace(num_sessions: int = 300, num_tools_prompts: int = 4, tools_len: int = 2000,
                task_len: int = 100, steps: tuple[int, int] = (3, 12),
                call_len: tuple[int, int] = (20, 150), result_len: tuple[int, int] = (50, 800),
                sessions_per_s: float = 0.5, tool_latency_s: float = 2.0, vocab: int = 32000,
                seed: int = 0) -> list[dict[str, Any]]:
    """Interleaved agent sessions; records as ``chat_trace``'s."""
    rng = np.random.default_rng(seed)
    tools = [_ids(rng, tools_len, vocab) for _ in range(num_tools_prompts)]
    convs = []
    for _ in range(num_sessions):
        first = tools[int(rng.integers(num_tools_prompts))] + _ids(rng, task_len, vocab)
        turns = []
        for k in range(int(rng.integers(steps[0], steps[1] + 1))):
            part = first if k == 0 else _ids(rng, rng.integers(*result_len), vocab)
            turns.append((part, _ids(rng, rng.integers(*call_len), vocab)))
        convs.append(turns)
    return chat_trace(convs, sessions_per_s, tool_latency_s, typing_tokens_per_s=1e9,
                      decode_tokens_per_s=100.0, seed=seed)


def synthetic_chat_trace(num_sessions: int = 300, turns: tuple[int, int] = (2, 10),
                         user_len: tuple[int, int] = (20, 200),
                         reply_len: tuple[int, int] = (50, 400), sessions_per_s: float = 0.1,
                         think_time_s: float = 10.0, vocab: int = 32000,
                         seed: int = 0) -> list[dict[str, Any]]:
    """Interleaved chat sessions with random text; records as ``chat_trace``'s."""
    rng = np.random.default_rng(seed)
    convs = [[(_ids(rng, rng.integers(*user_len), vocab), _ids(rng, rng.integers(*reply_len),
                                                                vocab))
              for _ in range(int(rng.integers(turns[0], turns[1] + 1)))]
             for _ in range(num_sessions)]
    return chat_trace(convs, sessions_per_s, think_time_s, seed=seed)
