"""Tiny random Mamba2-hybrid checkpoints (Nemotron-H, Granite 4.0-H) + transformers' logits.

    /work/venv-parity/bin/python scripts/make_mamba2_fixtures.py [--out tests/fixtures]

Writes ``<out>/<name>/config.json``, ``model.safetensors`` and ``expected.npz`` for
``nemotron_h`` (``NemotronHForCausalLM``: Mamba2, attention without RoPE, squared-ReLU MLP,
sigmoid-routed grouped MoE with a shared expert) and ``granitemoehybrid``
(``GraniteMoeHybridForCausalLM``: Mamba2 + RoPE attention, softmax top-k MoE + shared SwiGLU,
embedding / residual / attention / logits multipliers, tied embeddings). The arrays are those of
``make_parity_fixtures.record`` (prefill, split prefill, 16 greedy steps, bf16 prefill) with one
difference: the greedy logits are computed by re-running the whole sequence each step.

Why re-run: transformers clamps ``dt`` to ``time_step_limit`` in its chunked (prefill) scan but
not in its one-token recurrent update, so its own cached decode is a different function from its
prefill whenever the clamp bites. The fixtures make the clamp bite (``dt_bias`` around
``softplus^-1`` of the lower limit, a finite upper limit for Granite), so that a missing clamp
shows; our model applies it in every path, and prefill-only greedy is the function it must equal.

Every parameter is randomised: norms (plain ``w * x`` weights here), the gated norm, ``A_log``,
``dt_bias``, ``D``, conv weights and bias, the router's ``e_score_correction_bias``.
Needs torch and transformers (never a runtime or CI dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_parity_fixtures import NUM_DECODE, prompts  # noqa: E402
from make_parity_fixtures import record as record_cached  # noqa: E402

NAMES = ("nemotron_h", "granitemoehybrid")

_MAMBA_NEMOTRON = dict(mamba_num_heads=8, mamba_head_dim=4, ssm_state_size=8, n_groups=2,
                       conv_kernel=4, chunk_size=4, use_conv_bias=True, time_step_min=0.02)
_MAMBA_GRANITE = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
                      mamba_d_conv=4, mamba_chunk_size=4, mamba_conv_bias=True,
                      mamba_expand=2, time_step_limit=(0.02, 0.6))


def hf_model_class(name: str):
    import transformers as tf
    if name == "nemotron_h":
        cfg = tf.NemotronHConfig(
            vocab_size=256, hidden_size=32, tie_word_embeddings=False,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                               "linear_attention", "moe"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            mlp_hidden_act="relu2", n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
            topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
            layer_norm_epsilon=1e-5, max_position_embeddings=256, **_MAMBA_NEMOTRON)
        return tf.NemotronHForCausalLM, cfg
    if name == "granitemoehybrid":
        cfg = tf.GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=4, tie_word_embeddings=True,
            layer_types=["linear_attention", "linear_attention", "full_attention",
                         "linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
            shared_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
            position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            embedding_multiplier=0.3, logits_scaling=2.5, residual_multiplier=1.0,
            attention_multiplier=0.2, rms_norm_eps=1e-6, max_position_embeddings=256,
            **_MAMBA_GRANITE)
        return tf.GraniteMoeHybridForCausalLM, cfg
    raise ValueError(f"unknown fixture family {name!r}; known: {NAMES}")


def _randomise(model: torch.nn.Module, gen: torch.Generator, dt_center: float) -> None:
    """Overwrite every parameter and the router bias buffer (see the module docstring)."""
    def randn(shape):
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        named = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for pname, p in named:
            if pname.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif pname.endswith("dt_bias"):
                p.copy_(dt_center + 0.7 * randn(p.shape))
            elif pname.endswith(".D"):
                p.copy_(1.0 + 0.5 * randn(p.shape))
            elif "norm" in pname and p.ndim == 1:  # every norm here multiplies by a plain w
                p.copy_(1.0 + 0.2 * randn(p.shape))
            elif pname.endswith("e_score_correction_bias"):
                p.copy_(0.1 * randn(p.shape))
            elif "embed" in pname:
                p.copy_(randn(p.shape))
            elif "conv1d" in pname:
                p.copy_(0.3 * randn(p.shape))
            else:
                p.copy_(randn(p.shape) / p.shape[-1] ** 0.5)


def build_model(name: str, seed: int) -> torch.nn.Module:
    """A randomised fp32 transformers model of family ``name`` (eager attention)."""
    cls, cfg = hf_model_class(name)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    lo = cfg.time_step_min if name == "nemotron_h" else cfg.time_step_limit[0]
    # dt = softplus(raw + dt_bias) with dt_bias ~ softplus^-1(2 * lo): the lower clamp bites often
    _randomise(model, torch.Generator().manual_seed(seed), float(np.log(np.expm1(2 * lo))) + 1.0)
    return model.eval()


@torch.no_grad()
def greedy_recomputed(model, seqs: list[list[int]], num_decode: int = NUM_DECODE):
    """Greedy tokens ``[P, N]`` and logits ``[P, N, V]``, each step one uncached forward."""
    tokens, rows = [], []
    for s in seqs:
        ids, toks, per = list(s), [], []
        for _ in range(num_decode):
            row = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            per.append(row.numpy())
            toks.append(int(torch.argmax(row)))
            ids.append(toks[-1])
        tokens.append(toks)
        rows.append(np.stack(per))
    return np.asarray(tokens, np.int32), np.stack(rows).astype(np.float32)


@torch.no_grad()
def clamp_rate(model, seqs) -> float:
    """Fraction of (token, head) dt values the clamp changes in the first Mamba layer."""
    layer = next(m for m in model.modules() if hasattr(m, "dt_bias"))
    lo, hi = layer.time_step_limit
    seen = []
    hook = layer.in_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    model(input_ids=torch.tensor([seqs[-1]]), use_cache=False)
    hook.remove()
    dt = torch.nn.functional.softplus(seen[0][..., -layer.num_heads:] + layer.dt_bias)
    return float(((dt < lo) | (dt > hi)).float().mean())


def make(name: str, out: Path, seed: int) -> None:
    model = build_model(name, seed)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    seqs = prompts(seed, model.config.vocab_size)
    tokens, logits = greedy_recomputed(model, seqs)  # before record's bf16 round trip
    expected = record_cached(model, seqs, num_decode=1)  # prefill, split, bf16 prefill
    expected["greedy_tokens"], expected["greedy_logits"] = tokens, logits
    np.savez_compressed(target / "expected.npz", **expected)
    sizes = {p.name: p.stat().st_size for p in target.iterdir()}
    rate = clamp_rate(model, seqs)
    print(name, json.dumps(sizes), f"dt clamp rate (first Mamba layer) {rate:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tests/fixtures")
    parser.add_argument("--seed", type=int, default=10)
    args = parser.parse_args()
    for i, name in enumerate(NAMES):
        make(name, Path(args.out), args.seed + i)


if __name__ == "__main__":
    main()
