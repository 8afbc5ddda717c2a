"""Bucket merging, measured without a compile: the programs a bench config warms up and the
padding its workload's steps pay, for today's buckets and merged variants (issue 38 item 1).

    python scripts/bucket_padding.py --config configs/bench/gsp_identical.toml [--set k=v ...]
                                     [--max-seq-len N] [--out padding.json]

The workload (every item, follow-ups with full-length outputs) is replayed through the engine's
own scheduler and cache on the shadow runner (``bench.simulate.simulate``: host only), and each
step's rows are recorded. Each variant maps a step to its program shape; the table gives the
program count of the variant's set (``engine_buckets``' bounds: the workload's longest
sequence, as ``mambacache.bench`` warms up), the distinct programs the workload ran, padded
tokens / real tokens (token rows computed per token needed) and padded pages / real pages (page
table entries the real rows' attention reads, ``rows x P``, per page they hold). Variants:

* ``today``: ``engine/step/buckets.py`` as is (decode widths 4, 8, ..., extend tokens 16, 32, ...);
* ``tokens_x4``: extend token buckets 16, 64, 256, ... (every other rung);
* ``one_width``: one decode width (``max_seqs``);
* ``decode_as_extend``: no decode programs, a decode step runs the extend program of its tokens;
* ``pages_x16``: the page ladder in steps of 16 instead of 4;
* ``a+b``: both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from mambacache.engine.step.buckets import MIN_PAGE_BUCKET, Buckets, bucket, ladder

Step = tuple[bool, list[tuple[int, int]]]  # (decode, [(new tokens, tokens held after), ...])
Shape = tuple[str, int, int]  # (program kind, token rows, pages per sequence)


def workload_requests(setup: Any, vocab: int) -> tuple[list[dict[str, list[int]]], int]:
    """The workload as a trace (outputs of token 1) and its longest sequence in tokens."""
    todo, out, longest = list(setup.workload.source(vocab, setup.bench.seed).start()), [], 0
    source = setup.workload.source(vocab, setup.bench.seed)
    while todo:
        item = todo.pop(0)
        out.append({"prompt": list(item.prompt), "output": [1] * item.max_new_tokens})
        longest = max(longest, len(item.prompt) + item.max_new_tokens)
        nxt = source.follow_up(item, [1] * item.max_new_tokens)
        if nxt is not None:
            todo.append(nxt)
    return out, longest


def record_steps(cfg: Any, requests: list[dict[str, list[int]]]) -> list[Step]:
    """Every step the engine schedules for ``requests`` on the shadow runner."""
    from mambacache.bench.simulate import simulate
    from mambacache.engine.step.plan import is_decode_step

    steps: list[Step] = []

    def hook(engine: Any) -> None:
        run = engine.runner.run

        def recording(scheduled):
            specs = [s.spec for s in scheduled]
            steps.append((is_decode_step(specs),
                          [(len(s.tokens), s.prefix_len + len(s.tokens)) for s in specs]))
            return run(scheduled)

        engine.runner.run = recording

    cfg = cfg.replace(**{"scheduler.decode_steps": 1})  # one row of tokens per dispatch
    simulate(requests, cfg, concurrency=cfg.scheduler.max_running_requests, on_engine=hook)
    return steps


def _pages(b: Buckets, rows: list[tuple[int, int]], step: int) -> int:
    need = max(-(-end // b.page_size) for _, end in rows)
    return next((p for p in _page_ladder(b, step) if p >= need), bucket(need, 1))


def _page_ladder(b: Buckets, step: int) -> list[int]:
    """``Buckets.page_ladder`` dividing by ``step`` (4 there)."""
    out, n = [], b.max_pages
    while n >= MIN_PAGE_BUCKET:
        out.append(n)
        n //= step
    return out[::-1]


def _token_rungs(b: Buckets, every: int) -> list[int]:
    """The extend token ladder, every ``every``-th rung kept, anchored at the top."""
    return ladder(b.min_tokens, b.max_step_tokens)[::-1][::every][::-1]


def variant(name: str, b: Buckets) -> tuple[Callable[[Step], Shape], int]:
    """``(step -> shape, programs in the variant's set)``."""
    pstep = 16 if "pages_x16" in name else 4
    pages = len(_page_ladder(b, pstep))
    every = 2 if "tokens_x4" in name else 1
    tokens = _token_rungs(b, every)
    widths = [b.max_seqs] if "one_width" in name else b.widths()
    merged = "decode_as_extend" in name

    def shape(step: Step) -> Shape:
        decode, rows = step
        n = sum(t for t, _ in rows)
        p = _pages(b, rows, pstep)
        if decode and not merged:
            return ("decode", next(w for w in widths if w >= min(len(rows), b.max_seqs)), p)
        return ("extend", next((t for t in tokens if t >= n), bucket(n, 1)), p)

    decode_programs = 0 if merged else len(widths) * pages
    return shape, decode_programs + len(tokens) * len(b.logit_ladder()) * pages


VARIANTS = ("today", "tokens_x4", "one_width", "decode_as_extend", "pages_x16",
            "decode_as_extend+pages_x16")


def measure(b: Buckets, steps: list[Step]) -> dict[str, dict[str, float]]:
    real_tokens = sum(t for _, rows in steps for t, _ in rows)
    real_pages = sum(-(-end // b.page_size) for _, rows in steps for _, end in rows)
    out = {}
    for name in VARIANTS:
        shape, programs = variant(name, b)
        shapes = [shape(s) for s in steps]
        out[name] = {"programs": programs, "programs_run": len(set(shapes)),
                     "tokens_ratio": sum(t for _, t, _ in shapes) / real_tokens,
                     "pages_ratio": sum(len(rows) * p for (_, rows), (_, _, p)
                                        in zip(steps, shapes, strict=True)) / real_pages}
    return out


def main(argv: list[str] | None = None) -> int:
    from mambacache.bench.cli import load_setup
    from mambacache.config import parse_set_args
    from mambacache.engine.runners.warmup import engine_buckets
    from mambacache.engine.speculative.verify import max_rows
    from mambacache.parallel.plan import load_model_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--max-seq-len", type=int, default=-1,
                    help="the warm-up's bound (0: the model's context; default: the workload's "
                         "longest sequence, as mambacache.bench warms up)")
    ap.add_argument("--out")
    opts = ap.parse_args(argv)
    setup = load_setup(opts.config, parse_set_args(opts.set))
    cfg = setup.engine
    model_cfg = cfg.model.capped(load_model_config(cfg))
    requests, longest = workload_requests(setup, model_cfg.vocab_size)
    context = model_cfg.max_position_embeddings
    bound = {-1: min(longest, context), 0: context}.get(opts.max_seq_len, opts.max_seq_len)
    b = engine_buckets(cfg, model_cfg, bucket(max_rows(cfg), 1), bound)
    steps = record_steps(cfg, requests)
    if b.program_set() and len(b.program_set()) != variant("today", b)[1]:
        raise SystemExit("the 'today' variant's program count is not Buckets.program_set's")
    result = measure(b, steps)
    print(f"{len(requests)} requests, {len(steps)} steps ({sum(d for d, _ in steps)} decode), "
          f"longest {longest} tokens; buckets {dataclasses.asdict(b)}")
    print(f"{'variant':26s} {'programs':>8s} {'run':>4s} {'tokens x':>9s} {'pages x':>8s}")
    for name, r in result.items():
        print(f"{name:26s} {r['programs']:8d} {r['programs_run']:4d} {r['tokens_ratio']:9.3f} "
              f"{r['pages_ratio']:8.3f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
