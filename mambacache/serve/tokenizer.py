"""Text <-> token ids for the server: a Hugging Face ``tokenizer.json`` (``tokenizers``) with the
chat template of ``tokenizer_config.json`` (jinja2), or the built-in byte-level tokenizer that fits
the embedded tiny models (ids 0-255 are bytes, then three special tokens; nothing to download).

Chat messages are encoded by ``encode_chat``: special-token text inside a message (``<|im_end|>``
typed by a user) becomes ordinary text ids, so only the template makes control tokens and no
message can forge a turn; a completion prompt given as text is the client's whole prompt and
keeps its special tokens.

Invariants: ``encode`` never returns an id >= ``vocab_size``; ``decode`` of any id below
``vocab_size`` succeeds (ids the tokenizer does not know decode to ""); ``stop_token_ids`` are the
ids that end a generation unless the request sets ``ignore_eos``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NUM_BYTES = 256
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, the format of the Qwen chat models, for the byte-level tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplate:
    """A jinja2 chat template in a sandbox, rendered the way ``transformers`` renders it
    (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``)."""

    def __init__(self, source: str, special: Mapping[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.ChainableUndefined)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special = dict(special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return self.template.render(messages=list(messages), tools=tools,
                                    add_generation_prompt=add_generation_prompt, **self.special)


class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes; 256, 257, 258 are ``<|endoftext|>`` (EOS),
    ``<|im_start|>`` and ``<|im_end|>``; ids 259 .. ``vocab_size - 1`` are unused (decode to
    "")."""

    name = "byte"

    def __init__(self, vocab_size: int):
        need = NUM_BYTES + len(BYTE_SPECIALS)
        if vocab_size < need:
            raise ValueError(f"the byte-level tokenizer needs a vocabulary of at least {need} ids, "
                             f"the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.special_ids = {s: NUM_BYTES + i for i, s in enumerate(BYTE_SPECIALS)}
        self._special_re = re.compile("(" + "|".join(map(re.escape, BYTE_SPECIALS)) + ")")
        self.eos_token_ids = (self.special_ids["<|endoftext|>"],)
        self.chat_stop_token_ids = (self.special_ids["<|im_end|>"],)
        self.chat_template = ChatTemplate(CHATML_TEMPLATE, {"bos_token": "",
                                                            "eos_token": "<|endoftext|>"})

    @property
    def special_texts(self) -> tuple[str, ...]:
        return BYTE_SPECIALS

    def encode_text(self, text: str) -> list[int]:
        """Bytes of ``text``, special strings included (no control tokens)."""
        return list(text.encode("utf-8"))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Bytes of ``text``; the special strings above become their ids."""
        ids: list[int] = []
        for part in self._special_re.split(text):
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """UTF-8 of the byte ids (invalid bytes become U+FFFD); specials kept unless skipped."""
        out, run = [], bytearray()
        for t in ids:
            if 0 <= t < NUM_BYTES:
                run.append(t)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if not skip_special_tokens and t - NUM_BYTES < len(BYTE_SPECIALS):
                out.append(BYTE_SPECIALS[t - NUM_BYTES])
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """``tokenizer.json`` through ``tokenizers``; EOS ids from ``tokenizer_config.json`` and
    ``generation_config.json``; the chat template from ``tokenizer_config.json`` (or
    ``chat_template.jinja``), ChatML when the directory has none."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.name = d.name
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        conf = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}
        eos = {self.tok.token_to_id(special["eos_token"])} if special["eos_token"] else set()
        gen_eos = gen.get("eos_token_id")
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_token_ids = tuple(sorted(int(t) for t in eos if t is not None))
        im_end = self.tok.token_to_id("<|im_end|>")
        self.chat_stop_token_ids = () if im_end is None else (im_end,)
        source = _chat_template_source(d, conf)
        self.chat_template = ChatTemplate(source or CHATML_TEMPLATE,
                                          {k: v or "" for k, v in special.items()})

    @property
    def special_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.tok.get_added_tokens_decoder().values() if t.special)

    def encode_text(self, text: str) -> list[int]:
        """``text`` with its special-token strings split like any text (no control tokens)."""
        self.tok.encode_special_tokens = True
        try:
            return self.tok.encode(text, add_special_tokens=False).ids
        finally:
            self.tok.encode_special_tokens = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


Tokenizer = ByteTokenizer | HFTokenizer


_MARK = re.compile("(\ue000[0-9]+\ue001)")


def encode_chat(tok: Tokenizer, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The chat prompt of ``messages`` (dicts with ``role``, ``content``, maybe ``name``) as ids.
    A content holding special-token text is rendered as a private-use marker and encoded as text
    where the marker lands; ``ValueError`` naming the message if the template drops or repeats
    it, or if a ``name`` holds special-token text."""
    literal: dict[str, str] = {}
    safe = []
    for i, m in enumerate(messages):
        if any(s in str(m.get("name") or "") for s in tok.special_texts):
            raise ValueError(f"messages[{i}].name holds special-token text")
        if any(s in m["content"] for s in tok.special_texts):
            mark = f"\ue000{i}\ue001"
            literal[mark] = m["content"]
            m = {**m, "content": mark}
        safe.append(m)
    text = tok.chat_template.render(safe, tools=tools)  # tools: the request's (tool_calls.py)
    if not literal:
        return tok.encode(text, add_special_tokens=False)
    ids: list[int] = []
    seen = []
    for part in _MARK.split(text):
        if part in literal:
            ids += tok.encode_text(literal[part])
            seen.append(part)
        elif part:
            ids += tok.encode(part, add_special_tokens=False)
    if sorted(seen) != sorted(literal):
        raise ValueError("the chat template changed a message that holds special-token text; "
                         "it cannot be encoded as text")
    return ids


def write_byte_tokenizer_json(directory: str | Path, *, specials: bool = True) -> None:
    """The byte-level tokenizer as a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``
    in ``directory`` (ByteLevel BPE without merges: id = byte; ``specials``: then the three
    special tokens, EOS ``<|endoftext|>``), for clients that count tokens with ``transformers``
    (SGLang's ``bench_serving``, lm-eval): they get the server's ids. ``HFTokenizer`` reads it
    back with the same ids as ``ByteTokenizer``."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    tok = HFTok(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": 1 << 20}
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in BYTE_SPECIALS])
        config["eos_token"] = BYTE_SPECIALS[0]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (ByteLevel's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(NUM_BYTES):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` writes a special token as a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(d: Path, conf: Mapping[str, Any]) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    tpl = conf.get("chat_template")
    if isinstance(tpl, list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def load_tokenizer(spec: str, model_path: str | None, model_vocab: int) -> Tokenizer:
    """``spec``: "auto" (``model_path``'s ``tokenizer.json``, the byte-level one without a
    ``model_path``), "byte", or a directory holding ``tokenizer.json``. The tokenizer's ids must
    fit the model's vocabulary (``ValueError`` naming both sizes)."""
    if spec == "byte" or (spec == "auto" and model_path is None):
        return ByteTokenizer(model_vocab)
    directory = Path(model_path if spec == "auto" else spec)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in {str(directory)!r}; set serve.tokenizer to a "
                         "directory that has one, or to \"byte\" for the byte-level tokenizer")
    tok = HFTokenizer(directory)
    if tok.vocab_size > model_vocab:
        raise ValueError(f"tokenizer vocabulary ({tok.vocab_size}) exceeds the model's "
                         f"vocab_size ({model_vocab})")
    return tok
