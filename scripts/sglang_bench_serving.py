"""SGLang's own ``bench_serving`` (sglang 0.5.20, ``--backend sglang``: its native ``/generate``
client) against a running mambacache server, on the generated-shared-prefix shape (issue 31).

    python scripts/sglang_bench_serving.py --write-tokenizer DIR      # any Python with tokenizers
    python -m mambacache.serve --set serve.tokenizer=DIR --port 8765 &
    /work/sglenv/bin/python scripts/sglang_bench_serving.py --tokenizer DIR --port 8765 \\
        --dataset-name generated-shared-prefix --gsp-num-groups 4 ...

``--write-tokenizer``: the server's built-in byte-level tokenizer (ids 0-255 the bytes, then
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) as a Hugging Face ``tokenizer.json`` (byte
level BPE without merges), so SGLang's client (``transformers.AutoTokenizer``) and the server
count the same tokens. Otherwise the arguments go to ``sglang.bench_serving`` with ``--backend
sglang`` and ``--tokenizer`` / ``--model`` defaulted. sglang is installed ``--no-deps`` beside
CPU torch, and its utility module imports ``torchvision`` (a CUDA build on PyPI) at import: the
inert stand-in of ``compare_sglang_tree.py`` is put in front first (nothing here calls it).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_tokenizer(directory: str) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` of the byte-level tokenizer in
    ``directory``; the server's ``HFTokenizer`` and ``transformers`` both read it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(ByteLevel.alphabet())  # the 256 printable stand-ins of the bytes
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0],
        "model_max_length": 1 << 20}))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ``ByteLevel`` pre-tokenizes to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def run_bench_serving(argv: list[str]) -> None:
    from compare_sglang_tree import inert_torchvision

    inert_torchvision()
    if "--tokenizer" in argv and "--model" not in argv:
        argv += ["--model", argv[argv.index("--tokenizer") + 1]]
    sys.argv = ["bench_serving", "--backend", "sglang", *argv]
    runpy.run_module("sglang.bench_serving", run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-tokenizer"]:
        write_tokenizer(sys.argv[2])
    else:
        run_bench_serving(sys.argv[1:])
