"""Benchmark workloads: one frozen dataclass per ``[workload]`` kind, each a request source
(``sharegpt``, real conversations, lives in ``sharegpt.py``).

A source hands out ``BenchItem``s (token-id prompts and an output length) up front
(``start``), and may follow a finished item with another (``follow_up``: the next turn of a
multi-turn client). Every random choice comes from ``numpy.random.default_rng(seed)``.

``IdealHits`` / ``ideal_hit_rate`` give the upper bound a prefix cache can reach on the prompts in
the order they were sent: every prompt reuses its longest common prefix with anything seen
before (earlier prompts, finished prompt + output), capped at all but its last token.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mambacache.bench.items import BenchItem, check_ints
from mambacache.bench.items import require as _require
from mambacache.bench.sharegpt import ShareGPTChat
from mambacache.config import build_sections


def _check_ratio(value: Any) -> None:
    _require(isinstance(value, int | float) and 0.0 <= value <= 1.0,
             f"workload.range_ratio must be in [0, 1], got {value!r}")


def _lengths(rng: np.random.Generator, full: int, ratio: float, n: int, minimum: int = 0):
    """``n`` ints uniform in ``[max(minimum, floor(full * ratio)), max(minimum, full)]``."""
    hi = max(minimum, full)
    lo = min(hi, max(minimum, int(full * ratio)))
    return rng.integers(lo, hi + 1, n).tolist()


def _tokens(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


class StaticSource:
    """A fixed list of items; nothing follows a finished one."""

    def __init__(self, items: list[BenchItem]):
        self.items = items
        self.total = len(items)

    def start(self) -> list[BenchItem]:
        return list(self.items)

    def follow_up(self, item: BenchItem, output_ids: list[int]) -> BenchItem | None:
        return None


def max_seq_len(source: Any) -> int:
    """Tokens of the longest request ``source`` sends (prompt + ``max_new_tokens``), following
    every item with a full-length output (the bench ignores EOS): the bound warm-up compiles
    for. Consumes ``source``: pass a fresh one."""
    longest, todo = 0, list(source.start())
    while todo:
        item = todo.pop()
        longest = max(longest, len(item.prompt) + item.max_new_tokens)
        nxt = source.follow_up(item, [0] * item.max_new_tokens)
        if nxt is not None:
            todo.append(nxt)
    return longest


@dataclasses.dataclass(frozen=True)
class GeneratedSharedPrefix:
    """SGLang bench_serving ``generated-shared-prefix``: ``num_groups`` system prompts, each
    followed by ``prompts_per_group`` questions; lengths uniform in ``[len * range_ratio, len]``
    (output at least 1); shuffled unless ``ordered``."""

    num_groups: int = 4
    prompts_per_group: int = 8
    system_prompt_len: int = 512
    question_len: int = 32
    output_len: int = 16
    range_ratio: float = 1.0
    ordered: bool = False

    def __post_init__(self):
        check_ints(self, ("num_groups", "prompts_per_group"), 1)
        check_ints(self, ("system_prompt_len", "question_len", "output_len"), 0)
        _require(self.system_prompt_len + self.question_len > 0,
                 "workload.system_prompt_len + question_len must be > 0")
        _check_ratio(self.range_ratio)

    def source(self, vocab: int, seed: int) -> StaticSource:
        rng = np.random.default_rng(seed)
        items = []
        for g in range(self.num_groups):
            sys_len = _lengths(rng, self.system_prompt_len, self.range_ratio, 1)[0]
            system = _tokens(rng, vocab, sys_len)
            q_lens = _lengths(rng, self.question_len, self.range_ratio, self.prompts_per_group,
                              minimum=0 if sys_len else 1)
            o_lens = _lengths(rng, self.output_len, self.range_ratio, self.prompts_per_group, 1)
            for q_len, o_len in zip(q_lens, o_lens, strict=True):
                items.append(BenchItem(system + _tokens(rng, vocab, q_len), o_len, client=g))
        if not self.ordered:
            items = [items[i] for i in rng.permutation(len(items))]
        return StaticSource(items)


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """``num_clients`` conversations of ``num_rounds`` turns: each turn's prompt is the previous
    prompt + its output + a new user message; the next turn is sent when the previous finished.
    The system prompt is shared by all clients when ``shared_system_prompt``."""

    num_clients: int = 8
    num_rounds: int = 4
    system_prompt_len: int = 128
    user_len: int = 32
    output_len: int = 16
    range_ratio: float = 1.0
    shared_system_prompt: bool = True

    def __post_init__(self):
        check_ints(self, ("num_clients", "num_rounds", "user_len", "output_len"), 1)
        check_ints(self, ("system_prompt_len",), 0)
        _check_ratio(self.range_ratio)
        _require(isinstance(self.shared_system_prompt, bool),
                 f"workload.shared_system_prompt must be a bool, got {self.shared_system_prompt!r}")

    def source(self, vocab: int, seed: int) -> MultiTurnSource:
        return MultiTurnSource(self, vocab, seed)


class MultiTurnSource:
    def __init__(self, spec: MultiTurn, vocab: int, seed: int):
        self.spec, self.vocab = spec, vocab
        self.rng = np.random.default_rng(seed)
        self.total = spec.num_clients * spec.num_rounds
        shared = _tokens(self.rng, vocab, spec.system_prompt_len)
        self.systems = [shared if spec.shared_system_prompt
                        else _tokens(self.rng, vocab, spec.system_prompt_len)
                        for _ in range(spec.num_clients)]
        # per-client length draws fixed up front so that the workload does not depend on timing
        self.user_lens = [_lengths(self.rng, spec.user_len, spec.range_ratio, spec.num_rounds, 1)
                          for _ in range(spec.num_clients)]
        self.out_lens = [_lengths(self.rng, spec.output_len, spec.range_ratio, spec.num_rounds, 1)
                         for _ in range(spec.num_clients)]
        self.user_msgs = [[_tokens(self.rng, vocab, n) for n in lens] for lens in self.user_lens]

    def start(self) -> list[BenchItem]:
        return [BenchItem(self.systems[c] + self.user_msgs[c][0], self.out_lens[c][0], c, 0)
                for c in range(self.spec.num_clients)]

    def follow_up(self, item: BenchItem, output_ids: list[int]) -> BenchItem | None:
        c, turn = item.client, item.turn + 1
        if turn >= self.spec.num_rounds:
            return None
        prompt = item.prompt + list(output_ids) + self.user_msgs[c][turn]
        return BenchItem(prompt, self.out_lens[c][turn], c, turn)


@dataclasses.dataclass(frozen=True)
class NoReuse:
    """``num_prompts`` random prompts, nothing to share: what the cache costs when it cannot
    help."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 16
    range_ratio: float = 1.0

    def __post_init__(self):
        check_ints(self, ("num_prompts", "input_len", "output_len"), 1)
        _check_ratio(self.range_ratio)

    def source(self, vocab: int, seed: int) -> StaticSource:
        rng = np.random.default_rng(seed)
        in_lens = _lengths(rng, self.input_len, self.range_ratio, self.num_prompts, 1)
        out_lens = _lengths(rng, self.output_len, self.range_ratio, self.num_prompts, 1)
        return StaticSource([BenchItem(_tokens(rng, vocab, n), o, client=i)
                             for i, (n, o) in enumerate(zip(in_lens, out_lens, strict=True))])


