"""The engine (warm) vs transformers' batched greedy ``generate`` on one tiny Qwen3-Next checkpoint.

    python scripts/compare_transformers.py [--out r.json] [--config configs/bench/gsp_sglang.toml]

Issue 29's workload: 4 groups x 8 requests, 400-token shared system prompts, 24-token questions,
16 output tokens, on ``tests/fixtures/qwen3_next`` (its context raised to 1024 in a copy of the
config; RoPE does not depend on it). The engine runs ``Engine.warmup`` (bounded by the longest
request) and one warm-up pass (seed 0), then timed passes with new random tokens (seeds 1, 2),
each with its XLA compiles counted from JAX's events (must be 0). transformers generates the
seed-1 prompts in one batch (all 424 tokens long: no padding), once to warm up and once timed;
the greedy tokens of both are compared. Needs torch and transformers (optional: exits 0 with a
message when they are absent).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3_next"
SEEDS = (1, 2)  # timed passes; seed 0 is the warm-up pass


def checkpoint(tmp: Path) -> Path:
    """The fixture with ``max_position_embeddings`` 1024 (the workload needs 440 tokens)."""
    out = tmp / "qwen3_next_1k"
    shutil.copytree(FIXTURE, out, ignore=shutil.ignore_patterns("expected.npz"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def run_engine(path: Path, config: str) -> tuple[dict, dict[int, list[list[int]]]]:
    from mambacache.bench.cli import load_setup
    from mambacache.bench.runner import BenchSection, run_pass
    from mambacache.bench.workloads import GeneratedSharedPrefix, max_seq_len
    from mambacache.engine.engine import Engine, load_model

    setup = load_setup(config, {"model.path": str(path), "cache.enable": True})
    work = GeneratedSharedPrefix(num_groups=4, prompts_per_group=8, system_prompt_len=400,
                                 question_len=24, output_len=16)
    bench = BenchSection(concurrency=0, progress=False)
    model = load_model(setup.engine)
    vocab = model[0].vocab_size
    engine = Engine(setup.engine, model=model)
    warm = engine.warmup(max_seq_len(work.source(vocab, 0)))
    out = {"warmup": warm, "passes": []}
    tokens: dict[int, list[list[int]]] = {}
    for seed in (0, *SEEDS):
        engine = Engine(setup.engine, model=model)
        engine.warmup(warm["max_seq_len"])  # the same bounds; compiles nothing now
        source = work.source(vocab, seed)
        recorder = _Recorder(source)
        stats = run_pass(engine, recorder, bench)
        out["passes"].append({"seed": seed, "duration_s": stats["duration_s"],
                              "compiles": stats["pass_compiles"],
                              "compile_s": stats["pass_compile_s"],
                              "hit_rate": stats["hit_rate"]})
        tokens[seed] = recorder.outputs()
        print(f"engine pass seed {seed}: {stats['duration_s']:.2f} s, "
              f"{stats['pass_compiles']} compiles", flush=True)
    return out, tokens


class _Recorder:
    """Wraps a static source; keeps each prompt's output tokens (by prompt)."""

    def __init__(self, source):
        self.source, self.total = source, source.total
        self.items = source.start()
        self.out: dict[tuple, list[int]] = {}

    def start(self):
        return list(self.items)

    def follow_up(self, item, output_ids):
        self.out[tuple(item.prompt)] = list(output_ids)
        return None

    def outputs(self) -> list[list[int]]:
        return [self.out[tuple(it.prompt)] for it in self.items]

    def prompts(self) -> list[list[int]]:
        return [it.prompt for it in self.items]


def run_transformers(path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - t
    return seconds, out[:, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "bench" / "gsp_sglang.toml"))
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"skipped: {err} (pip install torch transformers)")
        return {}
    from mambacache.bench.workloads import GeneratedSharedPrefix

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp))
        ours, tokens = run_engine(path, args.config)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        work = GeneratedSharedPrefix(num_groups=4, prompts_per_group=8, system_prompt_len=400,
                                     question_len=24, output_len=16)
        prompts = [it.prompt for it in work.source(vocab, SEEDS[0]).start()]
        hf_s, hf_tokens = run_transformers(path, prompts, 16)
    same = sum(a == b for a, b in zip(tokens[SEEDS[0]], hf_tokens, strict=True))
    timed = ours["passes"][1]
    result = {**ours, "transformers_s": hf_s, "same_outputs": same, "requests": len(prompts),
              "speedup": hf_s / timed["duration_s"]}
    print(f"engine seed {SEEDS[0]}: {timed['duration_s']:.2f} s ({timed['compiles']} compiles); "
          f"transformers batched generate: {hf_s:.2f} s; {result['speedup']:.2f}x; "
          f"identical outputs {same}/{len(prompts)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
