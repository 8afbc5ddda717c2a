"""``python -m mambacache.serve --config CONFIG [--set section.key=value ...] [--host H]
[--port P] [--api-key KEY]``: load the model, build the tokenizer, serve the OpenAI API with
uvicorn."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mambacache.config import EngineConfig, parse_set_args


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mambacache.serve",
                                description="OpenAI-compatible server over one engine.")
    p.add_argument("--config", default=None, help="engine TOML (default: the embedded tiny model)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--host", default=None, help="overrides serve.host")
    p.add_argument("--port", type=int, default=None, help="overrides serve.port")
    p.add_argument("--api-key", default=None,
                   help="overrides serve.api_key: bearer key(s), comma-separated")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = parse_set_args(args.set)
    if args.host is not None:
        overrides["serve.host"] = args.host
    if args.port is not None:
        overrides["serve.port"] = args.port
    if args.api_key is not None:
        overrides["serve.api_key"] = args.api_key
    return EngineConfig.load(args.config, overrides)


def model_name(cfg: EngineConfig) -> str:
    """``serve.model_name``, else the model directory's name, else the preset's."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    return Path(cfg.model.path).name if cfg.model.path else cfg.model.preset


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args)
    import uvicorn

    from mambacache.engine.engine import Engine
    from mambacache.parallel.plan import load_model_config
    from mambacache.serve.app import create_app
    from mambacache.serve.tokenizer import load_tokenizer

    # the engine is built in the engine thread (engine_loop.py): /health answers 503 with the
    # stage from the start, the weights' load included; the warm-up's programs compile while
    # the weights load (compile.while_loading "auto")
    vocab = load_model_config(cfg).vocab_size  # no weight read
    tokenizer = load_tokenizer(cfg.serve.tokenizer, cfg.model.path, vocab)
    app = create_app(lambda: Engine(cfg, warmup_max_seq_len=cfg.serve.warmup_max_seq_len
                                    if cfg.serve.warmup else None),
                     tokenizer, cfg.serve, model_name=model_name(cfg),
                     max_running=cfg.scheduler.max_running_requests)
    logging.getLogger("mambacache.serve").info("start: serving on %s:%d while the model "
                                               "loads (%s)", cfg.serve.host, cfg.serve.port,
                                               cfg.model.path or cfg.model.preset)
    uvicorn.run(app, host=cfg.serve.host, port=cfg.serve.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
