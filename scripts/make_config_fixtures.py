"""Write transformers' default configs of every supported family as JSON fixtures.

    python scripts/make_config_fixtures.py [--out tests/fixtures/hf_defaults]

One ``<ConfigClass>.json`` per family, exactly as ``save_pretrained`` writes ``config.json``
(``to_json_string(use_diff=False)``: non-finite floats as ``{"__float__": "Infinity"}``). These
defaults are published models' sizes (Qwen3-Next-80B-A3B, Qwen3.5-9B, Qwen3.5-35B-A3B,
Kimi-Linear-48B-A3B, ...), so ``tests/test_hf_configs.py`` parses them with no transformers
installed. Needs transformers (never a runtime or CI dependency).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CLASSES = ("Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig", "NemotronHConfig",
           "GraniteMoeHybridConfig", "KimiLinearConfig")


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/hf_defaults"))
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for name in CLASSES:
        config = getattr(transformers, name)()
        (out / f"{name}.json").write_text(config.to_json_string(use_diff=False))
        print(f"wrote {out / name}.json (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
