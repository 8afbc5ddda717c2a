"""Regrouping of Hugging Face (torch) tensors into this package's layout, shared by the
families' loaders (``models/families/``).

torch ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, out]``. Projections whose columns
belong to head groups are regrouped group-major (``models/params.py``'s invariant: every group a
contiguous column block, so a tensor-parallel split gives each device whole groups). Experts are
stacked ``[E, in, out]`` from per-expert tensors or from transformers' fused in-memory layout.
Every read goes through ``TensorSource.get``, which names a missing or mis-shaped tensor.
"""

from __future__ import annotations

import numpy as np

from models.safetensors_io import TensorSource


def cat_t(*parts: np.ndarray) -> np.ndarray:
    """torch ``[out, in]`` pieces -> one ``[in, sum(out)]`` matrix."""
    return np.concatenate([np.asarray(p) for p in parts], axis=0).T


def grouped_t(groups: int, *parts: np.ndarray) -> np.ndarray:
    """torch ``[out, in]`` pieces, each ``groups`` contiguous row blocks -> ``[in, sum(out)]``
    with columns group-major: group 0 of every piece (in argument order), then group 1, ..."""
    blocks = [np.asarray(p).reshape(groups, -1, np.shape(p)[-1]) for p in parts]
    return np.concatenate(blocks, axis=1).reshape(-1, blocks[0].shape[-1]).T


def swiglu_t(src: TensorSource, pre: str, h: int, i: int,
             interleave: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(gate_up [H, 2I], down [I, H])`` from ``gate_proj`` / ``up_proj`` / ``down_proj``;
    gate_up pair-interleaved (``layers.swiglu``) or, for stacked experts (``interleave=False``),
    gate | up."""
    gate = np.asarray(src.get(pre + "gate_proj.weight", (i, h)))
    up = np.asarray(src.get(pre + "up_proj.weight", (i, h)))
    gate_up = np.stack([gate, up], axis=1).reshape(2 * i, h).T if interleave else cat_t(gate, up)
    return gate_up, src.get(pre + "down_proj.weight", (h, i)).T


def fused_t(src: TensorSource, name: str, e: int, shape: tuple[int, int]) -> np.ndarray:
    """``[E, in, out]`` from a fused ``[E, out, in]`` expert tensor."""
    return np.asarray(src.get(name, (e, *shape))).transpose(0, 2, 1)


def stacked_t(src: TensorSource, fused: str, per_expert: str, e: int,
              shape: tuple[int, int]) -> np.ndarray:
    """``[E, in, out]`` from a fused ``[E, out, in]`` tensor or per-expert ``[out, in]`` ones
    (``per_expert`` a format string of the expert index)."""
    if fused in src:
        return fused_t(src, fused, e, shape)
    return np.stack([np.asarray(src.get(per_expert.format(j), shape)).T for j in range(e)])


def swiglu_experts_t(src: TensorSource, pre: str, e: int, h: int,
                     i: int) -> tuple[np.ndarray, np.ndarray]:
    """Stacked SwiGLU experts ``(gate_up [E, H, 2I] gate | up, down [E, I, H])`` from
    transformers' fused ``gate_up_proj`` / ``down_proj`` or per-expert ``{j}.gate_proj`` ..."""
    if pre + "gate_up_proj" in src:
        return (fused_t(src, pre + "gate_up_proj", e, (2 * i, h)),
                fused_t(src, pre + "down_proj", e, (h, i)))
    pairs = [swiglu_t(src, f"{pre}{j}.", h, i, interleave=False) for j in range(e)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def plain_norm_t(src: TensorSource, name: str, size: int) -> np.ndarray:
    """A norm weight ``[size]``."""
    return src.get(name, (size,))
