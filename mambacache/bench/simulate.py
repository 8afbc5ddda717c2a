"""Replay a request trace through the prefix cache without a model: hit rates and host cost.

    python -m mambacache.simulate --trace requests.jsonl --config configs/x.toml \\
        [--set cache.page_size=16] [--concurrency 8] [--out result.json] [--check-integrity]

A trace is JSON Lines, one request a line: ``{"prompt": [ids...], "output": [ids...]}``; the
``output`` plays the part of what the model generated. Each request goes through the engine's
lifecycle: ``match_prefix`` -> ``lock`` -> running slot + KV pages (``alloc_*``, evicting under
pressure) -> ``plan_snapshots`` + ``assign_snapshot_slots`` -> on finish ``insert`` (prompt +
output[:-1], the planned snapshots, the running slot as the end snapshot when aligned) ->
``unlock``. ``--concurrency N`` keeps N requests in flight (admitted in order; the oldest finishes
first). A request that cannot be admitted waits for a running one to finish; one that cannot fit
even alone is dropped and counted.

Result keys: ``prompt_tokens``, ``cached_tokens``, ``hit_rate``, ``us_per_request`` (median host
time of a request's cache calls), ``snapshots_kept``, ``snapshots_skipped``,
``snapshots_evicted``, ``peak_token_usage`` / ``peak_mamba_usage`` (peak fraction of the pool
protected: held by requests or locked in the tree), and a few more.
Trace helpers: ``shared_prefix_trace``, ``identical_prompt_trace``, ``write_trace``,
``load_trace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from mambacache.config import CacheConfig, EngineConfig, parse_set_args
from mambacache.cache.radix import make_cache_from_config
from mambacache.cache.snapshot_plan import (
    assign_snapshot_slots,
    end_snapshot_is_running_state,
    end_snapshot_position,
    plan_snapshots,
)


# ------------------------------------------------------------------------------- traces
def shared_prefix_trace(num_requests: int, num_prefixes: int, prefix_len: int, tail_len: int,
                        output_len: int = 1, vocab_size: int = 32000,
                        seed: int = 0) -> list[dict[str, list[int]]]:
    """Requests = one of ``num_prefixes`` random prefixes + a random tail; random outputs."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(1, vocab_size, size=(num_prefixes, prefix_len))
    out = []
    for _ in range(num_requests):
        p = prefixes[rng.integers(num_prefixes)]
        tail = rng.integers(1, vocab_size, size=tail_len)
        output = rng.integers(1, vocab_size, size=output_len)
        out.append({"prompt": np.concatenate([p, tail]).tolist(), "output": output.tolist()})
    return out


