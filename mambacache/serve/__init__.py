"""The OpenAI-compatible HTTP server around one ``Engine``.

``tokenizer`` (text <-> ids, chat templates), ``detokenize`` (incremental text, stop strings),
``protocol`` (request validation, OpenAI response shapes), ``engine_loop`` (the engine stepping in
one background thread, an asyncio front), ``metrics`` (Prometheus), ``app`` (FastAPI routes) and
``__main__`` (``python -m mambacache.serve``). The engine never imports this package; this
package uses only the engine's public surface (``add_request`` / ``step`` / ``abort`` /
``metrics`` / ``check_integrity``) plus the live request's generated ids (``engine_loop``).
"""
