"""``Family``: what one Hugging Face model family owns, and the helpers families share.

A family turns its ``config.json`` into ``ModelConfig`` fields (every key it reads, with the
quirks of checkpoints as transformers writes them today), validates its own rules, lays out its
parameters, names its checkpoint tensors and chooses its block structure (norms, mixer per layer
kind, feed-forward). Everything outside ``models/families/`` asks the family object
(``models.families.get_family(cfg.family)``) instead of comparing family names.

Invariant: a family module imports nothing of ``mambacache`` (import contract
``families-no-engine`` in ``pyproject.toml``), and no module outside ``models/families/`` holds
a rule that is true of one family only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

    from models.config import ModelConfig
    from models.mixer_registry import Mixer
    from models.safetensors_io import TensorSource

INF = float("inf")


def require(cond: bool, msg: str) -> None:
    """``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def hf_float(value: Any) -> float:
    """A float as transformers writes it: a number, or ``{"__float__": "Infinity"}`` (its JSON
    encoding of the non-finite floats since 5.x), or the strings ``"inf"`` / ``"Infinity"``."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def unsupported(hf: Mapping[str, Any], checks: Mapping[str, Any], family: str) -> None:
    """``ValueError`` naming every key of ``checks`` whose value in ``hf`` (when present and not
    None) differs from the one we implement."""
    bad = {k: hf[k] for k, ok in checks.items() if k in hf and hf[k] is not None and hf[k] != ok}
    require(not bad, f"{family}: unsupported config values {bad}; supported: "
                     f"{ {k: checks[k] for k in bad} }")


def default_rope(hf: Mapping[str, Any], partial_default: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` / ``rope_scaling`` or the
    legacy top-level keys; only the default (unscaled) RoPE is implemented."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    require(rope_type == "default", f"only default RoPE is supported, got {rope_type!r}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor",
                               hf.get("partial_rotary_factor", partial_default)))
    return theta, partial


def check_rotary(cfg: ModelConfig) -> None:
    """Partial NeoX RoPE over ``head_dim * partial_rotary_factor`` features: that count must be
    even and in ``(0, head_dim]`` (only for a config that rotates)."""
    if not cfg.use_rope:
        return
    rot = cfg.rotary_dim
    require(0 < rot <= cfg.head_dim and rot % 2 == 0,
            f"rotary dim head_dim * partial_rotary_factor = {rot} must be even and in "
            f"(0, head_dim={cfg.head_dim}]")


def check_mixer_and_mlp_everywhere(cfg: ModelConfig) -> None:
    """Every layer has a mixer and a feed-forward (all families but Nemotron-H)."""
    require("none" not in cfg.layer_types + cfg.mlp_types,
            f"'none' layer or MLP types are for nemotron_h only, not {cfg.family}")


class Family:
    """One model family. Subclasses set the class attributes and implement the methods; one
    instance per family is registered in ``models.families.FAMILIES``.

    ``architectures`` / ``model_types``: the ``config.json`` values that select this family.
    ``supports_mtp``: the checkpoint can carry the Qwen-style MTP head (``models/mtp.py``).
    ``plain_norms``: layer norms multiply by ``w`` (not ``1 + w``), for the seeded init.
    ``linear_groups_replicate``: under tensor parallelism the linear mixer's key groups may be
    split or, when the degree exceeds them, replicated (each device the one group its heads
    read: Mamba2's B / C); otherwise the degree must divide them like any head count.
    Block structure (``models/model.py``'s one loop): ``mixers`` maps a layer type
    (``linear_attention`` / ``full_attention``) to its ``models.mixer_registry.Mixer``; ``norm``
    ``(x, w, eps)`` is every norm of the family; ``ffn(cfg, layer, x, impl, mesh)`` the
    feed-forward of a layer whose MLP type is not ``none``. A layer is ``h += m *
    mixer(norm(h))`` (unless its type is ``none``) then ``h += m * ffn(norm(h))`` (unless its
    MLP type is ``none``; the second norm is ``post_norm``, or ``input_norm`` for a one-sublayer
    block), ``m`` the residual multiplier.
    """

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    supports_mtp: bool = False
    plain_norms: bool = True
    linear_groups_replicate: bool = False
    mixers: Mapping[str, Mixer] = {}
    norm: Callable[..., jax.Array]
    ffn: Callable[..., jax.Array]

    def config_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """``ModelConfig`` keyword arguments for a ``config.json`` dict of this family."""
        raise NotImplementedError

    def validate(self, cfg: ModelConfig) -> None:
        """``ValueError`` unless ``cfg`` keeps this family's own rules (the generic ones are
        ``ModelConfig``'s)."""

    def layer_shapes(self, cfg: ModelConfig, kind: str, mlp: str) -> dict[str, Any]:
        """The parameter dict of one decoder layer (norms included) with shape-tuple leaves,
        for ``layer_types[i] == kind`` and ``mlp_types[i] == mlp``."""
        raise NotImplementedError

    def load_trunk(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        """``embed``, ``final_norm`` and ``layers`` (numpy, the ``layer_shapes`` layout) from a
        checkpoint's tensors; the loader adds ``lm_head`` and checks for unused tensors."""
        raise NotImplementedError

    def load_mtp(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        """The MTP head's params from ``mtp.*`` (families with ``supports_mtp``)."""
        raise ValueError(f"an MTP head is not supported for {self.name}")

    def __repr__(self) -> str:
        return f"<family {self.name}>"