def identical_prompt_trace(num_requests: int, prompt_len: int, output_len: int = 1,
                           seed: int = 0) -> list[dict[str, list[int]]]:
    """``num_requests`` copies of one random prompt, each with the same output."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 32000, size=prompt_len).tolist()
    output = rng.integers(1, 32000, size=output_len).tolist()
    return [{"prompt": prompt, "output": output} for _ in range(num_requests)]


def write_trace(path: str | Path, requests: list[dict[str, list[int]]]) -> None:
    with Path(path).open("w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": list(r["prompt"]), "output": list(r["output"])}) + "\n")


def load_trace(path: str | Path) -> list[dict[str, list[int]]]:
    out = []
    with Path(path).open() as f:
        for i, line in enumerate(f):
            if line.strip():
                req = json.loads(line)
                if not req.get("prompt"):
                    raise ValueError(f"trace line {i + 1}: 'prompt' must be a non-empty list")
                out.append({"prompt": req["prompt"], "output": req.get("output", [])})
    return out


# ------------------------------------------------------------------------------- replay
@dataclasses.dataclass(slots=True)
class _Running:
    prompt_len: int
    tokens: np.ndarray  # int32: prompt + output[:-1], the tokens the model processes
    match: Any
    running_slot: int
    pages: np.ndarray  # int32: cached pages + own pages, covering ``tokens``
    snapshots: dict[int, int]
    host_s: float


def _admit(cache: Any, prompt: np.ndarray, tokens: np.ndarray, cfg: CacheConfig):
    ps = cfg.page_size
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    slot = cache.alloc_slots(1)
    if slot is None:
        cache.unlock(m.node)
        return None
    own = cache.alloc_pages(-(-len(tokens) // ps) - m.cached_len // ps)
    if own is None:
        cache.free_slots(slot)
        cache.unlock(m.node)
        return None
    positions = plan_snapshots(len(prompt), m.cached_len, m.branch_len, ps,
                               cfg.checkpoint_interval)
    snaps = assign_snapshot_slots(cache, positions, m.branch_len, len(prompt), ps)
    pages = np.concatenate([m.page_ids, own]) if len(m.page_ids) else own
    return _Running(len(prompt), tokens, m, int(slot[0]), pages, snaps, 0.0)


def _finish(cache: Any, r: _Running, page_size: int) -> None:
    total = len(r.tokens) + 1
    snaps = r.snapshots  # the request's own dict: insert takes it over
    end = end_snapshot_position(total, page_size)
    if end_snapshot_is_running_state(total, page_size) and end not in snaps:
        snaps[end] = r.running_slot
    else:
        cache.free_slots(np.array([r.running_slot], dtype=np.int32))
    cache.insert(r.tokens, r.pages, snaps)
    cache.unlock(r.match.node)


def simulate(requests: list[dict[str, list[int]]], cfg: CacheConfig, concurrency: int = 1,
             check_integrity: bool = False) -> dict[str, Any]:
    """Replay ``requests`` through a cache built from ``cfg``; returns the result dict."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    cache = make_cache_from_config(cfg)
    queue = deque()
    for r in requests:
        prompt = np.asarray(r["prompt"], dtype=np.int32)
        out = np.asarray(r["output"], dtype=np.int32)
        tokens = np.concatenate([prompt, out[:-1]]) if len(out) else prompt[:-1].copy()
        queue.append((prompt, tokens if len(tokens) else prompt))
    running: deque[_Running] = deque()
    times, cached, prompt_tokens, dropped = [], 0, 0, 0
    peak_tok = peak_mamba = 0.0
    waited = 0.0
    while queue or running:
        while queue and len(running) < concurrency:
            t0 = time.perf_counter()
            r = _admit(cache, *queue[0], cfg)
            t1 = time.perf_counter()
            if r is None:
                waited += t1 - t0
                if running:
                    break
                dropped += 1
                queue.popleft()
                continue
            queue.popleft()
            r.host_s, waited = t1 - t0 + waited, 0.0
            running.append(r)
            cached += r.match.cached_len
            prompt_tokens += r.prompt_len
            peak_tok = max(peak_tok, (cache.pages.num_held + cache.locked_pages())
                           / cache.pages.num_ids)
            peak_mamba = max(peak_mamba, (cache.slots.num_held + cache.locked_slots())
                             / cache.slots.num_ids)
        if not running:
            break
        r = running.popleft()
        t0 = time.perf_counter()
        _finish(cache, r, cfg.page_size)
        times.append(r.host_s + time.perf_counter() - t0)
        if check_integrity:
            cache.check_integrity()
    stats = cache.stats()
    return {
        "num_requests": len(times),
        "requests_dropped": dropped,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "us_per_request": float(np.median(times)) * 1e6 if times else 0.0,
        "us_per_request_mean": float(np.mean(times)) * 1e6 if times else 0.0,
        "snapshots_kept": stats["snapshots_kept"],
        "snapshots_skipped": stats["snapshots_skipped"],
        "snapshots_rejected": stats["snapshots_rejected"],
        "snapshots_evicted": stats["snapshots_evicted"],
        "pages_evicted": stats["pages_evicted"],
        "peak_token_usage": peak_tok,
        "peak_mamba_usage": peak_mamba,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m mambacache.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="JSON Lines trace")
    ap.add_argument("--config", default=None, help="TOML config (defaults if omitted)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--check-integrity", action="store_true",
                    help="run cache.check_integrity() after every request (slow)")
    args = ap.parse_args(argv)
    cfg = EngineConfig.load(args.config, overrides=parse_set_args(args.sets))
    result = simulate(load_trace(args.trace), cfg.cache, args.concurrency, args.check_integrity)
    result["config"] = dataclasses.asdict(cfg.cache)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
