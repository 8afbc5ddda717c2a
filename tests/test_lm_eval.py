"""lm-eval's ``local-completions`` log-likelihood scoring against the server (issue 31): a tiny
local multiple-choice task (``output_type: multiple_choice``: ``echo: true, logprobs: 1,
max_tokens: 1`` per choice) runs to a score, and each choice's log-likelihood equals the
engine's own from-scratch scoring of the same tokens.

The tiny model's tokenizer is bytes; lm-eval gets the same ids from a byte-level
``tokenizer.json`` written here (``tokenizers``: ByteLevel, one token per byte, id = byte).

Marker ``lm_eval`` (excluded by default; needs the ``eval`` extra):
``pytest -m lm_eval -n 0 tests/test_lm_eval.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_helpers import MODEL, running_server

from mambacache.serve.tokenizer import write_byte_tokenizer_json

NO_WARMUP = {"serve.warmup": False}  # the first requests compile what they use

pytestmark = pytest.mark.lm_eval

QUESTIONS = [
    ("The cache keeps", ["state snapshots", "nothing at all", "a recipe"], 0),
    ("A hybrid model mixes", ["attention and recurrence", "paint"], 0),
    ("Pages hold", ["keys and values", "soup", "stars", "rain"], 0),
    ("Two plus two is", ["four", "five"], 0),
    ("The sky is", ["blue", "green", "loud"], 0),
    ("JAX compiles with", ["XLA", "a hammer"], 0),
]


def write_task(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    name = "mambacache_tiny_mc"
    (directory / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
""")
    return name


def test_lm_eval_multiple_choice_runs_to_a_score(tmp_path, monkeypatch):
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        pytest.fail("lm-eval is not installed: pip install -e '.[eval]'")

    from mambacache.engine.runners.scoring import Scorer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_byte_tokenizer_json(tmp_path / "tok", specials=False)
    task = write_task(tmp_path / "task")
    with running_server(**NO_WARMUP) as srv:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": MODEL, "base_url": f"{srv.url}/v1/completions",
                        "tokenizer": str(tmp_path / "tok"), "tokenizer_backend": "huggingface",
                        "num_concurrent": 1, "max_retries": 1},
            tasks=[task], task_manager=TaskManager(include_path=str(tmp_path / "task")),
            log_samples=True)
        acc = out["results"][task]["acc,none"]
        assert 0.0 <= acc <= 1.0
        samples = out["samples"][task]
        assert len(samples) == len(QUESTIONS)
        scorer = Scorer(srv.engine)
        for s in samples:
            context = srv.tokenizer.encode(s["arguments"][0][0])
            for (ctx, cont), resp in zip(s["arguments"], s["resps"], strict=True):
                assert srv.tokenizer.encode(ctx) == context
                ids = context + srv.tokenizer.encode(cont)
                expected = sum(srv.on_engine(lambda e, ids=ids: scorer.score(ids).logprobs)
                               [len(context):])
                assert resp[0][0] == pytest.approx(expected, abs=1e-3), (ctx, cont)
    print(f"lm-eval {task}: acc {acc:.3f} over {len(samples)} questions")
