"""SGLang's own ``bench_serving`` (sglang 0.5.20, ``--backend sglang``: its native ``/generate``
client) against a running mambacache server, on the generated-shared-prefix shape (issue 31).

    python scripts/sglang_bench_serving.py --write-tokenizer DIR      # any Python with tokenizers
    python -m mambacache.serve --set serve.tokenizer=DIR --port 8765 &
    /work/sglenv/bin/python scripts/sglang_bench_serving.py --tokenizer DIR --port 8765 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 4 ...

``--write-tokenizer``: the server's built-in byte-level tokenizer as a Hugging Face
``tokenizer.json`` (``serve.tokenizer.write_byte_tokenizer_json``), so SGLang's client
(``transformers.AutoTokenizer``) and the server count the same tokens. Otherwise the arguments
go to ``sglang.bench_serving`` with ``--backend sglang`` and ``--model`` defaulted to
``--tokenizer``. sglang is installed ``--no-deps`` beside CPU torch, and its utility module
imports ``torchvision`` (a CUDA build on PyPI) at import: the inert stand-in of
``compare_sglang_tree.py`` is put in front first (nothing here calls it).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # mambacache, from anywhere

def run_bench_serving(argv: list[str]) -> None:
    from compare_sglang_tree import inert_torchvision

    inert_torchvision()
    if "--tokenizer" in argv and "--model" not in argv:
        argv += ["--model", argv[argv.index("--tokenizer") + 1]]
    sys.argv = ["bench_serving", "--backend", "sglang", *argv]
    runpy.run_module("sglang.bench_serving", run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-tokenizer"]:
        from mambacache.serve.tokenizer import write_byte_tokenizer_json

        write_byte_tokenizer_json(sys.argv[2])
    else:
        run_bench_serving(sys.argv[1:])
