"""``python -m mambacache.bench.agreement``: cache on against cache off, as SGLang measures it.

fp32 promises cache on = off within 1e-4; bf16 (the serving dtype) cannot be bit-equal (a state
snapshot is stored in the pool's dtype, a chunk boundary moves where sums are rounded), so it is
measured over a fixed prompt set, two ways:

* **next-token distributions** (the model's own forward): each prompt computed in one extend from
  scratch ("off") and as the cache serves it ("on": its first ``prefix`` tokens in one extend that
  writes the state and KV pages, the rest read back from them). Over every position after the
  prefix: the KL divergence ``KL(off || on)`` of the next-token distributions (mean and max), the
  fraction of positions whose argmax agrees, and the largest |logprob| difference.
* **greedy decoding through the engine**: the same prompts (in groups sharing a prefix, so later
  ones hit) generated with ``cache.enable`` on and off; the fraction of requests whose tokens are
  all equal, the fraction of generated tokens before the first divergence, and the largest
  |logprob| difference over the positions before it.

Prints one JSON object (``--out`` writes it too). ``--set section.key=value`` as every command.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.config import EngineConfig, parse_set_args
from mambacache.engine.engine import Engine
from mambacache.engine.runners.loading import load_model, model_dtype
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.sampling.params import SamplingParams
from mambacache.engine.step.batch import SeqSpec, build_forward_batch
from models import forward


def prompt_set(vocab_size: int, *, groups: int, per_group: int, prefix_len: int,
               suffix_len: int, seed: int) -> list[list[int]]:
    """``groups * per_group`` prompts: each group shares a ``prefix_len``-token prefix, each
    prompt then has ``suffix_len`` tokens of its own (ids in [3, vocab_size), seeded)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        prefix = rng.integers(3, vocab_size, prefix_len).tolist()
        prompts += [prefix + rng.integers(3, vocab_size, suffix_len).tolist()
                    for _ in range(per_group)]
    return prompts


@functools.cache
def _forward_fn(model_cfg: Any, kernels: str):
    return jax.jit(functools.partial(forward, cfg=model_cfg, kernels=kernels, decode=False))


def _extend(params, model_cfg, kernels, pools, spec: SeqSpec, page_size: int):
    num_pages = -(-(spec.prefix_len + len(spec.tokens)) // page_size)
    batch = build_forward_batch([spec], page_size, num_pages_per_seq=num_pages)
    return _forward_fn(model_cfg, kernels)(params, pools, batch)


def next_token_logprobs(params, model_cfg, kernels: str, prompt: Sequence[int], prefix: int,
                        page_size: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities ``[len(prompt) - prefix, V]`` float32 of the tokens after positions
    ``prefix..``: from scratch (off) and from the prefix's cached state and pages (on)."""
    pages = list(range(1, -(-len(prompt) // page_size) + 1))
    fresh = functools.partial(PoolState.create, model_cfg, num_pages=len(pages) + 1,
                              page_size=page_size, num_slots=3, dtype=dtype)
    _, off = _extend(params, model_cfg, kernels, fresh(),
                     SeqSpec(prompt, 0, pages, 0, 1, logits="all"), page_size)
    pools, _ = _extend(params, model_cfg, kernels, fresh(),
                       SeqSpec(prompt[:prefix], 0, pages, 0, 1, logits="none"), page_size)
    _, on = _extend(params, model_cfg, kernels, pools,
                    SeqSpec(prompt[prefix:], prefix, pages, 1, 2, logits="all"), page_size)
    as_logprobs = lambda x: np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), -1))
    return as_logprobs(off)[prefix:], as_logprobs(on)


def distribution_agreement(cfg: EngineConfig, model: tuple[Any, Any],
                           prompts: list[list[int]], prefix: int) -> dict[str, float]:
    """KL(off || on), argmax agreement and max |logprob| difference over every position after
    ``prefix`` of every prompt (see the module docstring); ``model``: ``load_model(cfg)``."""
    model_cfg, params = model
    kl, agree, diff = [], [], 0.0
    for prompt in prompts:
        off, on = next_token_logprobs(params, model_cfg, cfg.model.kernels, prompt, prefix,
                                      cfg.cache.page_size, model_dtype(cfg))
        kl.append(np.sum(np.exp(off) * (off - on), axis=-1))
        agree.append(off.argmax(-1) == on.argmax(-1))
        diff = max(diff, float(np.abs(off - on).max()))
    kl_all, agree_all = np.concatenate(kl), np.concatenate(agree)
    return {"positions": int(kl_all.size), "kl_mean": float(kl_all.mean()),
            "kl_max": float(kl_all.max()), "argmax_agreement": float(agree_all.mean()),
            "max_abs_logprob_diff": diff}


def greedy_agreement(cfg: EngineConfig, model: tuple[Any, Any], prompts: list[list[int]],
                     max_new_tokens: int) -> dict[str, float]:
    """Greedy generation with the cache on and off, the prompts one at a time in order (so a
    group's later prompts hit its first one's prefix); see the module docstring. ``model``:
    ``load_model(cfg)``, shared by both engines."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    outs = {}
    for enable in (True, False):
        engine = Engine(cfg.replace(**{"cache.enable": enable}), model=model)
        outs[enable] = [engine.generate([p], params)[0] for p in prompts]
    equal, kept, diff = 0, 0, 0.0
    for on, off in zip(outs[True], outs[False], strict=True):
        a, b = on.output_token_ids, off.output_token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        equal += same == len(a)
        kept += same
        if same:
            diff = max(diff, float(np.abs(np.subtract(on.output_logprobs[:same],
                                                      off.output_logprobs[:same])).max()))
    return {"requests": len(prompts), "cached_tokens": sum(o.cached_tokens for o in outs[True]),
            "all_tokens_equal": equal / len(prompts),
            "tokens_before_divergence": kept / (len(prompts) * max_new_tokens),
            "max_abs_logprob_diff_before_divergence": diff}


def run(cfg: EngineConfig, *, groups: int = 4, per_group: int = 3, prefix_len: int = 48,
        suffix_len: int = 21, max_new_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """Both measurements for ``cfg`` (its dtype, kernels and page size); the split point for the
    distributions is the prompts' shared prefix, rounded down to a page."""
    model = load_model(cfg)
    prompts = prompt_set(model[0].vocab_size, groups=groups, per_group=per_group,
                         prefix_len=prefix_len, suffix_len=suffix_len, seed=seed)
    split = prefix_len // cfg.cache.page_size * cfg.cache.page_size
    return {"preset": cfg.model.preset, "dtype": cfg.model.dtype, "kernels": cfg.model.kernels,
            "backend": jax.default_backend(), "page_size": cfg.cache.page_size,
            "distributions": distribution_agreement(cfg, model, prompts, split),
            "greedy": greedy_agreement(cfg, model, prompts, max_new_tokens)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="engine TOML (default: the tiny default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = EngineConfig.load(args.config, overrides=parse_set_args(args.set))
    result = run(cfg, max_new_tokens=args.max_new_tokens)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