@dataclasses.dataclass(frozen=True)
class Branching:
    """``num_trees`` few-shot prompts (``fewshot_len`` tokens), each the root of a tree with
    ``branch_factor`` children per node down to ``depth``; each edge appends an odd number of
    tokens in ``[segment_len * range_ratio, segment_len]``. Every non-root node is a request, so
    prefixes are shared at odd, page-unaligned lengths. Shuffled unless ``ordered``."""

    num_trees: int = 2
    fewshot_len: int = 256
    branch_factor: int = 3
    depth: int = 2
    segment_len: int = 31
    output_len: int = 8
    range_ratio: float = 0.5
    ordered: bool = False

    def __post_init__(self):
        check_ints(self, ("num_trees", "branch_factor", "depth", "segment_len", "output_len"), 1)
        check_ints(self, ("fewshot_len",), 0)
        _check_ratio(self.range_ratio)

    def source(self, vocab: int, seed: int) -> StaticSource:
        rng = np.random.default_rng(seed)
        items = []
        for t in range(self.num_trees):
            level = [_tokens(rng, vocab, self.fewshot_len)]
            for _ in range(self.depth):
                nxt = []
                for parent in level:
                    for n in _lengths(rng, self.segment_len, self.range_ratio,
                                      self.branch_factor, 1):
                        nxt.append(parent + _tokens(rng, vocab, n | 1))
                items += [BenchItem(p, self.output_len, client=t) for p in nxt]
                level = nxt
        if not self.ordered:
            items = [items[i] for i in rng.permutation(len(items))]
        return StaticSource(items)


