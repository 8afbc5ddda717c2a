"""Who may call the server and whose cached prefixes a request may match.

``serve.api_key`` (one key or several, comma-separated) makes every route but ``/health`` need
``Authorization: Bearer <key>``; anything else is a 401 (compared in constant time per key).
A request's cache namespace (the engine's ``extra_key``, which the radix tree keeps apart) is made
of its tenant, the SHA-256 of its bearer key when ``serve.isolate_cache_by_key`` is on, and of its
``cache_salt``: two requests share cached prefixes, and ``cached_tokens`` counts a prefix, only
when both parts are equal. Without either part the namespace is the shared default (``None``).
"""

from __future__ import annotations

import hashlib
import secrets

from mambacache.serve.protocol import ApiError


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class Auth:
    """The ``[serve]`` section's ``api_key`` and ``isolate_cache_by_key``."""

    def __init__(self, api_key: str, isolate_cache_by_key: bool):
        self.keys = tuple(k.strip() for k in api_key.split(",") if k.strip())
        self.isolate = isolate_cache_by_key

    def authorize(self, header: str | None) -> None:
        """``ApiError`` 401 unless keys are off or the header carries one of them."""
        if not self.keys:
            return
        token = bearer(header) or ""
        ok = False
        for key in self.keys:  # every key compared: the time does not say which matched
            ok |= secrets.compare_digest(token.encode("utf-8"), key.encode("utf-8"))
        if not ok:
            raise ApiError("missing or invalid API key: send 'Authorization: Bearer <key>'",
                           status=401, type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def cache_namespace(self, header: str | None, cache_salt: str | None) -> str | None:
        """The request's ``extra_key``: tenant and salt digests, or None (shared)."""
        parts = []
        token = bearer(header)
        if self.isolate and token:
            parts.append(f"tenant:{_digest(token)}")
        if cache_salt is not None:
            parts.append(f"salt:{_digest(cache_salt)}")
        return "|".join(parts) or None
