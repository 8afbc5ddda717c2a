"""The server while it starts: ``/health`` answers 503 with the start's stage (the warm-up's
"compiled N of M programs") until the engine is ready, then 200; each stage is logged."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import uvicorn
from engine_helpers import make_engine
from serve_helpers import SERVER

from mambacache.serve.app import create_app
from mambacache.serve.tokenizer import ByteTokenizer


def test_health_says_the_stage_until_ready(caplog):
    engine = make_engine(**SERVER)
    release = threading.Event()

    def slow_warmup(max_seq_len=None, logit_controls=False, progress=None):
        progress("compiled 1 of 2 programs (decode 4 tokens x 64 pages: 0.1 s)")
        assert release.wait(60)
        progress("compiled 2 of 2 programs (extend 16 tokens x 64 pages: 0.1 s)")
        return {"programs": 2}

    engine.warmup = slow_warmup
    app = create_app(engine, ByteTokenizer(engine.model_cfg.vocab_size), engine.cfg.serve,
                     model_name="tiny")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.INFO, logger="mambacache.serve.engine_loop")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                if "compiled 1 of 2" in r.json().get("stage", ""):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no stage from /health"
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        release.set()
        while (r := httpx.get(f"{url}/health", timeout=5)).status_code != 200:
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        assert r.json() == {"status": "ok"}
        assert app.state.server.loop.stage == "ready"
        logged = caplog.text
        assert "start: compiled 1 of 2 programs" in logged and "start: ready" in logged
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_the_server_says_it_warms_up_so_its_programs_compile_while_loading(monkeypatch):
    import pytest

    import mambacache.engine.engine as engine_mod
    from mambacache.serve.__main__ import main

    seen = []

    def fake_engine(cfg, **kwargs):
        seen.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_mod, "Engine", fake_engine)
    for extra, want in ((["--set", "serve.warmup_max_seq_len=64"], 64),
                        (["--set", "serve.warmup=false"], None)):
        with pytest.raises(RuntimeError, match="stop here"):
            main(extra)
        assert seen.pop() == {"warmup_max_seq_len": want}
