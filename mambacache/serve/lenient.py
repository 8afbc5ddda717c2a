"""Unknown request fields: ignored, never a 400, logged once per name, reported in a header.

Routers and clients add fields a server may not know (``sglang-router`` sends ``no_stop_trim``,
``return_hidden_states``, ``separate_reasoning``; the ``openai`` client ``tools``,
``response_format``). The request models (``protocol.py``) keep such fields aside
(``extra="allow"``) instead of refusing the body; this module names them. A *known* field with a
bad value is still a 400 (``protocol.parse_request``): leniency covers names only.

Invariants: each distinct field path (list indices dropped, ``messages.tool_call_id``) is logged
at most once per process (``IGNORED_LOGGED``); the response to a request that carried unknown
fields has the header ``IGNORED_HEADER`` listing them, comma-separated, in body order.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel

log = logging.getLogger(__name__)

IGNORED_HEADER = "X-Ignored-Fields"
#: field paths already logged (one warning per name, not per request)
IGNORED_LOGGED: set[str] = set()
_LOCK = threading.Lock()
_MAX_HEADER_NAMES = 32  # a body with thousands of unknown keys gets a bounded header
_MAX_NAME_CHARS = 64


def _walk(value: Any, prefix: str, out: list[str]) -> None:
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            out.append(f"{prefix}{name}")
        for name in type(value).model_fields:
            _walk(getattr(value, name), f"{prefix}{name}.", out)
    elif isinstance(value, list | tuple):
        for item in value:
            _walk(item, prefix, out)


#: undeclared fields that a module reads from ``model_extra`` (``tool_calls.py``): not ignored
READ_FROM_EXTRA = frozenset({"tools", "tool_choice", "messages.tool_calls",
                             "messages.tool_call_id"})


def ignored_fields(request: BaseModel) -> list[str]:
    """The unknown field paths of a parsed request (nested models too), each once, in order."""
    out: list[str] = []
    _walk(request, "", out)
    return [n for n in dict.fromkeys(out) if n not in READ_FROM_EXTRA]


def note_ignored(request: BaseModel) -> dict[str, str]:
    """Log each unknown field of ``request`` the first time its name is seen; the response
    headers that list them (empty when there are none)."""
    names = ignored_fields(request)
    if not names:
        return {}
    with _LOCK:
        fresh = [n for n in names if n not in IGNORED_LOGGED]
        IGNORED_LOGGED.update(fresh)
    if fresh:
        log.warning("ignored request fields this server does not know: %s (logged once per "
                    "name)", ", ".join(fresh))
    shown = names[:_MAX_HEADER_NAMES] + (["..."] if len(names) > _MAX_HEADER_NAMES else [])
    return {IGNORED_HEADER: ", ".join(_printable(n) for n in shown)}


def _printable(name: str) -> str:
    """A header-safe name: printable ASCII only (a key with a newline cannot split headers)."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in name[:_MAX_NAME_CHARS])