@dataclasses.dataclass(frozen=True)
class Trace:
    """A JSONL trace, ``{"prompt": [ids], "output": [ids]}`` a line, sent in file order;
    ``len(output)`` is the request's ``max_new_tokens`` (EOS ignored). ``max_requests`` = 0: all."""

    path: str = ""
    max_requests: int = 0

    def __post_init__(self):
        _require(isinstance(self.path, str) and self.path != "",
                 "workload.path must name a JSONL trace file")
        check_ints(self, ("max_requests",), 0)

    def source(self, vocab: int, seed: int) -> StaticSource:
        path = Path(self.path)
        _require(path.is_file(), f"workload.path {self.path!r} does not exist")
        items = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                prompt, output = rec.get("prompt"), rec.get("output")
                _require(isinstance(prompt, list) and prompt and isinstance(output, list)
                         and output, f"{self.path}:{lineno}: need non-empty 'prompt' and 'output'")
                items.append(BenchItem([int(t) for t in prompt], len(output), client=lineno))
                if self.max_requests and len(items) >= self.max_requests:
                    break
        _require(bool(items), f"trace {self.path!r} holds no requests")
        return StaticSource(items)


WORKLOADS: dict[str, type] = {
    "generated_shared_prefix": GeneratedSharedPrefix,
    "multi_turn": MultiTurn,
    "no_reuse": NoReuse,
    "branching": Branching,
    "trace": Trace,
}


WORKLOADS["sharegpt"] = ShareGPTChat  # real conversations: ``sharegpt.py``


def workload_from_dict(data: dict[str, Any]) -> Any:
    """The workload dataclass for a ``[workload]`` table (``kind`` + that kind's fields)."""
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in WORKLOADS:
        raise ValueError(f"workload.kind must be one of {sorted(WORKLOADS)}, got {kind!r}")
    return build_sections(WORKLOADS[kind], data)


class IdealHits:
    """Upper bound on the token hit rate of a run: each prompt, when sent, reuses its longest
    common prefix with anything seen before (earlier prompts, and the prompt + output of finished
    requests), at most ``len - 1`` tokens. A token trie of nested dicts."""

    def __init__(self):
        self.root: dict = {}
        self.hit = self.total = 0

    def send(self, prompt: Sequence[int]) -> int:
        """Account ``prompt`` (returns its ideal hit) and remember it."""
        node, depth = self.root, 0
        for tok in prompt:
            nxt = node.get(tok)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        hit = min(depth, max(len(prompt) - 1, 0))
        self.hit += hit
        self.total += len(prompt)
        for tok in prompt[depth:]:
            node = node.setdefault(tok, {})
        return hit

    def insert(self, tokens: Sequence[int]) -> None:
        """Remember ``tokens`` (a finished request's prompt + output) without accounting them."""
        node = self.root
        for tok in tokens:
            node = node.setdefault(tok, {})

    @property
    def rate(self) -> float:
        return self.hit / self.total if self.total else 0.0


def ideal_hit_rate(prompts: Sequence[Sequence[int]]) -> float:
    """``IdealHits`` over ``prompts`` sent in this order (nothing else inserted)."""
    ideal = IdealHits()
    for prompt in prompts:
        ideal.send(prompt)
    return ideal.rate
