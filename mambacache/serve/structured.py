"""Structured output: ``response_format`` (``json_object``, ``json_schema``), ``tools`` with
``tool_choice`` ``"required"`` or a named function, and ``/generate``'s ``json_schema`` /
``regex``, as grammars (llguidance) whose token masks the sampler applies on the device
(``engine/sampling/logit_controls.py``).

llguidance, not xgrammar: xgrammar 0.2.9's wheel requires torch, transformers and triton and
imports torch and transformers when imported; llguidance (the grammar engine vLLM and SGLang
also offer) is one Rust wheel with numpy bitmasks and no Python dependencies.

Invariants: JSON is compiled with ``whitespace_flexible: false`` (no whitespace between JSON
tokens), so a model cannot loop on whitespace: a schema of bounded values (enums, booleans,
``additionalProperties: false``) ends in a bounded number of tokens. A forced tool call is the
text ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` (the Hermes / Qwen format
``tool_calls.py`` parses), its arguments the function's ``parameters`` schema. The grammar's
end tokens are the tokenizer's EOS ids and its chat stop ids: once the grammar is complete the
matcher is ``done`` and the request stops. A bad schema is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mambacache.serve.protocol import ApiError
from mambacache.serve.tokenizer import BYTE_SPECIALS, NUM_BYTES, ByteTokenizer

NO_WHITESPACE = {"whitespace_flexible": False}


def _llguidance(param: str) -> Any:
    try:
        import llguidance
    except ImportError:
        raise ApiError(f"{param}: structured output needs llguidance (pip install "
                       "'mambacache[structured]')", param=param) from None
    return llguidance


class LlgMatcher:
    """``logit_controls.ConstraintMatcher`` over an ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any):
        self.m = matcher

    def fill_bitmask(self, out: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        return bool(self.m.is_stopped())


class Grammar:
    """``logit_controls.TokenConstraint``: one compiled grammar, a fresh matcher per request."""

    def __init__(self, tokenizer: Any, grammar: str, param: str):
        import llguidance

        self.tokenizer, self.grammar = tokenizer, grammar
        err = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if err:
            raise ApiError(f"{param}: the grammar is invalid: {err}", param=param)

    def matcher(self) -> LlgMatcher:
        import llguidance

        return LlgMatcher(llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0))


class _ByteVocab:
    """The byte-level tokenizer as llguidance's ``TokenizerWrapper`` wants it."""

    def __init__(self, tok: ByteTokenizer):
        self.eos_token_id = tok.eos_token_ids[0]
        self.bos_token_id = None
        specials = [s.encode() for s in BYTE_SPECIALS]
        self.tokens = ([bytes([i]) for i in range(NUM_BYTES)] + specials
                       + [b""] * (tok.vocab_size - NUM_BYTES - len(specials)))
        self.special_token_ids = [NUM_BYTES + i for i in range(len(specials))]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """The tokenizer as an ``llguidance.LLTokenizer`` over the model's ``vocab_size`` ids, its
    end tokens EOS and the chat stop ids. Built once per tokenizer (about a second for a large
    vocabulary) and kept on it."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    ends = sorted(set(tokenizer.eos_token_ids) | set(tokenizer.chat_stop_token_ids))
    if isinstance(tokenizer, ByteTokenizer):
        source: Any = TokenizerWrapper(_ByteVocab(tokenizer))
    else:
        source = tokenizer.tok.to_str()
    out = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=ends)
    tokenizer._llg_tokenizer = out
    return out


def json_grammar(schema: Any, param: str) -> str:
    llguidance = _llguidance(param)
    if not isinstance(schema, dict):
        raise ApiError(f"{param}: the schema must be a JSON object", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=NO_WHITESPACE)
    except ValueError as err:
        raise ApiError(f"{param}: {err}", param=param) from None


def response_format_grammar(fmt: Any) -> str | None:
    """``response_format`` -> a grammar (None: free text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        if kind is None:
            raise ApiError("response_format: needs a type (text, json_object, json_schema)",
                           param="response_format.type")
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return json_grammar(schema if schema is not None else {},
                            "response_format.json_schema.schema")
    raise ApiError(f"response_format.type: {kind!r} is not one of text, json_object, "
                   "json_schema", param="response_format.type")


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") or {}
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn.get("name")},
                                             "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_choice_grammar(tools: list[dict[str, Any]] | None, choice: Any) -> str | None:
    """A forced tool call's grammar: ``"required"`` (any of ``tools``) or ``{"type":
    "function", "function": {"name": ...}}`` (that one); None for ``"auto"`` / ``"none"``."""

    if choice in (None, "auto", "none") or not tools:
        return None
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if (t.get("function") or {}).get("name") == name]
        if not chosen:
            raise ApiError(f"tool_choice: no tool named {name!r} in tools",
                           param="tool_choice")
    else:
        raise ApiError("tool_choice: must be none, auto, required or a named function",
                       param="tool_choice")
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": NO_WHITESPACE}
    lark = 'start: "<tool_call>\\n" %json ' + json.dumps(schema) + ' "\\n</tool_call>"'
    return _llguidance("tool_choice").LLMatcher.grammar_from_lark(lark)


def constraint(server: Any, grammar: str | None, param: str) -> Grammar | None:
    """The ``SamplingParams.constraint`` of ``grammar`` on ``server``'s tokenizer."""
    if grammar is None:
        return None
    tok = ll_tokenizer(server.tokenizer, server.engine.model_cfg.vocab_size)
    return Grammar(tok, grammar, param)


def for_openai(server: Any, req: Any, chat: bool) -> Grammar | None:
    """The constraint of an OpenAI request: its ``response_format``, or (chat) a forced tool
    call."""
    extra = getattr(req, "model_extra", None) or {}
    grammar = response_format_grammar(getattr(req, "response_format", None))
    param = "response_format"
    if grammar is None and chat:
        grammar = tool_choice_grammar(extra.get("tools"), extra.get("tool_choice"))
        param = "tool_choice"
    return constraint(server, grammar, param)


def for_sglang(server: Any, sp: Any) -> Grammar | None:
    """``/generate``'s ``sampling_params.json_schema`` (a string, as SGLang takes it) or
    ``regex``."""
    if sp.json_schema is not None:
        try:
            schema = json.loads(sp.json_schema)
        except json.JSONDecodeError as err:
            raise ApiError(f"sampling_params.json_schema: not JSON: {err}",
                           param="sampling_params.json_schema") from None
        return constraint(server, json_grammar(schema, "sampling_params.json_schema"),
                          "sampling_params.json_schema")
    if sp.regex is not None:
        grammar = _llguidance("sampling_params.regex").LLMatcher.grammar_from_regex(sp.regex)
        return constraint(server, grammar,
                          "sampling_params.regex")
    return None
