"""Replay a request trace through the prefix cache without a model: hit rates and host cost.

    python -m mambacache.simulate --trace requests.jsonl --config configs/tiny_qwen3_next.toml \\
        [--set cache.page_size=16] [--concurrency 8] [--out result.json] [--check-integrity]

A trace is JSON Lines, one request a line: ``{"prompt": [ids...], "output": [ids...]}``; the
``output`` plays the part of what the model generated. The requests go through the engine
itself (``Engine`` + ``Scheduler`` + the radix cache): admission, chunked prefill, in-batch
dedup, page-boundary snapshots, preemption, finish; only the model is replaced, by the shadow
runner (``mambacache.engine.shadow.runner``), which computes nothing but checks every state and
KV read against the token prefix it needs. So the hit rates are the engine's, and a scheduling
bug is an error here too. ``--concurrency N`` is ``scheduler.max_running_requests``; every request
is queued at once. One that can never fit the pools is dropped and counted.

Result keys: ``prompt_tokens``, ``cached_tokens``, ``hit_rate``, ``us_per_request`` (median host
time of a request: the engine's host time per step, scheduling and cache, without the shadow
runner's checks, shared by the requests in the step), ``engine_us_per_request`` (the engine's
own host time, the shadow runner's checks excluded, summed over all steps, per request),
``engine_us_per_step`` (its median per ``Engine.step`` call; ``--check-integrity`` adds the
checks to both), ``snapshots_kept``, ``snapshots_skipped``, ``snapshots_evicted``,
``peak_token_usage`` / ``peak_mamba_usage`` (peak fraction of the pool protected: held by
requests or locked in the tree), and a few more. With a byte budget
(``--set cache.memory_bytes=N``; sizes from ``model.preset``, a real-size one included, or
``--state-bytes B --kv-bytes-per-token B``) KV and states share the bytes, and the result adds
``state_bytes``, ``kv_bytes_per_token``, ``kv_bytes_held`` / ``state_bytes_held`` (final) and
``peak_kv_bytes_held`` / ``peak_state_bytes_held`` / ``peak_bytes_held``. With a host tier
(``--set cache.host_memory_bytes=N``) also ``host_hit_tokens``, bytes demoted / promoted and
the host usage (``HOST_KEYS``).
Trace helpers: ``shared_prefix_trace``, ``identical_prompt_trace``, ``write_trace``,
``load_trace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging as absl_logging

from mambacache.config import CacheConfig, EngineConfig, parse_set_args
from mambacache.engine.engine import Engine
from mambacache.engine.sampling.params import SamplingParams
from mambacache.engine.shadow.runner import ShadowRunner


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
def _engine_config(cfg: CacheConfig | EngineConfig, concurrency: int,
                   check_integrity: bool) -> EngineConfig:
    base = cfg if isinstance(cfg, EngineConfig) else dataclasses.replace(EngineConfig(), cache=cfg)
    sched = dataclasses.replace(base.scheduler, max_running_requests=concurrency,
                                check_integrity_every_step=check_integrity)
    return dataclasses.replace(base, scheduler=sched)


def simulate(requests: list[dict[str, list[int]]], cfg: CacheConfig | EngineConfig,
             concurrency: int = 1, check_integrity: bool = False,
             on_engine: Callable[[Engine], None] | None = None) -> dict[str, Any]:
    """Replay ``requests`` through the engine's own scheduler and cache on the shadow runner
    (every read checked against the prefix it needs); returns the result dict.

    ``cfg``: the cache section alone, or a whole ``EngineConfig`` (its ``[scheduler]`` section
    then sets the chunk size). ``concurrency`` is ``scheduler.max_running_requests``; all
    requests are queued at once and admitted in order. ``on_engine``: called with the engine
    before the first request (a script's hook: a tuner to use, a split to start at).
    [rebalance] ``cache.rebalance``: the device split moves; ``split_moves`` and
    ``device_split`` (the split at the end, as ``(pages, slots)``) in the result.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    ecfg = _engine_config(cfg, concurrency, check_integrity)
    if ecfg.cache.has_budget:  # one byte budget: pools from the preset's (or given) sizes
        ecfg = budget_config(ecfg, requests)
    outputs: dict[int, list[int]] = {}
    vocab = 1 + max(max(r["prompt"] + list(r["output"]) + [0]) for r in requests) \
        if requests else 1
    runner = ShadowRunner.for_config(
        ecfg, vocab_size=vocab,
        outputs=lambda rid, step: outputs[rid][step] if step < len(outputs[rid]) else None)
    engine = Engine(ecfg, runner=runner)
    if on_engine is not None:
        on_engine(engine)
    dropped = 0
    for r in requests:
        params = SamplingParams(max_new_tokens=max(len(r["output"]), 1), ignore_eos=True)
        try:
            outputs[engine.add_request(r["prompt"], params)] = list(r["output"])
        except ValueError:  # can never fit the pools: dropped and counted
            dropped += 1
    host, steps = _drive(engine)
    m = engine.metrics()
    stats = engine.cache.stats()
    per_request = np.asarray(list(host.values()))
    return {**_byte_keys(ecfg, stats),
        "num_requests": len(host),
        "requests_dropped": dropped,
        "prompt_tokens": m["prompt_tokens"],
        "cached_tokens": m["cached_tokens"],
        "hit_rate": m["hit_rate"],
        "computed_prefill_tokens": m["computed_prefill_tokens"],
        "us_per_request": float(np.median(per_request)) * 1e6 if host else 0.0,
        "us_per_request_mean": float(np.mean(per_request)) * 1e6 if host else 0.0,
        "engine_us_per_request": float(np.sum(steps)) / len(host) * 1e6 if host else 0.0,
        "engine_us_per_step": float(np.median(steps)) * 1e6 if steps else 0.0,
        "steps": m["num_steps"],
        "preemptions": m["preemptions"],
        "decode_program_share": m["decode_program_share"],
        "snapshots_kept": stats["snapshots_kept"],
        "snapshots_skipped": stats["snapshots_skipped"],
        "snapshots_rejected": stats["snapshots_rejected"],
        "snapshots_evicted": stats["snapshots_evicted"],
        "pages_evicted": stats["pages_evicted"],
        "peak_token_usage": m["peak_token_usage"],
        "peak_mamba_usage": m["peak_mamba_usage"],
        **{k: m[k] for k in HOST_KEYS if k in m},  # [host tier] cache.host_memory_bytes
        **_split_keys(engine),  # [rebalance]
    }


def _split_keys(engine: Engine) -> dict[str, Any]:
    rb = engine.rebalancer
    if rb is None:
        return {}
    return {"split_moves": rb.moves, "device_split": list(rb.splits[rb.current]),
            "device_splits": [list(s) for s in rb.splits],
            "split_history": [[a, b] for a, b, _ in rb.history]}


#: the host tier's result keys (``cache/host_tier.py``), with ``cache.host_memory_bytes``
HOST_KEYS = ("host_hit_tokens", "tokens_promoted", "bytes_demoted", "bytes_promoted",
             "demotions", "promotions", "demotions_skipped", "promotions_skipped",
             "host_memory_bytes", "host_bytes_held", "host_usage")


def budget_config(cfg: EngineConfig, requests: list[dict[str, list[int]]]) -> EngineConfig:
    """``cfg`` with its pools derived from ``cache.memory_bytes`` (``engine/pools.size_pools``,
    host pools: KV and states share the bytes). Byte sizes: ``cache.state_bytes`` /
    ``cache.kv_bytes_per_token``, else ``model.preset``'s (a real-size preset allocates
    nothing); the context a request must fit is the trace's longest request."""
    from mambacache.engine.runners.pools import size_pools

    model_cfg = None
    cc = cfg.cache
    if not (cc.state_bytes and cc.kv_bytes_per_token):
        from models.presets import get_preset

        model_cfg = get_preset(cfg.model.preset)
    else:  # sizes and both pools given: size_pools keeps them, so say what they cap
        from mambacache.cache.budget import warn_if_capped

        warn_if_capped(cc, cc.kv_bytes_per_token * cc.page_size, cc.state_bytes, cc.memory_bytes)
    longest = max((len(r["prompt"]) + len(r["output"]) for r in requests), default=1)
    return size_pools(cfg, model_cfg, context_len=longest)[0]


def _byte_keys(cfg: EngineConfig, stats: dict[str, Any]) -> dict[str, Any]:
    """``state_bytes``, ``kv_bytes_per_token``, final and peak bytes held by states and KV
    (budget runs; fixed pools report their sizes when the byte sizes are given)."""
    cc = cfg.cache
    out: dict[str, Any] = {"state_bytes": cc.state_bytes, "kv_bytes_per_token":
                           cc.kv_bytes_per_token, "memory_bytes": cc.memory_bytes,
                           "num_kv_tokens": cc.num_kv_tokens, "num_mamba_slots": cc.num_mamba_slots}
    if "kv_bytes_held" in stats:
        out.update({k: stats[k] for k in ("kv_bytes_held", "state_bytes_held",
                                          "peak_kv_bytes_held", "peak_state_bytes_held",
                                          "peak_bytes_held")})
    return out


def _drive(engine: Engine) -> tuple[dict[int, float], list[float]]:
    """Step ``engine`` until idle; each step's host time (scheduling + cache, not the shadow
    runner's checks) is shared equally by the requests in it. Returns seconds per request and
    the seconds of every ``Engine.step`` call."""
    host: dict[int, float] = {}
    steps: list[float] = []
    runner = engine.runner
    while engine.has_unfinished():
        t0 = time.perf_counter()
        r0 = runner.run_s
        before = engine.scheduler.progress_marker()
        engine.step()
        rows = runner.last_request_ids
        step_s = time.perf_counter() - t0 - (runner.run_s - r0)
        steps.append(step_s)
        share = step_s / max(len(rows), 1)
        for rid in rows:
            host[rid] = host.get(rid, 0.0) + share
        if engine.scheduler.progress_marker() == before:
            raise RuntimeError(f"simulation made no progress: {engine.scheduler.describe()}")
    return host, steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m mambacache.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="JSON Lines trace")
    ap.add_argument("--config", default=None, help="TOML config (defaults if omitted)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--check-integrity", action="store_true",
                    help="check the step invariants and the engine's integrity every step")
    ap.add_argument("--state-bytes", type=int, default=0,
                    help="bytes of one state (replay another model's mapping; with a budget)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=0,
                    help="bytes of one token of KV (with --state-bytes)")
    ap.add_argument("-v", "--verbosity", type=int, default=-1,
                    help="absl log level: -1 warnings (default), 0 info, 1 preemptions")
    args = ap.parse_args(argv)
    absl_logging.set_verbosity(args.verbosity)
    overrides = parse_set_args(args.sets)
    if args.state_bytes:
        overrides["cache.state_bytes"] = args.state_bytes
    if args.kv_bytes_per_token:
        overrides["cache.kv_bytes_per_token"] = args.kv_bytes_per_token
    cfg = EngineConfig.load(args.config, overrides=overrides)
    result = simulate(load_trace(args.trace), cfg, args.concurrency, args.check_integrity)
    result["config"] = {**dataclasses.asdict(cfg.cache), "num_kv_tokens": result["num_kv_tokens"],
                        "num_mamba_slots": result["num_mamba_slots"]}
    result["scheduler"] = dataclasses.asdict(cfg.scheduler)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
