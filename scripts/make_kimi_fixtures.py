"""Make a tiny random Kimi Linear checkpoint and transformers' expected logits for parity tests.

    python scripts/make_kimi_fixtures.py [--out tests/fixtures]

Writes ``<out>/kimi_linear/config.json``, ``model.safetensors`` and ``expected.npz`` with the
same records as ``scripts/make_parity_fixtures.py`` (one-piece prefill, split prefill, 16 greedy
steps, a bf16 prefill) for prompts of lengths 4 / 9 / 15. The model
(``KimiLinearForCausalLM``): 4 layers, KDA / KDA / MLA / KDA, the first MLP dense and the others
a DeepSeek-style MoE (sigmoid scores + correction bias, 4 groups of 2 experts with top-2 groups,
top-2 experts, routed scaling 2.446, one shared expert). MLA dims differ from each other
(nope 16, rope 8, v 12, latent 24) so a swapped slice shows. Every norm weight (all plain
``w * x / rms(x)`` here), ``A_log``, ``dt_bias`` and the router's ``e_score_correction_bias``
(a buffer, not a parameter) is randomised.

Needs torch and transformers (never a runtime or CI dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_parity_fixtures import prompts, record  # noqa: E402

NAME = "kimi_linear"

CONFIG = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=4, intermediate_size=48,
    num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=24, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.446, norm_topk_prob=True,
    rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Linear ~ N(0, 1/fan_in); norms, A_log, dt_bias, correction bias away from their init."""
    with torch.no_grad():
        for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
            if pname.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif pname.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) - 1.0)
            elif pname.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in pname and p.ndim == 1:  # every Kimi norm is plain: w * x / rms(x)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "conv1d" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif p.is_floating_point() and p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def build_model(seed: int) -> torch.nn.Module:
    """A randomised fp32 ``KimiLinearForCausalLM`` (eager attention)."""
    import transformers as tf
    cfg = tf.KimiLinearConfig(**CONFIG)
    torch.manual_seed(seed)
    model = tf.KimiLinearForCausalLM._from_config(cfg, attn_implementation="eager",
                                                   torch_dtype=torch.float32)
    _randomise(model, torch.Generator().manual_seed(seed))
    return model.eval()


def make(out: Path, seed: int) -> None:
    model = build_model(seed)
    target = out / NAME
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    expected = record(model, prompts(seed, model.config.vocab_size))
    np.savez_compressed(target / "expected.npz", **expected)
    sizes = {p.name: p.stat().st_size for p in target.iterdir()}
    print(NAME, json.dumps(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures")
    parser.add_argument("--seed", type=int, default=10)
    args = parser.parse_args()
    make(Path(args.out), args.seed)


if __name__ == "__main__":
    main()
