"""Make tiny random Hugging Face checkpoints and transformers' expected logits for parity tests.

    python scripts/make_parity_fixtures.py [--out tests/fixtures]

For each family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) writes ``<out>/<name>/config.json``,
``model.safetensors`` and ``expected.npz`` with, for a few prompts of different lengths:
  (a) ``prefill_logits``  ``[sum(len), V]``: each prompt alone, one forward, every position;
  (b) ``split_logits``    ``[sum(len), V]``: the same prompts prefilled in two pieces
      (``split_points``) with transformers' cache in between;
  (c) ``greedy_tokens`` ``[P, N]`` and ``greedy_logits`` ``[P, N, V]``: greedy decoding of N
      tokens after the prompt (logits row j is the distribution token j was taken from);
  and ``prefill_logits_bf16``: (a) with the model cast to bfloat16 (to size bf16 tolerances).
Every norm weight, ``A_log`` and ``dt_bias`` is randomised (a wrong ``(1 + w)`` must show).

Needs torch and transformers (never a runtime or CI dependency). The live parity test imports
``build_model`` and ``record`` from here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

NAMES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
PROMPT_LENS = (4, 9, 15)
SPLIT_POINTS = (2, 5, 8)
NUM_DECODE = 16

_COMMON = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)


def hf_model_class(name: str):
    import transformers as tf
    if name == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**_COMMON, **_MOE, intermediate_size=48, mlp_only_layers=[2],
                                 decoder_sparse_step=1, norm_topk_prob=True)
        return tf.Qwen3NextForCausalLM, cfg
    if name == "qwen3_5":
        return tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**_COMMON, intermediate_size=48)
    if name == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**_COMMON, **_MOE)
    raise ValueError(f"unknown fixture family {name!r}; known: {NAMES}")


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter: linear ~ N(0, 1/fan_in), norms/A_log/dt_bias away from init."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            leaf = pname.rsplit(".", 2)
            if pname.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif pname.endswith("dt_bias"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("linear_attn.norm.weight"):  # gated norm: plain weight
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in leaf[-2] and p.ndim == 1:  # zero-centred (1 + w) norms
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "conv1d" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)


def build_model(name: str, seed: int) -> torch.nn.Module:
    """A randomised fp32 transformers model of family ``name`` (eager attention)."""
    cls, cfg = hf_model_class(name)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    _randomise(model, torch.Generator().manual_seed(seed))
    return model.eval()


def prompts(seed: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, n).tolist() for n in PROMPT_LENS]


def _logits(model, ids: list[int], cache=None):
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=cache is not None)
    return out.logits[0].float().numpy(), out


def _new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


@torch.no_grad()
def record(model, seqs: list[list[int]], num_decode: int = NUM_DECODE) -> dict[str, np.ndarray]:
    """Expected logits (a), (b), (c) for ``seqs`` (see the module docstring)."""
    full = [_logits(model, s)[0] for s in seqs]
    split = []
    for s, cut in zip(seqs, SPLIT_POINTS, strict=True):
        cache = _new_cache(model)
        first, _ = _logits(model, s[:cut], cache)
        second, _ = _logits(model, s[cut:], cache)
        split.append(np.concatenate([first, second]))
    tokens, greedy = [], []
    for s in seqs:
        cache = _new_cache(model)
        last, _ = _logits(model, s, cache)
        toks, rows = [], []
        for _ in range(num_decode):
            row = last[-1]
            toks.append(int(np.argmax(row)))
            rows.append(row)
            last, _ = _logits(model, [toks[-1]], cache)
        tokens.append(toks)
        greedy.append(np.stack(rows))
    bf16 = model.to(torch.bfloat16)
    full_bf16 = [_logits(bf16, s)[0] for s in seqs]
    model.to(torch.float32)
    return {
        "prompt_ids": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "prompt_lens": np.asarray([len(s) for s in seqs], np.int32),
        "split_points": np.asarray(SPLIT_POINTS[:len(seqs)], np.int32),
        "prefill_logits": np.concatenate(full).astype(np.float32),
        "split_logits": np.concatenate(split).astype(np.float32),
        "greedy_tokens": np.asarray(tokens, np.int32),
        "greedy_logits": np.stack(greedy).astype(np.float32),
        "prefill_logits_bf16": np.concatenate(full_bf16).astype(np.float32),
    }


def make(name: str, out: Path, seed: int) -> None:
    model = build_model(name, seed)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for extra in ("generation_config.json",):
        (target / extra).unlink(missing_ok=True)
    expected = record(model, prompts(seed, model.config.vocab_size))
    np.savez_compressed(target / "expected.npz", **expected)
    sizes = {p.name: p.stat().st_size for p in target.iterdir()}
    print(name, json.dumps(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for i, name in enumerate(NAMES):
        make(name, Path(args.out), args.seed + i)


if __name__ == "__main__":
    main()
