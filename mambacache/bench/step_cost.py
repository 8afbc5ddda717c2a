"""The byte and FLOP model of one model step, against which ``bench/step.py`` times the step.

What a step must move at the least, from the model's config alone (``models.params
.param_shapes``): every dense weight read once (the embedding only at the step's T rows, the LM
head whole), for a MoE layer only the experts the step touches (expected under uniform routing:
``E (1 - (1 - k / E)^T)`` of ``E``), the KV every query attends to read once and this step's rows
written, each row's recurrent state (SSM + conv window) read and written once. FLOPs are the
active ones: ``2 * T * (dense matrix params + k / E of the expert params)`` plus the LM head at
the logit rows, attention's two products over every (query, key) pair it computes (causal:
``L (L + 1) / 2`` per sequence of L), and the recurrences ``4 Hv Dk Dv`` per token and layer
(decay, ``k^T S``, the rank-one update, ``q^T S``). A step's floor is ``max(bytes / HBM
bandwidth, FLOPs / peak)``; the benchmark reports measured time against it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from models.config import ModelConfig
from models.params import param_shapes

EXPERT_WEIGHTS = ("gate_up", "up", "down")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Bytes moved by kind and FLOPs of one step (or one layer)."""

    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    state_bytes: float = 0.0
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.state_bytes

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self),
                                            dataclasses.astuple(other), strict=True)))

    def floor_s(self, bandwidth: float | None, peak: float | None) -> float | None:
        """The roofline time ``max(bytes / bandwidth, flops / peak)``, None if unknown."""
        if not bandwidth:
            return None
        return max(self.bytes / bandwidth, self.flops / peak if peak else 0.0)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "bytes": self.bytes}


def touched_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts of ``num_tokens`` tokens each routed to ``top_k`` of
    ``num_experts`` uniformly: ``E (1 - (1 - k / E)^T)``."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def param_leaves(cfg: ModelConfig):
    """``(path names, shape)`` of every parameter leaf."""
    flat = jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and all(
            isinstance(d, int) for d in x))[0]
    for path, shape in flat:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        yield names, tuple(shape)


def _is_expert(names: list[str], shape: tuple, cfg: ModelConfig) -> bool:
    return ("moe" in names and names[-1] in EXPERT_WEIGHTS and len(shape) == 3
            and shape[0] == cfg.num_experts)


def weights_cost(cfg: ModelConfig, num_tokens: int, num_logits: int, itemsize: int) -> Cost:
    """Weights read and their active FLOPs for a step of ``num_tokens`` tokens and
    ``num_logits`` logit rows (module docstring)."""
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    touched = touched_experts(num_tokens, e, k)
    nbytes = flops = 0.0
    for names, shape in param_leaves(cfg):
        size = math.prod(shape)
        if names[-1] == "embed":
            nbytes += num_tokens * h * itemsize
            if cfg.tie_word_embeddings:   # the LM head is the embedding, read whole
                nbytes += size * itemsize
                flops += 2.0 * num_logits * size
        elif names[-1] == "lm_head":
            nbytes += size * itemsize
            flops += 2.0 * num_logits * size
        elif _is_expert(names, shape, cfg):
            nbytes += size / e * touched * itemsize
            flops += 2.0 * num_tokens * size * k / e
        else:
            nbytes += size * itemsize
            flops += 2.0 * num_tokens * size if len(shape) >= 2 else 0.0
    return Cost(weight_bytes=nbytes, flops=flops)


def moe_layer_cost(cfg: ModelConfig, layer_shapes: dict[str, Any], num_tokens: int,
                   itemsize: int) -> Cost:
    """One MoE feed-forward alone (router, touched experts, shared expert; x in, y out)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = touched_experts(num_tokens, e, k)
    nbytes, flops = 2.0 * num_tokens * cfg.hidden_size * itemsize, 0.0
    for name, shape in layer_shapes.items():
        size = math.prod(shape)
        expert = name in EXPERT_WEIGHTS and len(shape) == 3 and shape[0] == e
        nbytes += size * (touched / e if expert else 1.0) * itemsize
        share = k / e if expert else 1.0
        flops += 2.0 * num_tokens * size * share if len(shape) >= 2 else 0.0
    return Cost(weight_bytes=nbytes, flops=flops)


def _attn_flops_per_pair(cfg: ModelConfig) -> float:
    """FLOPs of one (query, key) pair over all heads of one layer: both products."""
    hq = cfg.num_attention_heads
    if cfg.kv_arrays_per_layer == 1:   # MLA, absorbed: scores over R + dr, values over R
        return 2.0 * hq * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2.0 * hq * 2 * cfg.head_dim


def _row_bytes(cfg: ModelConfig, itemsize: int) -> float:
    """KV bytes of one token in one full-attention layer."""
    return math.prod(cfg.kv_row_shape) * cfg.kv_arrays_per_layer * itemsize


def _state_bytes(cfg: ModelConfig, itemsize: int) -> float:
    """One row's recurrent state in one linear layer: the f32 SSM state and the conv window."""
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return ssm + (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * itemsize


def _mixers_cost(cfg: ModelConfig, lens: list[int], prefix: int, itemsize: int) -> Cost:
    """Attention and recurrences of sequences that extend ``lens`` tokens after ``prefix``."""
    full, linear = cfg.num_full_layers, cfg.num_linear_layers
    tokens = sum(lens)
    keys = sum(prefix + n for n in lens)                    # each key read once per sequence
    pairs = sum(n * prefix + n * (n + 1) / 2 for n in lens)  # causal (query, key) pairs
    rec = 4.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return Cost(kv_bytes=full * (keys + tokens) * _row_bytes(cfg, itemsize),
                state_bytes=linear * 2 * len(lens) * _state_bytes(cfg, itemsize),
                flops=full * pairs * _attn_flops_per_pair(cfg) + linear * tokens * rec)


def decode_cost(cfg: ModelConfig, rows: int, context: int, itemsize: int) -> Cost:
    """A decode step of ``rows`` rows, each at ``context`` cached tokens."""
    return weights_cost(cfg, rows, rows, itemsize) + _mixers_cost(cfg, [1] * rows, context,
                                                                  itemsize)


def prefill_cost(cfg: ModelConfig, lens: list[int], itemsize: int) -> Cost:
    """A prefill step of sequences of ``lens`` tokens from scratch (logits at each last)."""
    return weights_cost(cfg, sum(lens), len(lens), itemsize) + _mixers_cost(cfg, lens, 0,
                                                                            itemsize)


def fraction(floor_s: float | None, measured_s: float) -> float | None:
    """The roofline fraction ``floor / measured`` (None without a floor)."""
    return None if floor_s is None else float(np.float64(floor_s) / measured_s)
