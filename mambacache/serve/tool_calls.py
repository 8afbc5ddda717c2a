"""Tool calls in generated text, as the Qwen and Hermes chat templates ask models to write them,
turned into OpenAI ``tool_calls``.

Formats (inside ``<tool_call>`` ... ``</tool_call>``, any number of blocks):

- Hermes / Qwen2.5 / Qwen3 (JSON): ``{"name": "f", "arguments": {"x": 1}}``;
- Qwen3-Coder / Qwen3.5 (XML): ``<function=f><parameter=x>1</parameter></function>``; a
  parameter's text is parsed as JSON when it is JSON (numbers, booleans, objects), else kept as
  a string.

``parse_tool_calls(text)`` returns the text outside the blocks (``None`` if only whitespace) and
the calls; a block that parses as neither format stays in the text (never a silent drop).
``stream_chunks`` streams a finished answer as OpenAI streams calls: the role, the content, then
per call a delta with ``index``, ``id``, ``type`` and the function's name (arguments ``""``) and
one with its arguments, then the finish reason. Pure functions: no server, no tokenizer
(``tool_choice`` "required" / a named function is a grammar: ``structured.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _json_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args if args is not None else {})


def _param_value(text: str) -> Any:
    text = text.strip("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _xml_call(body: str) -> dict[str, Any] | None:
    m = _FUNCTION.search(body)
    if m is None:
        return None
    params = {k: _param_value(v) for k, v in _PARAMETER.findall(m.group(2))}
    return _call(m.group(1), params)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the tool-call blocks, the calls in order)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        body = m.group(1).strip()
        call = _json_call(body) or _xml_call(body)
        kept.append(text[pos:m.start()] if call is not None else text[pos:m.end()])
        if call is not None:
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    return (content if content.strip() else None), calls


def request_tools(req: Any) -> list[dict[str, Any]] | None:
    """The ``tools`` of a chat request (an undeclared field: ``model_extra``), if any and
    ``tool_choice`` is not ``"none"``."""
    extra = getattr(req, "model_extra", None) or {}
    tools = extra.get("tools")
    if not tools or extra.get("tool_choice") == "none":
        return None
    return tools if isinstance(tools, list) else None


def message_extras(message: Any) -> dict[str, Any]:
    """What a chat template needs of an earlier turn's calls: ``tool_calls`` of an assistant
    message (``arguments`` as the JSON object the templates render) and ``tool_call_id``."""
    extra = getattr(message, "model_extra", None) or {}
    out: dict[str, Any] = {}
    if isinstance(extra.get("tool_calls"), list):
        calls = []
        for call in extra["tool_calls"]:
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": fn} if isinstance(call, dict) else call)
        out["tool_calls"] = calls
    if isinstance(extra.get("tool_call_id"), str):
        out["tool_call_id"] = extra["tool_call_id"]
    return out


def apply(body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat body with the calls of its message's text as ``tool_calls``
    (``finish_reason`` ``"tool_calls"``); unchanged when the text has none."""
    for choice in body.get("choices", ()):
        message = choice.get("message") or {}
        content, calls = parse_tool_calls(message.get("content") or "")
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
    return body


def stream_chunks(body: dict[str, Any], shape: Any) -> Iterator[dict[str, Any]]:
    """The chunks of a non-streamed chat ``body`` (after ``apply``), ``shape`` a
    ``responses.ResponseShape``: content as one delta, each call as OpenAI streams it."""
    choice = body["choices"][0]
    message = choice.get("message") or {}
    yield shape.chunk(role=True)
    if message.get("content"):
        yield shape.chunk(text=message["content"], logprobs=choice.get("logprobs"))
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        for delta in ({"index": i, "id": call["id"], "type": "function",
                       "function": {"name": fn["name"], "arguments": ""}},
                      {"index": i, "function": {"arguments": fn["arguments"]}}):
            out = shape.chunk()
            out["choices"][0]["delta"] = {"tool_calls": [delta]}
            yield out
    yield shape.chunk(finish_reason=choice["finish_reason"])
