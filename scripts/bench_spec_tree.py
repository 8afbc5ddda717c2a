"""Draft trees (``speculative.topk``) vs chains at equal verify width: tokens per verify row.

    python scripts/bench_spec_tree.py --config configs/bench/spec_tree.toml \\
        --variants 15x1,3x4,7x2 [--set section.key=value ...] [--out result.json]

A variant ``KxT`` is ``speculative.num_draft_tokens = K`` (each branch's depth) and
``speculative.topk = T``: ``T * (K + 1)`` tokens verified per request per step (its verify
width; a chain is ``T = 1``). Each variant runs the config's workload once, side by side with
``speculative.method = "none"``, and reports ``spec_tokens_per_verify`` (tokens emitted per
request per verify: one per request and step, a tree's rows together), ``spec_verify_width``
(tokens verified per request per verify), ``spec_accept_rate``, ``spec_verify_rows`` (rows: one
per branch), steps, and whether every output equals the run without speculation
(tokens identical, largest logprob difference).

``[workload] kind = "branching_text"`` (this script's, not the bench CLI's) replays a trace on
the shadow runner, whose sampled token is the trace's (no model; every state and KV read is
checked against its token path): per request, ``num_units`` units of one fixed ``stem_len``-token
stem followed by one of ``num_endings`` endings of ``ending_len`` tokens, picked at random (the
prompt is the first ``prompt_units``). Any other workload kind runs the config's model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

KEYS = ("spec_tokens_per_verify", "spec_verify_width", "spec_accept_rate", "spec_verify_steps",
        "spec_verify_rows", "num_steps")


def branching_trace(w: dict[str, Any], seed: int) -> list[dict[str, list[int]]]:
    """Requests of repeated text with several endings (module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(int(w["num_prompts"])):
        stem = rng.integers(1, 30000, int(w["stem_len"])).tolist()
        ends = [rng.integers(1, 30000, int(w["ending_len"])).tolist()
                for _ in range(int(w["num_endings"]))]
        text: list[int] = []
        for _ in range(int(w["num_units"])):
            text += stem + ends[int(rng.integers(len(ends)))]
        cut = int(w["prompt_units"]) * (len(stem) + int(w["ending_len"]))
        out.append({"prompt": text[:cut], "output": text[cut:]})
    return out


def _shadow_run(cfg: Any, trace: list[dict[str, list[int]]]) -> tuple[list, dict[str, Any]]:
    from mambacache.engine.engine import Engine
    from mambacache.engine.sampling.params import SamplingParams
    from mambacache.engine.shadow.runner import ShadowRunner

    outputs: dict[int, list[int]] = {}
    vocab = 1 + max(max(r["prompt"] + r["output"]) for r in trace)
    runner = ShadowRunner.for_config(
        cfg, vocab_size=vocab,
        outputs=lambda rid, step: outputs[rid][step] if step < len(outputs[rid]) else None)
    eng = Engine(cfg, runner=runner)
    ids = []
    for r in trace:
        rid = eng.add_request(r["prompt"], SamplingParams(max_new_tokens=len(r["output"]),
                                                          ignore_eos=True))
        outputs[rid] = r["output"]
        ids.append(rid)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
    eng.check_integrity()
    return [done[i] for i in ids], eng.metrics()


def _model_run(cfg: Any, model: Any, prompts: list, params: Any) -> tuple[list, dict[str, Any]]:
    from mambacache.engine.engine import Engine

    eng = Engine(cfg, model=model)
    outs = eng.generate(prompts, params)
    eng.check_integrity()
    return outs, eng.metrics()


def _compare(outs: list, ref: list) -> dict[str, Any]:
    same = all(a.output_token_ids == b.output_token_ids for a, b in zip(outs, ref, strict=True))
    diff = max((float(np.max(np.abs(np.asarray(a.output_logprobs) - b.output_logprobs)))
                for a, b in zip(outs, ref, strict=True) if a.output_logprobs), default=0.0)
    return {"same_tokens": same, "max_logprob_diff": diff}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--variants", default="15x1,3x4,7x2")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.config import EngineConfig, apply_overrides, parse_set_args, read_toml

    data = apply_overrides(read_toml(args.config), parse_set_args(args.sets))
    work, bench = data.pop("workload"), data.pop("bench", {})
    base = EngineConfig.from_dict({k: v for k, v in data.items()
                                   if k in {f for f in EngineConfig.__dataclass_fields__}})
    seed = int(bench.get("seed", 0))
    if work.get("kind") == "branching_text":
        trace = branching_trace(work, seed)
        run = lambda cfg: _shadow_run(cfg, trace)  # noqa: E731
    else:
        from mambacache.bench.workloads import workload_from_dict
        from mambacache.engine.engine import load_model
        from mambacache.engine.sampling.params import SamplingParams

        model = load_model(base)
        items = workload_from_dict(work).source(model[0].vocab_size, seed).start()
        prompts = [it.prompt for it in items]
        # greedy as the bench CLI; ``--temperature T``: seeded sampling (seed = request index)
        params = [SamplingParams(max_new_tokens=it.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, seed=i, ignore_eos=True)
                  for i, it in enumerate(items)]
        run = lambda cfg: _model_run(cfg, model, prompts, params)  # noqa: E731
    ref, _ = run(base.replace(**{"speculative.method": "none"}))
    result: dict[str, Any] = {"config": args.config, "sets": args.sets, "variants": {}}
    for v in args.variants.split(","):
        k, t = (int(x) for x in v.split("x"))
        cfg = base.replace(**{"speculative.num_draft_tokens": k, "speculative.topk": t})
        t0 = time.perf_counter()
        outs, m = run(cfg)
        row = {"width": t * (k + 1), **{key: m[key] for key in KEYS},
               **_compare(outs, ref), "seconds": round(time.perf_counter() - t0, 2)}
        result["variants"][v] = row
        print(f"{v:>6}  width {row['width']:3d}  tokens/verify {row['spec_tokens_per_verify']:.2f}"
              f"  verified/verify {row['spec_verify_width']:.2f}  accept "
              f"{row['spec_accept_rate']:.3f}  verifies {row['spec_verify_steps']}  rows "
              f"{row['spec_verify_rows']}  steps {row['num_steps']}  same "
              f"{row['same_tokens']} (logprob diff {row['max_logprob_diff']:.1e})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
