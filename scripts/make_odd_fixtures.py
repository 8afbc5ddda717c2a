"""Tiny random checkpoints with odd, unequal dimensions in every family + transformers' logits.

    python scripts/make_odd_fixtures.py [--out tests/fixtures/odd]

Writes ``<out>/<family>/config.json``, ``model.safetensors`` (saved by the installed
transformers, so the checkpoint has today's names and ``config.json`` quirks) and
``expected.npz`` with the arrays of ``make_parity_fixtures.record`` (prefill, split prefill via
transformers' cache, greedy, bf16 prefill). Every size that could be confused with another
differs from it and most are odd or not a power of two: head dims 6 / 10 / 12 / 14 / 24, value
vs key head counts in ratio 3, hidden 36 / 40, 5 or 6 experts, Kimi's MLA with
``qk_nope_head_dim`` 12, ``qk_rope_head_dim`` 8, ``v_head_dim`` 14 (rope not a quarter of the
head), a latent of 20. A swapped slice, a wrong reshape or a rule borrowed from another family
shows here where the square fixtures of the other scripts would hide it.

Every norm, ``A_log``, ``dt_bias``, ``D`` and router correction bias is randomised (each
family's own randomiser from its fixture script). Needs torch and transformers (never a runtime
or CI dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_kimi_fixtures as kimi  # noqa: E402
import make_mamba2_fixtures as mamba2  # noqa: E402
import make_parity_fixtures as qwen  # noqa: E402

NAMES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "granitemoehybrid",
         "kimi_linear")
_QWEN = dict(
    vocab_size=250, hidden_size=40, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=3,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
_QWEN_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                 shared_expert_intermediate_size=20)


def hf_config(name: str):
    """(model class, config) of the odd model of family ``name``."""
    import transformers as tf
    if name == "qwen3_next":
        return tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **_QWEN, **_QWEN_MOE, intermediate_size=44, mlp_only_layers=[3], norm_topk_prob=False)
    if name == "qwen3_5":
        return tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**_QWEN, intermediate_size=44)
    if name == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**_QWEN, **_QWEN_MOE)
    if name == "nemotron_h":
        return tf.NemotronHForCausalLM, tf.NemotronHConfig(
            vocab_size=250, hidden_size=40, tie_word_embeddings=False,
            layers_block_type=["linear_attention", "full_attention", "moe", "mlp",
                               "linear_attention", "moe"],
            num_attention_heads=6, num_key_value_heads=2, head_dim=10, intermediate_size=52,
            mlp_hidden_act="relu2", n_routed_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=14, moe_shared_expert_intermediate_size=18, n_group=3,
            topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True,
            layer_norm_epsilon=1e-5, max_position_embeddings=256, mamba_num_heads=6,
            mamba_head_dim=6, ssm_state_size=10, n_groups=3, conv_kernel=3, chunk_size=4,
            use_conv_bias=True, time_step_min=0.02)
    if name == "granitemoehybrid":
        return tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(
            vocab_size=250, hidden_size=40, num_hidden_layers=4, tie_word_embeddings=True,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_attention_heads=5, num_key_value_heads=1, intermediate_size=14,
            shared_intermediate_size=22, num_local_experts=6, num_experts_per_tok=2,
            position_embedding_type="nope", embedding_multiplier=0.3, logits_scaling=2.5,
            residual_multiplier=0.7, attention_multiplier=0.2, rms_norm_eps=1e-6,
            max_position_embeddings=256, mamba_n_heads=10, mamba_d_head="auto",
            mamba_d_state=12, mamba_n_groups=2, mamba_d_conv=3, mamba_chunk_size=4,
            mamba_conv_bias=True, mamba_expand=2)
    if name == "kimi_linear":
        return tf.KimiLinearForCausalLM, tf.KimiLinearConfig(**{
            **kimi.CONFIG, "vocab_size": 250, "hidden_size": 36, "intermediate_size": 44,
            "num_attention_heads": 3, "num_key_value_heads": 3, "kv_lora_rank": 20,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 14,
            "linear_num_heads": 3, "linear_head_dim": 10, "linear_conv_kernel_dim": 3,
            "num_local_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 14,
            "n_group": 3, "topk_group": 2})
    raise ValueError(f"unknown family {name!r}; known: {NAMES}")


def build_model(name: str, seed: int) -> torch.nn.Module:
    """The randomised fp32 odd model of family ``name`` (eager attention)."""
    cls, cfg = hf_config(name)
    torch.manual_seed(seed)
    # eager experts: the grouped-mm path needs 16-byte strides, which odd bf16 widths lack
    model = cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager",
                             torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    if name in ("nemotron_h", "granitemoehybrid"):
        lo = cfg.time_step_min if name == "nemotron_h" else 0.001
        mamba2._randomise(model, gen, float(np.log(np.expm1(2 * lo))) + 1.0)
    elif name == "kimi_linear":
        kimi._randomise(model, gen)
    else:
        qwen._randomise(model, gen)
    return model.eval()


def make(name: str, out: Path, seed: int) -> None:
    model = build_model(name, seed)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    seqs = qwen.prompts(seed, model.config.vocab_size)
    if name in ("nemotron_h", "granitemoehybrid"):  # transformers' cached decode skips the clamp
        tokens, logits = mamba2.greedy_recomputed(model, seqs, num_decode=4)
        expected = qwen.record(model, seqs, num_decode=1)
        expected["greedy_tokens"], expected["greedy_logits"] = tokens, logits
    else:
        expected = qwen.record(model, seqs, num_decode=4)
    np.savez_compressed(target / "expected.npz", **expected)
    sizes = {p.name: p.stat().st_size for p in target.iterdir()}
    print(name, json.dumps(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures/odd")
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    for i, name in enumerate(NAMES):
        make(name, Path(args.out), args.seed + i)


if __name__ == "__main__":
    main()
